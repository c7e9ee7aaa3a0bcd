"""The web UI's hardening, one test (or a few) per class of issue #12:
every path a config makes the trainer use is confined, however it is spelled and when it is a default;
no request blocks the server; bodies are limited and every bad input gets a 4xx with a message;
a path outside the roots is refused in the same words whether it exists or not; the token query is
taken on the first page only. Nothing here trains: a start that passes would spawn, so each start
below is one that must be refused."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conftest import write_config
from difftune.config import load_config
from difftune.demo import make_dataset
from difftune.ui.server import create_app

JSON = {"Content-Type": "application/json"}


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "root"
    make_dataset(root / "images", count=2)
    write_config(root, root / "images", max_train_steps=4)
    return root


@pytest.fixture
def outside(tmp_path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    return outside


@pytest.fixture
def client(root, tmp_path, monkeypatch) -> TestClient:
    monkeypatch.chdir(root)
    return TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")


def body_of(root: Path) -> dict:
    return {"path": str(root / "config" / "config.json"),
            "config": json.loads((root / "config" / "config.json").read_text()),
            "datasets": json.loads((root / "config" / "multidatabackend.json").read_text()),
            "overwrite": True}  # a save replaces the files write_config wrote


def problem_keys(answer: dict) -> set[tuple[str, int | None, str | None]]:
    return {(p["scope"], p["dataset_index"], p["key"]) for p in answer["problems"]}


def save_and_start(client: TestClient, body: dict) -> dict:
    """Save the body (allowed with problems) and try to start it: the start must be refused."""
    assert client.put("/api/config", json=body).status_code == 200
    started = client.post("/api/runs", json={"path": body["path"]})
    assert started.status_code == 422, started.text
    assert client.get("/api/runs").json()["runs"] == []  # nothing was spawned
    return started.json()


# --- 1. every path of the parsed config, however spelled, defaults included ---------------------------


def test_keys_spelled_with_dashes_are_confined(client, root, outside):
    (outside / "prompts.json").write_text(json.dumps({"a": "a red circle"}))
    make_dataset(outside / "images", count=1)
    body = body_of(root)
    body["config"]["--user_prompt_library"] = str(outside / "prompts.json")
    body["config"]["--output_dir"] = str(outside / "out")
    del body["config"]["output_dir"]
    body["datasets"][0]["--cache_dir_vae"] = str(outside / "vae")
    del body["datasets"][0]["cache_dir_vae"]
    body["datasets"][0]["--instance_data_dir"] = str(outside / "images")
    del body["datasets"][0]["instance_data_dir"]
    answer = client.post("/api/config/check", json=body).json()
    assert problem_keys(answer) == {("config", None, "user_prompt_library"), ("config", None, "output_dir"),
                                    ("datasets", 0, "cache_dir_vae"), ("datasets", 0, "instance_data_dir")}
    assert all("outside the folders" in p["message"] for p in answer["problems"])
    assert not (outside / "out").exists() and not (outside / "vae").exists()
    assert problem_keys(save_and_start(client, body)) == problem_keys(answer)
    load_config(root / "config" / "config.json")  # the loader does read them: this is what the server saw


def test_a_home_path_in_a_config_is_confined_as_the_trainer_expands_it(client, root, outside, monkeypatch):
    """The trainer reads `~/x` as $HOME/x (config/fields.expand_home). The server once took it literally (a
    folder `~` inside the root): the page checked that dataset list while the run trained on the one in $HOME,
    and a `~` prompt library was opened outside the roots, telling whether it existed."""
    monkeypatch.setenv("HOME", str(outside))
    body = body_of(root)
    for where in (outside, root / "~"):  # the trainer's reading outside, the literal one inside
        where.mkdir(exist_ok=True)
        (where / "ds.json").write_text(json.dumps(body["datasets"]))
    config = {**body["config"], "data_backend_config": "~/ds.json"}
    (root / "config" / "config.json").write_text(json.dumps(config))
    opened = client.get("/api/config", params={"path": body["path"]}).json()
    assert not opened["ok"] and opened["datasets"] == []
    refused = [p for p in opened["problems"] if p["key"] == "data_backend_config"]
    assert len(refused) == 1 and "outside the folders" in refused[0]["message"]
    started = client.post("/api/runs", json={"path": body["path"]})
    assert started.status_code == 422 and client.get("/api/runs").json()["runs"] == []
    assert client.put("/api/config", json={**body, "config": config}).status_code == 403
    # a file the loader would open: the same answer whether it exists (and what it holds) or not
    (outside / "bad.json").write_text("not json")
    (outside / "list.json").write_text("[1]")
    answers = set()
    for name in ("bad.json", "list.json", "missing.json"):
        for key in ("user_prompt_library", "lycoris_config"):
            check = client.post("/api/config/check", json={**body, "config": {**body["config"], key: f"~/{name}"}})
            problems = check.json()["problems"]
            assert [p["key"] for p in problems] == [key], problems
            answers.add(problems[0]["message"].replace(name, "N"))
    assert len(answers) == 1 and "outside the folders" in answers.pop()


def test_a_dataset_id_with_dot_dot_cannot_escape_through_the_default_cache(client, root):
    body = body_of(root)
    del body["datasets"][0]["cache_dir_vae"]
    body["datasets"][0]["id"] = "../../../escape"
    answer = client.post("/api/config/check", json=body).json()
    assert ("datasets", 0, "id") in problem_keys(answer)  # refused as a folder name before any path is built
    assert not (root.parent / "escape").exists()
    body["datasets"][0]["id"] = "sub/dir"
    assert ("datasets", 0, "id") in problem_keys(client.post("/api/config/check", json=body).json())
    save_and_start(client, body)


def test_default_cache_paths_outside_the_roots_are_refused(root, tmp_path, monkeypatch):
    """The server started in a folder that is not a root: the default caches (cache/vae/<family>/<id>,
    cache/text/<family>) and the default output_dir would land there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")
    body = body_of(root)
    del body["datasets"][0]["cache_dir_vae"]
    del body["datasets"][1]  # no text_embeds entry
    del body["config"]["output_dir"]
    answer = client.post("/api/config/check", json=body).json()
    assert problem_keys(answer) == {("datasets", 0, "cache_dir_vae"), ("datasets", 0, "text_embeds"),
                                    ("config", None, "output_dir")}
    messages = {p["key"]: p["message"] for p in answer["problems"]}
    assert "cache/vae/lumina2/train" in messages["cache_dir_vae"] and "default" in messages["cache_dir_vae"]
    assert "cache/text/lumina2" in messages["text_embeds"]
    save_and_start(client, body)
    assert not (elsewhere / "cache").exists() and not (elsewhere / "output").exists()
    # the same config with the server started inside the root: the defaults are inside, all is well
    monkeypatch.chdir(root)
    inside = TestClient(create_app([root], state_dir=tmp_path / "state2"), raise_server_exceptions=False, base_url="http://localhost")
    assert inside.post("/api/config/check", json=body).json()["ok"]


