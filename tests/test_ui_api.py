"""The web UI's HTTP API through a test client: schema-generated forms, problems at their fields with
the messages of `difftune check`, root confinement, the access token, JSON 4xx for bad requests, and
runs on the tiny model (progress, samples, stop, restart of the server, failures)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conftest import write_config
from difftune.config import ConfigError, TrainConfig, load_config
from difftune.config.datasets import DATASET_MODELS
from difftune.demo import make_dataset
from difftune.ui.server import access_token, create_app
from test_ui_runs import fake_run

JSON = {"Content-Type": "application/json"}


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "root"
    make_dataset(root / "images", count=4)
    write_config(root, root / "images", max_train_steps=4)
    return root


@pytest.fixture
def client(root, tmp_path) -> TestClient:
    return TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")


@pytest.fixture
def no_leftovers(tmp_path):
    """Runs live in their own sessions; end any a failed test left going."""
    yield
    from difftune.ui.runs import Registry

    registry = Registry(tmp_path / "state", tmp_path)
    for run in registry.list():
        if run.status()[0] in ("starting", "running", "stopping"):
            registry.command(run, "kill")


def body_of(root: Path) -> dict:
    config = json.loads((root / "config" / "config.json").read_text())
    datasets = json.loads((root / "config" / "multidatabackend.json").read_text())
    return {"path": str(root / "config" / "config.json"), "config": config, "datasets": datasets,
            "overwrite": True}  # a save replaces the files write_config wrote


def test_schema_is_generated_from_the_config_models(client):
    schema = client.get("/api/schema").json()
    fields = {f["name"]: f for f in schema["train"]}
    assert set(fields) == set(TrainConfig.model_fields)
    for name, info in TrainConfig.model_fields.items():
        assert fields[name]["description"] == info.description
        assert fields[name]["group"] == info.json_schema_extra["group"]
        assert fields[name]["advanced"] == info.json_schema_extra["advanced"]
    assert set(schema["datasets"]) == set(DATASET_MODELS)  # video appears when the schema offers it
    assert fields["model_family"]["kind"] == "choice" and fields["model_family"]["required"]
    assert fields["learning_rate"]["default"] == 1e-4
    assert fields["output_dir"]["path"] == "folder" and fields["data_backend_config"]["path"] == "file"
    assert all(f["path"] is None for f in schema["train"] if f["kind"] in ("choice", "const", "boolean"))
    image = {f["name"]: f for f in schema["datasets"]["image"]["fields"]}
    assert image["instance_data_dir"]["path"] == "folder"
    assert "tiny-random" in schema["flavours"]["lumina2"]


def test_the_eval_entry_form_leaves_out_what_eval_entries_refuse(client, root):
    """dataset_type 'eval': the form is an image entry's without repeats, probability and is_regularisation_data;
    each of them set on an eval entry is a problem at that key, and the form's entry without them checks clean."""
    from difftune.config.eval_keys import TRAINING_ONLY

    schema = client.get("/api/schema").json()["datasets"]
    image = [f["name"] for f in schema["image"]["fields"]]
    assert [f["name"] for f in schema["eval"]["fields"]] == [n for n in image if n not in TRAINING_ONLY]
    assert set(TRAINING_ONLY) <= set(image) and set(TRAINING_ONLY) == {"repeats", "probability",
                                                                        "is_regularisation_data"}
    body = body_of(root)
    make_dataset(root / "held", count=2)
    entry = {"id": "held", "type": "local", "dataset_type": "eval", "instance_data_dir": str(root / "held"),
             "caption_strategy": "textfile", "resolution": 64, "cache_dir_vae": str(root / "cache" / "held")}
    body["datasets"].append(entry)
    assert client.post("/api/config/check", json=body).json()["problems"] == []
    for key, value in (("repeats", 2), ("probability", 0.5), ("is_regularisation_data", True)):
        body["datasets"][-1] = {**entry, key: value}
        [problem] = client.post("/api/config/check", json=body).json()["problems"]
        assert (problem["dataset_index"], problem["key"]) == (2, key) and "never trained on" in problem["message"]


def test_open_check_and_save(client, root):
    opened = client.get("/api/config", params={"path": str(root / "config" / "config.json")}).json()
    assert opened["ok"] and opened["config"]["model_family"] == "lumina2" and len(opened["datasets"]) == 2
    body = {**body_of(root), "overwrite": False, "opened": opened["versions"]}  # the files this page opened
    body["config"]["learning_rate"] = 5e-5
    saved = client.put("/api/config", json=body).json()
    assert saved["ok"]
    assert load_config(root / "config" / "config.json").train.learning_rate == 5e-5


