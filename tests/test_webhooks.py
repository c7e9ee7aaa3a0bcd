"""Webhooks (`webhook_config`, `webhook_reporting_interval`): a real HTTP server on 127.0.0.1 in a thread is the
endpoint (the process edge; urllib is not mocked). A tiny run sends its start, progress (raw only), validation
samples (Discord: attached; raw: base64), checkpoints and end; a failing or hanging endpoint never holds training up
and yields few warnings; a 429's retry_after is waited for; the config is checked at load time."""

import base64
import json
import threading
import time
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.train import webhooks
from difftune.train.events import Events
from difftune.train.loop import train
from difftune.train.setup import build_run
from difftune.train.trackers import flat_config

SAMPLES = dict(validation_prompt="a red circle", validation_resolution="64x48", validation_num_inference_steps=2,
               validation_disable_unconditional=True)
SECRET = "s3cr3t-T0KEN"


class Endpoint:
    """An HTTP server recording every POST as (path, headers, body, time). `answers[path]`: a list of
    (status, headers, body, delay_s) given in turn (the last one repeats); default 204."""

    def __init__(self):
        self.requests: list[tuple[str, dict, bytes, float]] = []
        self.answers: dict[str, list[tuple[int, dict, bytes, float]]] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests.append((self.path, dict(self.headers), body, time.monotonic()))
                answers = outer.answers.get(self.path.split("/")[1], [(204, {}, b"", 0.0)])
                status, headers, payload, delay = answers.pop(0) if len(answers) > 1 else answers[0]
                time.sleep(delay)
                try:
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:  # the client gave up (a hang longer than its timeout)
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}/api/webhooks/123/{SECRET}"

    def bodies(self, name: str) -> list[bytes]:
        return [body for path, _, body, _ in self.requests if path.split("/")[1] == name]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    server = Endpoint()
    yield server
    server.close()


def events(output) -> list[dict]:
    return [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()]