def test_caption_table_and_model_paths_are_confined(client, root, outside):
    (outside / "captions.jsonl").write_text('{"filename": "a.png", "caption": "x"}\n')
    body = body_of(root)
    body["datasets"][0].update(caption_strategy="parquet", parquet={"path": str(outside / "captions.jsonl")})
    body["config"]["pretrained_model_name_or_path"] = str(outside)
    body["config"]["resume_from_checkpoint"] = str(outside / "checkpoint-5")
    body["config"]["init_lora"] = str(outside)
    keys = problem_keys(client.post("/api/config/check", json=body).json())
    assert {("datasets", 0, "parquet.path"), ("config", None, "pretrained_model_name_or_path"),
            ("config", None, "resume_from_checkpoint"), ("config", None, "init_lora")} <= keys
    body["config"]["resume_from_checkpoint"] = "latest"  # a word, not a path
    body["config"]["pretrained_model_name_or_path"] = "org/model"  # a hub id
    keys = problem_keys(client.post("/api/config/check", json=body).json())
    assert ("config", None, "resume_from_checkpoint") not in keys
    assert ("config", None, "pretrained_model_name_or_path") not in keys


def test_the_default_text_cache_is_the_trainers(root, tmp_path, monkeypatch):
    """The UI confines DatasetPlan.text_cache_root; the trainer opens the cache it names."""
    from difftune.train.caching import text_cache_for

    monkeypatch.chdir(tmp_path)
    datasets = json.loads((root / "config" / "multidatabackend.json").read_text())
    for keep_entry in (True, False):
        (root / "config" / "multidatabackend.json").write_text(json.dumps(datasets if keep_entry else datasets[:1]))
        run_cfg = load_config(root / "config" / "config.json")
        ds = run_cfg.datasets.images[0]
        cache, _ = text_cache_for(run_cfg, ds, {"model": "x"})
        expected = Path(run_cfg.datasets.text_cache_root(ds, "lumina2"))
        assert cache.folder.resolve().is_relative_to(expected.resolve()), (cache.folder, expected)