def test_problems_come_at_their_fields_with_the_messages_of_check(client, root):
    original = json.dumps(body_of(root))
    body = json.loads(original)
    body["config"].update(learning_rate="abc", lora_rnk=8)
    body["datasets"][0]["resolution"] = -1
    result = client.put("/api/config", json=body).json()
    assert not result["ok"]
    by_key = {(p["scope"], p["dataset_index"], p["key"]): p for p in result["problems"]}
    assert ("config", None, "learning_rate") in by_key
    assert by_key[("config", None, "lora_rnk")]["mentions"] == ["lora_rank"]  # "did you mean"
    assert ("datasets", 0, "resolution") in by_key  # shown even though config.json has problems too
    with pytest.raises(ConfigError) as e:
        load_config(root / "config" / "config.json")
    texts = {p["text"] for p in result["problems"]}
    assert set(e.value.problems) <= texts  # the same text as `difftune check` prints
    body = json.loads(original)
    body["config"]["max_train_steps"] = 0
    result = client.post("/api/config/check", json=body).json()
    [problem] = result["problems"]
    assert problem["key"] is None and {"max_train_steps", "num_train_epochs"} <= set(problem["mentions"])


def test_a_family_name_is_not_taken_for_a_key_it_contains(client, root):
    """"kandinsky5-video" named the key `video`: the page showed the model_family problem in the image
    dataset's Video block."""
    from difftune.config.problems import split_problem

    body = body_of(root)
    del body["config"]["model_family"]
    [problem] = [p for p in client.post("/api/config/check", json=body).json()["problems"] if p["key"] == "model_family"]
    assert "kandinsky5-video" in problem["message"] and problem["mentions"] == []
    assert split_problem("c.json: validation_num_video_frames: 9 is too few for image-to-video; lower "
                         "video.num_frames or --lora_rank", ("c.json",)).mentions == ("video", "lora_rank")


def test_start_refuses_a_config_with_problems(client, root):
    body = body_of(root)
    body["datasets"][0]["instance_data_dir"] = str(root / "missing")
    client.put("/api/config", json=body)
    r = client.post("/api/runs", json={"path": body["path"]})
    assert r.status_code == 422
    [problem] = r.json()["problems"]
    assert problem["key"] == "instance_data_dir" and problem["dataset_index"] == 0