def form(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body: field name -> (file name, bytes)."""
    message = BytesParser(policy=HTTP).parsebytes(f"Content-Type: {content_type}\r\n\r\n".encode() + body)
    return {part.get_param("name", header="content-disposition"): (part.get_filename(), part.get_payload(decode=True))
            for part in message.iter_parts()}


def test_a_run_sends_its_messages(tmp_path, dataset, endpoint):
    hooks = [{"webhook_type": "raw", "callback_url": endpoint.url("raw")},
             {"webhook_type": "discord", "webhook_url": endpoint.url("discord"), "message_prefix": "my run"}]
    (tmp_path / "hooks.json").write_text(json.dumps(hooks))
    run = build_run(load_config(write_config(tmp_path, dataset, **SAMPLES, max_train_steps=4, validation_step_interval=2,
                                             checkpoint_step_interval=2, webhook_config=str(tmp_path / "hooks.json"),
                                             webhook_reporting_interval=2)))
    train(run)
    log = events(run.output_dir)
    assert not [e for e in log if e["event"] == "warning"]
    samples = {e["step"]: e["path"] for e in log if e["event"] == "sample"}
    checkpoints = [e["path"] for e in log if e["event"] == "checkpoint"]

    raw = [json.loads(body) for body in endpoint.bodies("raw")]
    assert [(m["type"], m["step"]) for m in raw] == [
        ("training.status", 0), ("training.progress", 2), ("training.validation", 2), ("training.checkpoint", 2),
        ("training.progress", 4), ("training.checkpoint", 4), ("training.validation", 4),
        ("training.status", 4)]  # at the last step: the final checkpoint, then the final samples
    assert raw[0]["data"] == {"status": "started", "total_steps": 4} and raw[-1]["data"]["status"] == "completed"
    steps = [e for e in log if e["event"] == "step"]
    progress = raw[4]["progress"]
    assert progress["current"] == 4 and progress["total"] == 4 and progress["percent"] == 100.0
    assert progress["metrics"]["loss"] == steps[3]["loss"] and progress["metrics"]["learning_rate"] == steps[3]["lr"]
    assert progress["metrics"]["steps_per_s"] == pytest.approx(2 / (steps[3]["elapsed"] - steps[1]["elapsed"]))
    with open(samples[2], "rb") as f:
        assert [base64.b64decode(b) for b in raw[2]["images"]] == [f.read()]
    assert raw[2]["validation"]["assets"][0]["path"] == samples[2] and raw[2]["validation"]["prompts"] == ["validation"]
    assert [m["checkpoint"]["path"] for m in raw if m["type"] == "training.checkpoint"] == checkpoints
    assert raw[5]["checkpoint"]["is_final"] and not raw[3]["checkpoint"]["is_final"]

    discord = [(headers["Content-Type"], body) for path, headers, body, _ in endpoint.requests
               if path.startswith("/discord/")]
    parts = [form(body, kind) for kind, body in discord]
    texts = [p["content"][1].decode() for p in parts]
    assert all(t.startswith("`(my run)` ") for t in texts) and len(texts) == 6  # no progress messages
    assert texts[0] == "`(my run)` Training started: 4 steps"
    assert texts[1].startswith("`(my run)` Validation at step 2 (loss ")
    assert texts[2].startswith("`(my run)` Checkpoint saved at step 2") and checkpoints[0] in texts[2]
    assert "Training finished at step 4" in texts[-1]
    with open(samples[2], "rb") as f:
        assert parts[1]["file0"] == (Path(samples[2]).name, f.read())
    assert set(parts[1]) == {"content", "file0"} and set(parts[0]) == {"content"}
    assert SECRET not in (run.output_dir / "events.jsonl").read_text()


def notifier(tmp_path, dataset, hooks: list[dict], **keys):
    """A notifier on a real config and event log, without a training run (for the endpoint's failures)."""
    (tmp_path / "hooks.json").write_text(json.dumps(hooks))
    cfg = load_config(write_config(tmp_path, dataset, webhook_config=str(tmp_path / "hooks.json"), **keys)).train
    run = SimpleNamespace(cfg=cfg, events=Events(tmp_path / "events.jsonl", console=False))
    sender = webhooks.WebhookNotifier(cfg, run.events, cfg.webhooks())
    run.events.subscribers.append(sender)
    return run


@pytest.mark.parametrize("retry_after, header", [(0.6, {}), (0, {"Retry-After": "1"})])
def test_429_retry_after_is_waited_for(tmp_path, dataset, endpoint, monkeypatch, retry_after, header):
    monkeypatch.setattr(webhooks, "BACKOFF_S", 0.01)
    endpoint.answers["discord"] = [(429, {"Content-Type": "application/json", **header},
                                    json.dumps({"retry_after": retry_after, "global": False}).encode(), 0.0),
                                   (204, {}, b"", 0.0)]
    run = notifier(tmp_path, dataset, [{"webhook_type": "discord", "webhook_url": endpoint.url("discord")}])
    run.events.emit("start", step=0, total_steps=10)
    run.events.close()
    times = [t for *_, t in endpoint.requests]
    assert len(times) == 2 and times[1] - times[0] >= max(retry_after, 1.0 if header else 0) - 0.05
    assert not [e for e in events(tmp_path) if e["event"] == "warning"]


def test_a_failing_endpoint_is_retried_then_a_warning(tmp_path, dataset, endpoint, monkeypatch):
    monkeypatch.setattr(webhooks, "BACKOFF_S", 0.01)
    endpoint.answers["raw"] = [(500, {}, b"down", 0.0)]
    endpoint.answers["gone"] = [(404, {}, b"", 0.0)]
    run = notifier(tmp_path, dataset, [{"webhook_type": "raw", "callback_url": endpoint.url("raw")},
                                       {"webhook_type": "raw", "callback_url": endpoint.url("gone")}],
                   webhook_reporting_interval=1)
    run.events.emit("start", step=0, total_steps=10)
    for step in range(1, 4):
        run.events.emit("step", step=step, loss=0.5, lr=1e-3, elapsed=0.1 * step)
    run.events.close()
    assert len(endpoint.bodies("raw")) == 4 * webhooks.ATTEMPTS  # each message tried ATTEMPTS times
    assert len(endpoint.bodies("gone")) == 4  # a 404 is not retried
    warnings = [e["message"] for e in events(tmp_path) if e["event"] == "warning"]
    port = endpoint.server.server_address[1]
    # one warning per webhook, then a count of the ones held back (WARN_EVERY_S)
    assert sorted(warnings) == sorted([f"webhook raw http://127.0.0.1:{port}/***: a message could not be sent (HTTP 404 Not Found); "
                        "training went on", f"webhook raw http://127.0.0.1:{port}/***: a message could not be sent "
                        "(HTTP 500 Internal Server Error); training went on",
                        f"webhook raw http://127.0.0.1:{port}/***: 3 more webhook problems were not reported",
                        f"webhook raw http://127.0.0.1:{port}/***: 3 more webhook problems were not reported"])


def test_a_hanging_endpoint_does_not_hold_training_up(tmp_path, dataset, endpoint, monkeypatch):
    """Every POST hangs 30 s: the steps go on at their own pace, the end of the run waits FINAL_WAIT_S at most,
    and the warnings are few."""
    monkeypatch.setattr(webhooks, "TIMEOUT_S", 0.3)
    monkeypatch.setattr(webhooks, "BACKOFF_S", 0.01)
    monkeypatch.setattr(webhooks, "FINAL_WAIT_S", 1.0)
    endpoint.answers["raw"] = [(200, {}, b"", 30.0)]
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=3, webhook_reporting_interval=1,
                                             webhook_config=json.dumps({"webhook_type": "raw",
                                                                        "callback_url": endpoint.url("raw")}))))
    began = time.monotonic()
    train(run)
    took = time.monotonic() - began
    log = events(run.output_dir)
    trained = log[-1]["time"] - next(e["time"] for e in log if e["event"] == "start")
    # 5 messages x 4 attempts x 0.3 s would be 6 s if training waited on them
    assert took < trained + 1.0 + 1.5, (took, trained)
    warnings = [e["message"] for e in log if e["event"] == "warning"]
    assert 1 <= len(warnings) <= 2 and all("http://127.0.0.1" in w and SECRET not in w for w in warnings)
    assert "still unsent after 1 s" in warnings[-1]


