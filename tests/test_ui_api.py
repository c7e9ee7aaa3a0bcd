"""The web UI's HTTP API through a test client: schema-generated forms, problems at their fields with
the messages of `difftune check`, root confinement, the access token, JSON 4xx for bad requests, and
runs on the tiny model (progress, samples, stop, restart of the server, failures)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conftest import write_config
from difftune.config import ConfigError, TrainConfig, load_config
from difftune.config.datasets import DATASET_MODELS
from difftune.demo import make_dataset
from difftune.ui.runs import Run
from difftune.ui.server import access_token, create_app

JSON = {"Content-Type": "application/json"}


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "root"
    make_dataset(root / "images", count=4)
    write_config(root, root / "images", max_train_steps=4)
    return root


@pytest.fixture
def client(root, tmp_path) -> TestClient:
    return TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False)


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
    return {"path": str(root / "config" / "config.json"), "config": config, "datasets": datasets}


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
    body = body_of(root)
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


def test_token_is_enforced_beyond_loopback(root, tmp_path):
    assert access_token("127.0.0.1", None) is None and access_token("localhost", None) is None
    assert access_token("0.0.0.0", None) and access_token("0.0.0.0", "given") == "given"
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


# --- status derivation from event logs, without training ---------------------------------------------


def fake_run(tmp_path: Path, events: list[dict], pid: int | None, exit_code: int | None = None) -> Run:
    folder = tmp_path / "state" / "r1"
    out = tmp_path / "out"
    folder.mkdir(parents=True)
    out.mkdir()
    (out / "events.jsonl").write_text("".join(json.dumps({"time": time.time(), **e}) + "\n" for e in events))
    info = {"id": "r1", "output_dir": str(out), "config_path": "c.json", "started": time.time(), "pid": pid,
            "pid_started": None}
    (folder / "run.json").write_text(json.dumps(info))
    (folder / "log.txt").write_text("loading\rprogress 1\rprogress 2\nTraceback (most recent call last):\nMemoryError\n")
    if exit_code is not None:
        (folder / "exit.json").write_text(json.dumps({"returncode": exit_code}))
    return Run(folder)


def test_an_error_event_is_failed_at_once_even_while_the_process_lives(tmp_path):
    run = fake_run(tmp_path, [{"event": "start", "total_steps": 9, "step": 0, "pid": os.getpid()},
                              {"event": "error", "message": "OutOfMemoryError: CUDA out of memory", "traceback": "tb"}],
                   pid=os.getpid())
    summary = run.summary(detail=True)
    assert summary["status"] == "failed" and "out of memory" in summary["message"]
    assert summary["traceback"] == "tb" and summary["log_tail"][-1] == "MemoryError"
    assert "progress 2" in summary["log_tail"]  # progress-bar redraws collapsed


@pytest.mark.parametrize("code, words", [(-9, "SIGKILL"), (1, "status 1"), (2, "configuration"), (None, "gone")])
def test_a_process_that_ended_without_a_final_event_is_failed(tmp_path, code, words):
    run = fake_run(tmp_path, [{"event": "start", "total_steps": 9, "step": 0, "pid": 999999999},
                              {"event": "step", "step": 1, "loss": 1.0, "lr": 1e-3, "elapsed": 0.1}],
                   pid=999999999, exit_code=code)
    status, message = run.status()
    assert status == "failed" and words in message


def test_a_reused_pid_is_not_a_live_run(tmp_path):
    run = fake_run(tmp_path, [], pid=os.getpid())
    assert run.status()[0] == "starting"
    run.info["pid_started"] = 12345.0  # another process had this pid
    assert run.status()[0] == "failed"


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
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False)
    started = client.post("/api/runs", json={"path": str(root / "config" / "config.json")})
    assert started.status_code == 200, started.text
    run_id = started.json()["id"]
    assert client.post("/api/runs", json={"path": str(root / "config" / "config.json")}).status_code == 409
    run = wait_for(client, run_id, lambda r: r["status"] == "running" and r["samples"] and len(r["losses"]) >= 3)
    assert run["total_steps"] == 2000 and run["lr"] == 1e-3 and run["its"] > 0 and run["eta_s"] > 0
    sample = client.get(f"/api/runs/{run_id}/file", params={"path": run["samples"][0]["path"]})
    assert sample.status_code == 200 and sample.content[:4] == b"\x89PNG"
    # the server restarts: a new app over the same state folder finds the run still going
    restarted = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False)
    assert [r["status"] for r in restarted.get("/api/runs").json()["runs"]] == ["running"]
    assert restarted.post(f"/api/runs/{run_id}/command", json={"command": "save"}).status_code == 200
    assert restarted.post(f"/api/runs/{run_id}/command", json={"command": "stop"}).status_code == 200
    run = wait_for(restarted, run_id, lambda r: r["status"] == "stopped")
    assert run["adapter"] == "pytorch_lora_weights.safetensors" and run["step"] < 2000
    assert any(o["path"] == "pytorch_lora_weights.safetensors" for o in run["outputs"])
    assert restarted.post(f"/api/runs/{run_id}/command", json={"command": "stop"}).status_code == 409


def test_crashes_and_kills_are_reported_as_failed(lumina2_dir, root, tmp_path, no_leftovers):
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False)
    (root / "empty-model").mkdir()
    broken = write_config(root / "broken", root / "images", pretrained_model_name_or_path=str(root / "empty-model"))
    killed = write_config(root / "killed", root / "images", max_train_steps=5000)
    broken_id = client.post("/api/runs", json={"path": str(broken)}).json()["id"]
    killed_id = client.post("/api/runs", json={"path": str(killed)}).json()["id"]
    run = wait_for(client, broken_id, lambda r: r["status"] == "failed")
    assert run["log_tail"] and any("empty-model" in line and "model_index.json" in line for line in run["log_tail"])
    run = wait_for(client, killed_id, lambda r: r["status"] == "running" and r["step"] > 0)
    start = next(json.loads(line) for line in (root / "killed" / "output" / "events.jsonl").read_text().splitlines()
                 if json.loads(line)["event"] == "start")
    os.kill(start["pid"], signal.SIGKILL)  # what the out-of-memory killer does
    run = wait_for(client, killed_id, lambda r: r["status"] == "failed", timeout=30)
    assert "SIGKILL" in run["message"]