def test_paths_stay_inside_the_roots(client, root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_text('{"model_family": "lumina2"}')
    (root / "escape").symlink_to(outside)
    (root / "inner").symlink_to(root / "images")
    for path in (str(root / ".." / "outside"), str(outside), "/etc", str(root / "escape"), "../outside"):
        r = client.get("/api/browse", params={"path": path})
        assert r.status_code == 403, path
        assert "error" in r.json()
    listing = client.get("/api/browse", params={"path": str(root)}).json()
    names = {e["name"] for e in listing["entries"]}
    assert "inner" in names and "escape" not in names  # a symlink inside the roots is fine
    assert client.get("/api/config", params={"path": str(root / "escape" / "secret.json")}).status_code == 403
    body = body_of(root)
    body["path"] = str(outside / "config.json")
    assert client.put("/api/config", json=body).status_code == 403
    assert not (outside / "config.json").exists()
    body = body_of(root)
    body["config"]["data_backend_config"] = str(outside / "datasets.json")
    assert client.put("/api/config", json=body).status_code == 403
    body = body_of(root)
    body["config"]["output_dir"] = str(outside / "out")
    body["datasets"][0]["instance_data_dir"] = str(root / "escape")
    problems = client.post("/api/config/check", json=body).json()["problems"]
    assert {(p["scope"], p["key"]) for p in problems} == {("config", "output_dir"), ("datasets", "instance_data_dir")}
    assert all("outside the folders" in p["message"] for p in problems)


def test_a_save_never_replaces_a_file_the_page_did_not_open(client, root):
    """"New" proposed config/config.json with config/multidatabackend.json, and Save replaced both without a
    word. An existing file is replaced only when it is the one the page opened, unchanged since, or when the
    user confirmed (`overwrite`); otherwise 409 names it and nothing is written."""
    config_path, data_path = root / "config" / "config.json", root / "config" / "multidatabackend.json"
    before = data_path.read_text(), config_path.read_text()
    fresh = {"model_type": "lora", "model_family": "lumina2", "data_backend_config": str(data_path)}
    new = {"path": str(root / "config" / "other.json"), "config": fresh, "datasets": [{"id": "image"}]}
    r = client.put("/api/config", json=new)
    assert r.status_code == 409 and r.json()["conflicts"] == [str(data_path)] and "already exists" in r.json()["error"]
    assert (data_path.read_text(), config_path.read_text()) == before and not (root / "config" / "other.json").exists()
    opened = client.get("/api/config", params={"path": str(config_path)}).json()
    body = {"path": str(config_path), "config": opened["config"], "datasets": opened["datasets"],
            "opened": opened["versions"]}
    assert set(opened["versions"]) == {str(config_path), str(data_path)}
    saved = client.put("/api/config", json=body)
    assert saved.status_code == 200, saved.text
    body["opened"] = saved.json()["versions"]  # what the page keeps after its save
    assert client.put("/api/config", json=body).status_code == 200
    data_path.write_text(data_path.read_text() + "\n")  # changed by someone else since
    r = client.put("/api/config", json=body)
    assert r.status_code == 409 and r.json()["conflicts"] == [str(data_path)]
    assert client.put("/api/config", json={**body, "overwrite": True}).status_code == 200  # confirmed
    assert client.put("/api/config", json={**new, "path": str(root / "new" / "config.json"),
                                           "config": {**fresh, "data_backend_config": str(root / "new" / "ds.json")}}
                      ).status_code == 200  # new files need no confirmation


def test_check_save_and_start_scan_the_datasets_as_difftune_check_does(client, root):
    """A dataset folder without images passed the page's check ("difftune check accepts this configuration")
    while `difftune check` refused it and the run failed seconds after it started."""
    (root / "empty").mkdir()
    (root / "empty" / "readme.txt").write_text("no images here")
    good = body_of(root)
    body = json.loads(json.dumps(good))
    body["datasets"][0]["instance_data_dir"] = str(root / "empty")
    typing = client.post("/api/config/check", json=body).json()
    assert typing["ok"] and not typing["scanned"]  # the check while typing reads no dataset files
    for answer in (client.post("/api/config/check", json={**body, "scan": True}).json(),
                   client.put("/api/config", json=body).json()):
        assert answer["scanned"] and not answer["ok"]
        [problem] = answer["problems"]
        assert (problem["scope"], problem["dataset_index"], problem["key"]) == ("datasets", 0, "instance_data_dir")
        assert "have no usable image or clip" in problem["message"]
    with pytest.raises(Exception, match="have no usable image or clip"):  # what `difftune check` says
        from difftune.train.plan import check_data
        check_data(load_config(root / "config" / "config.json"))
    r = client.post("/api/runs", json={"path": body["path"]})
    assert r.status_code == 422 and r.json()["problems"][0]["key"] == "instance_data_dir"
    assert client.get("/api/runs").json()["runs"] == []
    checked = client.post("/api/config/check", json={**good, "scan": True}).json()
    assert checked["ok"] and checked["scanned"]


def test_a_dataset_list_that_is_one_object_is_reported_not_emptied(client, root):
    config_path, data_path = root / "config" / "config.json", root / "config" / "multidatabackend.json"
    entry = json.loads(data_path.read_text())[0]
    data_path.write_text(json.dumps(entry))
    opened = client.get("/api/config", params={"path": str(config_path)}).json()
    assert not opened["ok"] and opened["datasets"] == []
    [problem] = opened["problems"]
    assert problem["scope"] == "datasets-list" and "must be a JSON list of entries, got dict" in problem["message"]
    assert str(data_path) not in opened["versions"]  # so a save asks before replacing it
    body = {"path": str(config_path), "config": opened["config"], "datasets": [], "opened": opened["versions"]}
    r = client.put("/api/config", json=body)
    assert r.status_code == 409 and r.json()["conflicts"] == [str(data_path)]
    assert json.loads(data_path.read_text()) == entry
    r = client.post("/api/runs", json={"path": str(config_path)})
    assert r.status_code == 422 and "must be a JSON list" in r.json()["problems"][0]["message"]


def test_a_dataset_list_with_a_json_mistake_opens_its_config_to_fix_it(client, root):
    config_path, data_path = root / "config" / "config.json", root / "config" / "multidatabackend.json"
    data_path.write_text('[{"id": "a",}]')
    opened = client.get("/api/config", params={"path": str(config_path)})
    assert opened.status_code == 200, opened.text
    opened = opened.json()
    assert not opened["ok"] and opened["datasets"] == [] and opened["config"]["model_family"]
    assert any("cannot use it as the dataset list" in p["message"] and "line 1" in p["message"]
               for p in opened["problems"]), opened["problems"]
    assert str(data_path) not in opened["versions"]  # a save asks before replacing it
    body = {"path": str(config_path), "config": opened["config"], "datasets": [], "opened": opened["versions"]}
    assert client.put("/api/config", json=body).status_code == 409
    assert data_path.read_text() == '[{"id": "a",}]'


def test_saved_configs_keep_their_text_readable(client, root):
    body = body_of(root)
    body["config"]["validation_prompt"] = "un gato 猫 बिल्ली"
    assert client.put("/api/config", json=body).status_code == 200
    text = (root / "config" / "config.json").read_text(encoding="utf-8")
    assert '"validation_prompt": "un gato 猫 बिल्ली"' in text


def test_server_start_up_errors_are_one_line_and_exit_2(tmp_path, capsys):
    """A missing root, a file as root and a port out of range ended in tracebacks; a busy port printed the URL
    (which opened whatever held the port) before failing."""
    import socket

    from difftune.cli import main

    (tmp_path / "afile").write_text("x")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, words in ((["--root", str(tmp_path / "missing")], "is not a folder"),
                            (["--root", str(tmp_path / "afile")], "is not a folder"),
                            (["--port", "99999"], "from 1 to 65535"),
                            (["--port", str(port)], "nothing was started"),
                            (["--state-dir", str(tmp_path / "afile")], "cannot keep the runs there")):
            assert main(["server", "--state-dir", str(tmp_path / "state"), *args]) == 2
            out, err = capsys.readouterr()
            assert err.startswith("error: ") and words in err and "Traceback" not in err, err
            assert "open http" not in out


def test_token_is_enforced_beyond_loopback(root, tmp_path):
    assert access_token("127.0.0.1", None) is None and access_token("localhost", None) is None
    assert access_token("0.0.0.0", None) and access_token("0.0.0.0", "given-16-chars-x") == "given-16-chars-x"
    assert access_token("127.0.0.1", "a") == "a"  # on loopback a token is an extra guard, of any length
    with pytest.raises(ConfigError, match="--token: 1 character.s. is too short .* at least 16"):
        access_token("0.0.0.0", "a")  # the only guard of a server reachable from the network
    assert access_token("192.168.1.5", None) != access_token("192.168.1.5", None)  # generated each start
    app = create_app([root], token="s3cret-token", state_dir=tmp_path / "state")
    c = TestClient(app, base_url="http://192.168.1.5:8001")
    for url in ("/", "/api/schema", "/static/app.js", "/api/runs"):
        r = c.get(url)
        assert r.status_code == 401 and "token" in r.json()["error"], url
    assert c.get("/api/schema", headers={"X-Difftune-Token": "wrong"}).status_code == 401
    assert c.get("/api/schema", headers={"X-Difftune-Token": "s3cret-token"}).status_code == 200
    assert c.get("/api/schema", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
    assert c.post("/api/runs", json={"path": "x"}, headers={"X-Difftune-Token": "nope"}).status_code == 401
    r = c.get("/?token=s3cret-token", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"
    assert "httponly" in r.headers["set-cookie"].lower()
    assert c.get("/api/schema").status_code == 200  # the cookie from the redirect
    assert c.get("/").status_code == 200


def test_without_a_token_only_loopback_names_and_same_origin_json(root, tmp_path):
    c = TestClient(create_app([root], state_dir=tmp_path / "state"), base_url="http://127.0.0.1:8001")
    assert c.get("/api/schema").status_code == 200
    assert c.get("/api/schema", headers={"Host": "evil.example:8001"}).status_code == 403  # DNS rebinding
    r = c.post("/api/runs", json={"path": "x"}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    r = c.post("/api/runs", content="path=x", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    assert c.get("/").headers["x-frame-options"] == "DENY"


def test_bad_requests_get_4xx_json_never_a_traceback(client, root):
    (root / "broken.json").write_text("{not json")
    (root / "list.json").write_text("[1, 2]")
    image = str(next((root / "images").glob("*.png")))
    requests = [
        ("POST", "/api/config/check", {"content": "{nope", "headers": JSON}),
        ("POST", "/api/config/check", {"json": [1, 2]}),
        ("POST", "/api/config/check", {"json": {"path": str(root / "c.json")}}),
        ("POST", "/api/config/check", {"json": {"path": str(root / "c.json"), "config": "x", "datasets": []}}),
        ("PUT", "/api/config", {"json": {"path": str(root / "x\x00.json"), "config": {}, "datasets": []}}),
        ("PUT", "/api/config", {"json": {"path": str(root / "images"), "config": {}, "datasets": []}}),
        ("PUT", "/api/config", {"json": {"path": "a" * 5000, "config": {}, "datasets": []}}),
        ("PUT", "/api/config", {"json": {"path": str(root / "c.json"), "datasets": [],
                                         "config": {"data_backend_config": image}}}),
        ("GET", "/api/config?path=" + str(root / "missing.json"), {}),
        ("GET", "/api/config?path=" + str(root / "broken.json"), {}),
        ("GET", "/api/config?path=" + str(root / "list.json"), {}),
        ("GET", "/api/config", {}),
        ("GET", "/api/browse?path=" + image, {}),
        ("GET", "/api/runs/nope", {}),
        ("GET", "/api/runs/..%2F..%2Fetc", {}),
        ("POST", "/api/runs", {"json": {"path": str(root / "broken.json")}}),
        ("POST", "/api/runs", {"json": {"path": 12}}),
        ("POST", "/api/runs/nope/command", {"json": {"command": "stop"}}),
        ("GET", "/api/runs/nope/file?path=../../etc/passwd", {}),
        ("DELETE", "/api/schema", {"headers": JSON}),
        ("GET", "/static/../server.py", {}),
        ("GET", "/no/such/page", {}),
    ]
    for method, url, kwargs in requests:
        r = client.request(method, url, **kwargs)
        assert 400 <= r.status_code < 500, (method, url, r.status_code, r.text)
        assert isinstance(r.json().get("error"), str) and r.json()["error"], (method, url)
        assert "Traceback" not in r.text and 'File "' not in r.text


def test_an_internal_error_is_json_without_a_traceback(client, monkeypatch):
    import difftune.ui.server as server

    def boom():
        raise RuntimeError("secret internals")

    monkeypatch.setattr(server, "form_schema", boom)
    r = client.get("/api/schema")
    assert r.status_code == 500 and "secret internals" not in r.text and "Traceback" not in r.text
    assert "internal error" in r.json()["error"]


def test_a_damaged_or_removed_run_folder_does_not_break_the_run_list(client, root, tmp_path):
    """A run.json with "started": "abc" made /api/runs answer 500 until the server restarted, even after the
    folder was removed."""

    good = fake_run(tmp_path, [], pid=None, exit_code=0)
    bad = tmp_path / "state" / "runs" / "r2"
    bad.mkdir(parents=True)
    shutil.move(str(good.folder), tmp_path / "state" / "runs" / "r1")  # into the registry's folder
    info = json.loads((tmp_path / "state" / "runs" / "r1" / "run.json").read_text())
    info["output_dir"] = str(root / "out")
    (tmp_path / "state" / "runs" / "r1" / "run.json").write_text(json.dumps(info))
    (bad / "run.json").write_text(json.dumps({**info, "id": "r2", "started": "abc"}))
    r = client.get("/api/runs")
    assert r.status_code == 200 and [run["id"] for run in r.json()["runs"]] == ["r1"]
    assert client.get("/api/runs/r2").status_code == 404
    shutil.rmtree(tmp_path / "state" / "runs" / "r1")
    assert client.get("/api/runs").json()["runs"] == [] and client.get("/api/runs/r1").status_code == 404
    assert client.get("/favicon.ico").status_code == 204  # no 404 in the browser's console on each load


# --- real runs on the tiny model ----------------------------------------------------------------------


def wait_for(client, run_id, condition, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        run = client.get(f"/api/runs/{run_id}").json()
        if condition(run):
            return run
        assert run["status"] != "failed" or condition(run), run
        time.sleep(0.5)
    raise AssertionError(f"timed out; last state: {run}")


def test_run_progress_samples_restart_and_stop(lumina2_dir, root, tmp_path, no_leftovers):
    write_config(root, root / "images", max_train_steps=2000, validation_prompt="a red circle",
                 validation_resolution="64x64", validation_step_interval=3, validation_num_inference_steps=2)
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")
    started = client.post("/api/runs", json={"path": str(root / "config" / "config.json")})
    assert started.status_code == 200, started.text
    run_id = started.json()["id"]
    assert client.post("/api/runs", json={"path": str(root / "config" / "config.json")}).status_code == 409
    run = wait_for(client, run_id, lambda r: r["status"] == "running" and r["samples"] and len(r["losses"]) >= 3)
    assert run["total_steps"] == 2000 and run["lr"] == 1e-3 and run["its"] > 0 and run["eta_s"] > 0
    sample = client.get(f"/api/runs/{run_id}/file", params={"path": run["samples"][0]["path"]})
    assert sample.status_code == 200 and sample.content[:4] == b"\x89PNG"
    # the server restarts: a new app over the same state folder finds the run still going
    restarted = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")
    assert [r["status"] for r in restarted.get("/api/runs").json()["runs"]] == ["running"]
    assert restarted.post(f"/api/runs/{run_id}/command", json={"command": "save"}).status_code == 200
    assert restarted.post(f"/api/runs/{run_id}/command", json={"command": "stop"}).status_code == 200
    run = wait_for(restarted, run_id, lambda r: r["status"] == "stopped")
    assert run["adapter"] == "pytorch_lora_weights.safetensors" and run["step"] < 2000
    assert any(o["path"] == "pytorch_lora_weights.safetensors" for o in run["outputs"])
    assert restarted.post(f"/api/runs/{run_id}/command", json={"command": "stop"}).status_code == 409


def test_crashes_and_kills_are_reported_as_failed(lumina2_dir, root, tmp_path, no_leftovers):
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")
    (root / "empty-model").mkdir()
    broken = write_config(root / "broken", root / "images", pretrained_model_name_or_path=str(root / "empty-model"))
    killed = write_config(root / "killed", root / "images", max_train_steps=5000)
    broken_id = client.post("/api/runs", json={"path": str(broken)}).json()["id"]
    killed_id = client.post("/api/runs", json={"path": str(killed)}).json()["id"]
    # an error event is "failed" at once; the trainer prints the error to its log a moment later (a CI run read the
    # log in between), so the wait is for both
    wait_for(client, broken_id, lambda r: r["status"] == "failed")
    for _ in range(60):
        run = client.get(f"/api/runs/{broken_id}").json()
        if any("empty-model" in line and "model_index.json" in line for line in run["log_tail"]):
            break
        time.sleep(0.5)
    assert any("empty-model" in line and "model_index.json" in line for line in run["log_tail"]), run
    run = wait_for(client, killed_id, lambda r: r["status"] == "running" and r["step"] > 0)
    start = next(json.loads(line) for line in (root / "killed" / "output" / "events.jsonl").read_text().splitlines()
                 if json.loads(line)["event"] == "start")
    os.kill(start["pid"], signal.SIGKILL)  # what the out-of-memory killer does
    run = wait_for(client, killed_id, lambda r: r["status"] == "failed", timeout=30)
    assert "SIGKILL" in run["message"]


def test_the_folder_picker_counts_every_type_discovery_reads(client, root):
    """The picker's count used four image suffixes: a folder of .tif or .gif images said nothing, clips were never
    counted. It counts what the data layer reads, in the folder itself."""
    folder = root / "mixed"
    folder.mkdir()
    for name in ("a.tif", "b.GIF", "c.avif", "d.png", "e.mp4", "notes.txt"):  # counted by name, as discovery finds
        (folder / name).write_bytes(b"")
    listing = client.get("/api/browse", params={"path": str(folder)}).json()
    assert (listing["images"], listing["clips"]) == (4, 2)  # a GIF is a clip to a video dataset too


def test_a_run_trains_the_config_that_was_checked_not_a_later_save(client, root, tmp_path, monkeypatch):
    """The trainer re-read the user's file after Start's check: a save right after Start (output_dir outside the
    roots, a post_checkpoint_script) was what trained. The supervisor (the process edge) is a stand-in that
    records its arguments; the trainer it would start gets the snapshot it is given."""
    from difftune.ui import runs

    recorder = tmp_path / "supervisor.sh"
    recorder.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv'}\n")
    recorder.chmod(0o755)
    monkeypatch.setattr(runs.sys, "executable", str(recorder))
    path = root / "config" / "config.json"
    config = json.loads(path.read_text())
    config["--data_backend_config"] = config.pop("data_backend_config")  # SimpleTuner's spelling is replaced too
    path.write_text(json.dumps(config))
    started = client.post("/api/runs", json={"path": str(path)})
    assert started.status_code == 200, started.text
    bad = {**config, "output_dir": str(tmp_path / "outside"), "post_checkpoint_script": "touch pwned"}
    path.write_text(json.dumps(bad))
    (root / "config" / "multidatabackend.json").write_text("[]")
    deadline = time.time() + 30
    while not (tmp_path / "argv").exists() and time.time() < deadline:
        time.sleep(0.1)
    snapshot = Path((tmp_path / "argv").read_text().split()[-1])
    assert snapshot.parent == tmp_path / "state" / "runs" / started.json()["id"]
    checked = load_config(snapshot)
    assert checked.train.output_dir == str(root / "output") and not checked.train.post_checkpoint_script
    assert [d.id for d in checked.datasets.discovered()] == ["train"]
    assert started.json()["config_path"] == str(path)  # the page still shows the user's file


def test_a_key_written_with_and_without_dashes_is_refused_as_check_refuses_it(client, root):
    """A SimpleTuner `--key` config whose form field was then set held both spellings: the page said OK, and
    `difftune check` refused the file."""
    body = body_of(root)
    body["config"]["--max_train_steps"] = 3
    body["datasets"][0]["--resolution"] = 64
    answer = client.post("/api/config/check", json=body).json()
    texts = [p["text"] for p in answer["problems"]]
    assert not answer["ok"] and any("max_train_steps: written twice" in t for t in texts), texts
    assert any("dataset 'train': resolution: written twice" in t for t in texts), texts
    with pytest.raises(ConfigError, match="max_train_steps: written twice"):  # the CLI's rule, the same words
        client.put("/api/config", json=body)
        load_config(root / "config" / "config.json")


def test_a_config_and_dataset_list_with_a_byte_order_mark_open_as_check_reads_them(client, root):
    """Windows Notepad writes a UTF-8 BOM; `difftune check` reads such files, the page answered 422."""
    for name in ("config.json", "multidatabackend.json"):
        path = root / "config" / name
        path.write_text(path.read_text(), encoding="utf-8-sig")
    load_config(root / "config" / "config.json")
    opened = client.get("/api/config", params={"path": str(root / "config" / "config.json")})
    assert opened.status_code == 200, opened.text
    assert opened.json()["config"]["max_train_steps"] == 4 and opened.json()["datasets"][0]["id"] == "train"


def test_a_run_that_failed_on_its_config_says_which_problems(tmp_path):
    """The message was the header `error: the configuration cannot be used:` without the problems after it."""
    run = fake_run(tmp_path, [], pid=None, exit_code=2)
    (run.folder / "log.txt").write_text(
        "$ python -m difftune.cli train --config c.json\nerror: the configuration cannot be used:\n"
        "  - d.json: dataset 'shapes': instance_data_dir '/x/vanish' is not a folder; fix the path\n"
        "  - c.json: seed: Input should be a valid integer\n")
    status, message = run.status()
    assert status == "failed" and message == (
        "the configuration or the datasets cannot be used: error: the configuration cannot be used:\n"
        "- d.json: dataset 'shapes': instance_data_dir '/x/vanish' is not a folder; fix the path\n"
        "- c.json: seed: Input should be a valid integer")


def test_an_empty_dataset_is_shown_with_each_left_out_files_reason(client, root):
    """The message says "see each file's reason below", and the page got nothing below it."""
    (root / "broken").mkdir()
    (root / "broken" / "a.png").write_text("not an image")
    (root / "broken" / "a.txt").write_text("a caption")
    body = body_of(root)
    body["datasets"][0]["instance_data_dir"] = str(root / "broken")
    [problem] = client.post("/api/config/check", json={**body, "scan": True}).json()["problems"]
    assert problem["key"] == "instance_data_dir" and "see each file's reason below" in problem["message"]
    assert f"{root / 'broken' / 'a.png'}: not a readable image" in problem["message"]


def test_a_key_written_twice_in_the_file_is_shown_and_refused_as_check_refuses_it(client, root):
    """The page opened and started a config with learning_rate written twice, training the last value, where
    `difftune check` refuses the file; a trailing comma got the parser's words, not check's."""
    config_path, data_path = root / "config" / "config.json", root / "config" / "multidatabackend.json"
    text = config_path.read_text().rstrip().rstrip("}") + ', "learning_rate": 5e-5, "learning_rate": 1e-4}'
    config_path.write_text(text)
    opened = client.get("/api/config", params={"path": str(config_path)}).json()
    (twice,) = [p for p in opened["problems"] if "appears twice" in p["text"]]
    assert twice["scope"] == "config" and twice["key"] == "learning_rate" and not opened["ok"]
    started = client.post("/api/runs", json={"path": str(config_path)})
    assert started.status_code == 422 and any("appears twice" in p["text"] for p in started.json()["problems"])
    with pytest.raises(ConfigError, match="learning_rate: the key appears twice"):
        load_config(config_path)
    data_path.write_text('[{"id": "train", "resolution": 64, "resolution": 32}]')
    config_path.write_text(text.replace(', "learning_rate": 1e-4', ""))
    opened = client.get("/api/config", params={"path": str(config_path)}).json()
    assert any("dataset 'train': resolution: the key appears twice" in p["text"] for p in opened["problems"])
    config_path.write_text('{"model_family": "lumina2",}')
    r = client.get("/api/config", params={"path": str(config_path)})
    assert r.status_code == 422 and "trailing comma at line 1" in r.json()["error"]


def test_two_pages_saving_the_same_file_at_once_get_one_conflict(client, root, monkeypatch):
    """Both saves compared the version before either wrote (the check between is slow), so both got 200 and one
    edit was lost without a word."""
    import threading

    import difftune.ui.server as server

    config_path = root / "config" / "config.json"
    opened = client.get("/api/config", params={"path": str(config_path)}).json()
    both = threading.Barrier(2)
    real_check = server.check

    def slow_check(*args, **kwargs):
        answer = real_check(*args, **kwargs)
        both.wait(timeout=30)  # each save has checked before either compares and writes
        return answer

    monkeypatch.setattr(server, "check", slow_check)
    codes = {}

    def save(rate):
        config = {**opened["config"], "learning_rate": rate}
        body = {"path": str(config_path), "config": config, "datasets": opened["datasets"],
                "opened": opened["versions"]}
        codes[rate] = client.put("/api/config", json=body).status_code

    threads = [threading.Thread(target=save, args=(r,)) for r in (1e-3, 2e-3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes.values()) == [200, 409], codes
    saved = next(r for r, c in codes.items() if c == 200)
    assert json.loads(config_path.read_text())["learning_rate"] == saved


def test_start_refuses_an_output_dir_another_trainer_holds(client, root):
    """`difftune train` from a terminal held the output_dir: Start spawned a run that failed on the lock, and the
    page showed the other trainer's steps as that run's."""
    from difftune.train.run_lock import output_dir_lock

    config_path = root / "config" / "config.json"
    output_dir = Path(load_config(config_path).train.output_dir)
    with output_dir_lock(output_dir, main=True):
        r = client.post("/api/runs", json={"path": str(config_path)})
    assert r.status_code == 409 and "in use by another training run (pid" in r.json()["error"], r.text
    assert client.get("/api/runs").json()["runs"] == []


def test_steps_before_the_runs_own_start_are_not_its_own(tmp_path):
    """Steps another trainer logged into the shared events.jsonl before this run's trainer started."""
    run = fake_run(tmp_path, [{"event": "step", "step": 9, "loss": 1.0, "lr": 1e-3, "elapsed": 0.1}], pid=None,
                   exit_code=1)
    run.read_events()
    assert run.steps == [] and run.last_step is None


def test_run_files_that_could_script_the_page_are_downloads(client, root, tmp_path):
    """An HTML, JS or SVG file in a run's output folder was served inline from the app's origin, where its script
    would have had the API's rights."""
    run = fake_run(tmp_path, [], pid=None, exit_code=0)
    (tmp_path / "ui" / "runs").mkdir(parents=True)
    shutil.move(run.folder, tmp_path / "ui" / "runs" / run.id)  # where the app's registry keeps its runs
    app = create_app([tmp_path], state_dir=tmp_path / "ui")
    c = TestClient(app, raise_server_exceptions=False, base_url="http://localhost")
    for name, body in (("x.html", "<script>1</script>"), ("x.js", "1"), ("x.svg", "<svg/>"), ("a.png", "png"),
                       ("n.txt", "text")):
        (run.output_dir / name).write_text(body)
    for name in ("x.html", "x.js", "x.svg"):
        r = c.get(f"/api/runs/{run.id}/file", params={"path": name})
        assert r.status_code == 200 and r.headers["content-disposition"].startswith("attachment"), name
        assert r.headers["content-type"] == "application/octet-stream"
        assert r.headers["content-security-policy"].startswith("sandbox")
    for name in ("a.png", "n.txt"):
        r = c.get(f"/api/runs/{run.id}/file", params={"path": name})
        assert r.headers["content-disposition"].startswith("inline"), name


def test_a_new_config_environments_list_is_written_in_its_folder(root, tmp_path, monkeypatch):
    """SimpleTuner's web UI names a config environment's list relative to the configs folder
    (env2/multidatabackend.json for config/env2/config.json): it was written in <root>/env2/."""
    monkeypatch.chdir(root)  # the folder the server (and its trainers) run in
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), base_url="http://localhost")
    body = body_of(root)
    body["path"] = str(root / "config" / "env2" / "config.json")
    body["config"]["data_backend_config"] = "env2/multidatabackend.json"
    saved = client.put("/api/config", json=body)
    assert saved.status_code == 200, saved.text
    assert (root / "config" / "env2" / "multidatabackend.json").is_file() and not (root / "env2").exists()
    assert load_config(Path("config/env2/config.json")).datasets is not None  # where the loader finds it