def test_a_run_that_fails_before_its_first_step_sends_the_error_before_it_exits(tmp_path, endpoint):
    """Discovery finds no captioned image (a DataError, exit 2) in a `difftune train` process: the error reaches the
    webhook although the endpoint takes 1 s to answer and the process ends right after (its queue is flushed,
    bounded, on the way out); the skipped files' warnings of setup are not sent."""
    import os
    import subprocess
    import sys

    from difftune.demo import make_dataset

    images = tmp_path / "images"
    for path in make_dataset(images, count=3):
        path.with_suffix(".txt").unlink()  # caption_strategy textfile: no image is usable
    endpoint.answers["raw"] = [(204, {}, b"", 1.0)]
    hook = json.dumps({"webhook_type": "raw", "callback_url": endpoint.url("raw")})
    config = write_config(tmp_path, images, webhook_config=hook)
    done = subprocess.run([sys.executable, "-m", "difftune.cli", "train", "--config", str(config)], env=os.environ
                          | {"PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2 and "no usable image" in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("no usable image") == 1  # said once, by the command line (the event is quiet)
    (message,) = [json.loads(body) for body in endpoint.bodies("raw")]
    assert message["type"] == "error" and message["severity"] == "error" and message["step"] == 0
    assert message["message"].startswith("Training failed before its first step: DataError: dataset(s) 'train' "
                                         "have no usable image")
    (error,) = [e for e in events(tmp_path / "output") if e["event"] == "error"]
    assert error["stage"] == "setup" and "DataError" in error["traceback"]


def test_a_model_that_does_not_load_is_sent(tmp_path, dataset, endpoint):
    """In the process (the web UI's tests build runs so too): a model folder without model_index.json fails while
    loading; Discord gets one message, and build_run raises as before."""
    from difftune.models.hub import ComponentError

    (tmp_path / "empty-model").mkdir()
    hook = json.dumps({"webhook_type": "discord", "webhook_url": endpoint.url("discord")})
    config = write_config(tmp_path, dataset, webhook_config=hook, pretrained_model_name_or_path=str(tmp_path / "empty-model"))
    with pytest.raises(ComponentError):
        build_run(load_config(config))
    ((kind, body),) = [(headers["Content-Type"], body) for _, headers, body, _ in endpoint.requests]
    text = form(body, kind)["content"][1].decode()
    assert text.startswith("`(difftune)` Training failed before its first step: ComponentError: ")
    assert "model_index.json" in text


def test_process_0_only(tmp_path, dataset):
    hook = json.dumps({"webhook_type": "raw", "callback_url": "https://example.com/hook"})
    cfg = load_config(write_config(tmp_path, dataset, webhook_config=hook)).train
    logs = [SimpleNamespace(subscribers=[]) for _ in range(2)]
    for events_, main in zip(logs, (False, True), strict=True):
        webhooks.attach(cfg, events_, main)
    assert logs[0].subscribers == [] and len(logs[1].subscribers) == 1


# --- the config


def test_simpletuner_spellings_are_accepted(tmp_path, dataset):
    one = {"webhook_type": "discord", "webhook_url": "https://discord.com/api/webhooks/1/x", "log_level": "warning",
           "message_prefix": "p", "ssl_no_verify": True}
    two = {"webhook_type": "raw", "callback_url": "http://localhost:8001/callback"}
    (tmp_path / "hooks.json").write_text(json.dumps([one, two]))
    for value in (str(tmp_path / "hooks.json"), [one, two], json.dumps([one, two])):
        cfg = load_config(write_config(tmp_path, dataset, webhook_config=value, webhook_reporting_interval=5)).train
        hooks = cfg.webhooks()
        assert [(h.kind, h.url, h.log_level, h.ssl_no_verify) for h in hooks] == [
            ("discord", one["webhook_url"], "warning", True), ("raw", two["callback_url"], "info", False)]
        assert hooks[0].wants("error") and not hooks[0].wants("info")
    cfg = load_config(write_config(tmp_path, dataset, webhook_config=two)).train  # one object: a list of one
    assert len(cfg.webhooks()) == 1
    cfg = load_config(write_config(tmp_path, dataset, webhook_config=None, webhook_reporting_interval=None)).train
    assert (cfg.webhook_config, cfg.webhooks()) == (None, [])
    # inline JSON (the URLs) never reaches the trackers' hyperparameters; a path does
    assert flat_config(load_config(write_config(tmp_path, dataset, webhook_config=one)).train)["webhook_config"] == (
        "<inline webhook JSON>")


URL = f"https://discord.com/api/webhooks/1/{SECRET}"


@pytest.mark.parametrize("value, keys, named", [
    ("missing.json", {}, ["webhook_config", "missing.json: no such file"]),
    ("{not json", {}, ["webhook_config", "inline JSON is not valid"]),
    ([], {}, ["webhook_config", "non-empty list"]),
    ({"webhook_type": "slack", "webhook_url": URL}, {}, ["webhook_type 'slack'", "'discord', 'raw'"]),
    ({"webhook_type": "discord", "callback_url": URL}, {}, ["takes its URL as webhook_url, not callback_url"]),
    ({"webhook_type": "raw"}, {}, ["needs callback_url"]),
    ({"webhook_type": "raw", "callback_url": f"ftp://host/{SECRET}"}, {}, ["ftp://host/***", "not an http"]),
    ({"webhook_type": "discord", "webhook_url": URL, "username": "bot"}, {}, ["unknown key 'username'",
                                                                             "message_prefix"]),
    ({"webhook_type": "discord", "webhook_url": URL, "log_level": "loud"}, {}, ["log_level 'loud'"]),
    ({"webhook_type": "discord", "webhook_url": URL, "ssl_no_verify": "yes"}, {}, ["ssl_no_verify"]),
    ([{"webhook_type": "raw", "callback_url": URL}, 3], {}, ["webhook 2", "JSON object"]),
    (None, {"webhook_reporting_interval": 10}, ["webhook_reporting_interval", "set webhook_config"]),
    ({"webhook_type": "discord", "webhook_url": URL}, {"webhook_reporting_interval": 10},
     ["webhook_reporting_interval", "'raw' webhooks only"]),
    ({"webhook_type": "raw", "callback_url": URL}, {"webhook_reporting_interval": 0}, ["webhook_reporting_interval"]),
])
def test_misuse_is_a_config_error(tmp_path, dataset, value, keys, named):
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, webhook_config=value, **keys))
    text = "\n".join(info.value.problems)
    for words in named:
        assert words in text, text
    assert SECRET not in text