# --- 2. no request blocks the server -------------------------------------------------------------------


def answered_within(client: TestClient, seconds: float, *request) -> object:
    """The answer, or a failure if none comes in time (a blocked read would hang the test otherwise)."""
    box: list = []
    worker = threading.Thread(target=lambda: box.append(client.request(*request[:2], **(request[2] if
                                                                                          len(request) > 2 else {}))),
                              daemon=True)
    worker.start()
    worker.join(seconds)
    assert box, f"no answer within {seconds}s to {request[:2]}: the server is blocked"
    return box[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_fifo_named_anywhere_is_refused_without_reading_it(client, root):
    fifo = root / "pipe.json"
    os.mkfifo(fifo)
    body = body_of(root)
    body["config"]["user_prompt_library"] = str(fifo)
    body["config"]["lycoris_config"] = str(fifo)
    r = answered_within(client, 20, "POST", "/api/config/check", {"json": body})
    keys = problem_keys(r.json())
    assert {("config", None, "user_prompt_library"), ("config", None, "lycoris_config")} <= keys
    by_key = {p["key"]: p["message"] for p in r.json()["problems"]}
    assert "not a regular file" in by_key["user_prompt_library"] and "not a regular file" in by_key["lycoris_config"]
    body = body_of(root)
    body["config"]["data_backend_config"] = str(fifo)
    r = answered_within(client, 20, "POST", "/api/config/check", {"json": body})
    assert ("config", None, "data_backend_config") in problem_keys(r.json())
    for method, url, kwargs in [("GET", "/api/config", {"params": {"path": str(fifo)}}),
                                ("POST", "/api/runs", {"json": {"path": str(fifo)}})]:
        r = answered_within(client, 20, method, url, kwargs)
        assert r.status_code == 422 and "not a regular file" in r.json()["error"], r.text
    config = json.loads((root / "config" / "config.json").read_text())
    config["data_backend_config"] = str(fifo)
    (root / "config" / "config.json").write_text(json.dumps(config))
    r = answered_within(client, 20, "GET", "/api/config", {"params": {"path": str(root / "config" / "config.json")}})
    assert r.status_code == 200 and not r.json()["ok"]
    r = answered_within(client, 20, "POST", "/api/runs", {"json": {"path": str(root / "config" / "config.json")}})
    assert r.status_code == 422


def test_a_fifo_as_a_runs_event_log_does_not_block_the_run_list(tmp_path):
    from difftune.ui.runs import Run

    folder, out = tmp_path / "state" / "r1", tmp_path / "out"
    folder.mkdir(parents=True)
    out.mkdir()
    os.mkfifo(out / "events.jsonl")
    (folder / "run.json").write_text(json.dumps({"id": "r1", "output_dir": str(out), "pid": None}))
    box: list = []
    worker = threading.Thread(target=lambda: box.append(Run(folder).status()), daemon=True)
    worker.start()
    worker.join(10)
    assert box and box[0][0] == "failed"


def test_slow_work_runs_off_the_event_loop(root, tmp_path, monkeypatch):
    """While one check is stuck in the filesystem, other clients are still answered."""
    import difftune.ui.server as server

    release, entered = threading.Event(), threading.Event()
    real_check = server.check

    def stuck(*args, **kwargs):
        entered.set()
        release.wait(30)
        return real_check(*args, **kwargs)

    monkeypatch.setattr(server, "check", stuck)
    with TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost") as client:
        worker = threading.Thread(target=lambda: client.post("/api/config/check", json=body_of(root)), daemon=True)
        worker.start()
        assert entered.wait(10)
        started = time.monotonic()
        assert client.get("/api/schema").status_code == 200
        assert client.get("/api/roots").status_code == 200
        assert time.monotonic() - started < 5
        release.set()
        worker.join(30)


# --- 3. body limit, 4xx with a message for every bad input, nothing written before it is valid ---------


def test_bodies_are_limited_in_size_and_shape(client, root):
    path = str(root / "config" / "c.json")
    cases = [
        (b'{"path": "' + b"a" * (2 * 1024 * 1024) + b'"}', 413),
        (b'{"path": "x", "config": {"learning_rate": NaN}, "datasets": []}', 400),
        (b'{"path": "x", "config": {"learning_rate": 1e999}, "datasets": []}', 400),
        (b'{"path": "x", "config": {"seed": ' + b"9" * 5000 + b'}, "datasets": []}', 400),
        (b'{"path": "x", "config": {}, "datasets": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400),
        (b'{"path": "\xff\xfe", "config": {}, "datasets": []}', 400),
        (json.dumps({"path": path, "config": {"seed": [[[[[]]]]], "x": {"y": None}}, "datasets": "no"}).encode(), 422),
    ]
    for content, status in cases:
        r = client.post("/api/config/check", content=content, headers=JSON)
        assert r.status_code == status, (content[:60], r.status_code, r.text[:200])
        assert r.json()["error"] and "Traceback" not in r.text
    r = client.post("/api/config/check", content=b"{}", headers={**JSON, "Content-Length": "99999999999"})
    assert r.status_code in (400, 413)


def test_odd_inputs_get_4xx_with_a_message(client, root):
    body = body_of(root)
    body["config"]["dataset_type"] = ["image"]
    body["datasets"][0]["dataset_type"] = ["image"]  # unhashable: crashed the loader
    body["datasets"][0]["resolution"] = 10 ** 90
    body["config"]["output_dir"] = {"nested": ["junk", {"deeper": 1}]}
    r = client.post("/api/config/check", json=body)
    assert r.status_code == 200 and not r.json()["ok"], r.text
    assert ("datasets", 0, "dataset_type") in problem_keys(r.json())
    for method, url, kwargs in [
        ("GET", "/api/config", {"params": {"path": "~nosuchuser/config.json"}}),
        ("GET", "/api/browse", {"params": {"path": "~nosuchuser"}}),
        ("POST", "/api/runs", {"json": {"path": "~nosuchuser/c.json"}}),
        ("PUT", "/api/config", {"json": {"path": "~nosuchuser/c.json", "config": {}, "datasets": []}}),
        ("GET", "/api/runs/x/log", {"params": {"lines": "9" * 400}}),
        ("GET", "/api/browse", {"params": {"path": str(root), "files": "maybe"}}),
        ("POST", "/api/runs", {"json": {"path": ["a"]}}),
        ("GET", "/api/schema", {"headers": {"Host": "[::1"}}),
    ]:
        r = client.request(method, url, **kwargs)
        assert 400 <= r.status_code < 500, (url, r.status_code, r.text)
        assert r.json()["error"], url


def test_nothing_is_written_before_the_request_is_known_to_be_valid(client, root, outside):
    (root / "afile").write_text("x")
    body = body_of(root)
    body["path"] = str(root / "new" / "config.json")
    body["config"]["data_backend_config"] = str(root / "afile" / "datasets.json")  # a file in the way
    assert client.put("/api/config", json=body).status_code == 400
    assert not (root / "new").exists()
    body["config"]["data_backend_config"] = str(outside / "datasets.json")
    assert client.put("/api/config", json=body).status_code == 403
    assert not (root / "new").exists() and not (outside / "datasets.json").exists()
    body["config"]["data_backend_config"] = str(root / "new" / "datasets.txt")
    assert client.put("/api/config", json=body).status_code == 400
    assert not (root / "new").exists()


# --- 4. existence outside the roots is not observable; the token query on the first page only ----------


def test_paths_outside_the_roots_get_the_same_answer_whether_they_exist_or_not(client, root, outside):
    (outside / "real.json").write_text("{}")
    (outside / "loop").symlink_to(outside / "loop")
    (root / "escape").symlink_to(outside / "real.json")
    candidates = [outside / "real.json", outside / "missing.json", outside / "loop", outside, "~nosuchuser/x.json"]

    def answers(path) -> list[tuple[int, str]]:
        out = []
        body = body_of(root)
        for url, kwargs in [("/api/config", {"params": {"path": str(path)}}),
                            ("/api/browse", {"params": {"path": str(path)}})]:
            r = client.get(url, **kwargs)
            out.append((r.status_code, r.json()["error"].replace(str(path), "P")))
        r = client.post("/api/runs", json={"path": str(path)})
        out.append((r.status_code, r.json()["error"].replace(str(path), "P")))
        body["config"]["user_prompt_library"] = str(path)
        body["datasets"][0]["instance_data_dir"] = str(path)
        body["datasets"][0]["cache_dir_vae"] = str(path)
        for p in client.post("/api/config/check", json=body).json()["problems"]:
            out.append((p["key"], p["message"].replace(str(path), "P")))
        return out

    first = answers(candidates[0])
    assert all(status == 403 for status, _ in first[:3]) and len(first) == 6
    for path in candidates[1:-1]:
        assert answers(path) == first, path
    # a path typed into the page expands `~` (a missing user is answered like any outside path); inside a
    # config it does not, as the trainer does not: there `~nosuchuser/x.json` is a relative path
    assert answers(candidates[-1])[:3] == first[:3]


def test_the_token_query_is_taken_on_the_first_page_only(root, tmp_path):
    app = create_app([root], token="s3cret-token", state_dir=tmp_path / "state")
    c = TestClient(app, base_url="http://192.168.1.5:8001")
    for url in ("/api/schema?token=s3cret-token", "/api/runs?token=s3cret-token", "/static/app.js?token=s3cret-token"):
        assert c.get(url).status_code == 401, url
    assert c.post("/api/config/check?token=s3cret-token", json={}).status_code == 401
    r = c.get("/?token=s3cret-token", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
    assert c.get("/api/schema").status_code == 200  # the cookie
    c.cookies.clear()
    assert c.get("/api/schema", headers={"X-Difftune-Token": "s3cret-token"}).status_code == 200
    assert c.get("/api/schema").status_code == 401


def test_output_dir_and_id_placeholders_in_a_dataset_entry_are_confined_as_filled(client, root, outside):
    """SimpleTuner's web UI writes {output_dir}/cache/vae/{model_family}/{id}: inside the roots when output_dir is
    (the check passes), outside when output_dir is (refused at the entry's key, nothing made there)."""
    body = body_of(root)
    body["datasets"][0]["cache_dir_vae"] = "{output_dir}/cache/vae/{model_family}/{id}"
    answer = client.post("/api/config/check", json=body).json()
    assert ("datasets", 0, "cache_dir_vae") not in problem_keys(answer), answer["problems"]
    body["config"]["output_dir"] = str(outside / "out")
    answer = client.post("/api/config/check", json=body).json()
    assert {("config", None, "output_dir"), ("datasets", 0, "cache_dir_vae")} <= problem_keys(answer)
    assert not (outside / "out").exists()