def test_a_broken_file_is_named(tmp_path, dataset):
    (tmp_path / "bad.json").write_text('{"webhook_type": "raw",\n "callback_url": }')
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, webhook_config=str(tmp_path / "bad.json")))
    assert "bad.json is not valid JSON (line 2" in "\n".join(info.value.problems)


def test_the_web_ui_confines_the_file_not_the_url(tmp_path, monkeypatch):
    """webhook_config's file must lie inside the server's roots; inline JSON (URLs) is not a path."""
    from fastapi.testclient import TestClient

    from difftune.demo import make_dataset
    from difftune.ui.server import create_app

    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    make_dataset(root / "images", count=2)
    outside.mkdir()
    hook = {"webhook_type": "raw", "callback_url": "https://example.com/hook"}
    for folder in (root, outside):
        (folder / "hooks.json").write_text(json.dumps(hook))
    write_config(root, root / "images", max_train_steps=2)
    monkeypatch.chdir(root)
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")
    body = {"path": str(root / "config" / "config.json"),
            "config": json.loads((root / "config" / "config.json").read_text()),
            "datasets": json.loads((root / "config" / "multidatabackend.json").read_text())}

    def problems(value):
        answer = client.post("/api/config/check", json={**body, "config": {**body["config"], "webhook_config": value}})
        return [p["message"] for p in answer.json()["problems"] if p["key"] == "webhook_config"]

    assert problems(str(root / "hooks.json")) == []
    assert problems(json.dumps(hook)) == []
    refused = problems(str(outside / "hooks.json"))
    assert len(refused) == 1 and "outside the folders this server may use" in refused[0]
