"""The web UI's "kill" on a real run of the tiny model, and a new run in the folder it left: the trainer gets SIGTERM
through the supervisor, saves an interrupted checkpoint and exits; the next start in that folder takes the
output_dir lock over and resumes from that checkpoint."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from conftest import write_config
from difftune.demo import make_dataset
from difftune.ui.runs import Registry
from difftune.ui.server import create_app
from test_ui_api import wait_for


def test_kill_saves_and_the_folder_can_be_run_again(lumina2_dir, tmp_path):
    root = tmp_path / "root"
    make_dataset(root / "images", count=4)
    config = write_config(root, root / "images", max_train_steps=5000, resume_from_checkpoint="latest")
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")
    registry = Registry(tmp_path / "state", root)
    try:
        first = client.post("/api/runs", json={"path": str(config)}).json()["id"]
        wait_for(client, first, lambda r: r["status"] == "running" and r["step"] >= 2)
        assert client.post(f"/api/runs/{first}/command", json={"command": "kill"}).status_code == 200
        run = wait_for(client, first, lambda r: r["status"] == "stopped", timeout=60)
        assert run["message"] == "terminated by SIGTERM"
        events = [json.loads(line) for line in (root / "output" / "events.jsonl").read_text().splitlines()]
        saved = [e for e in events if e["event"] == "checkpoint"][-1]
        assert saved["reason"] == "terminated by SIGTERM" and saved["step"] == run["step"] >= 2

        # at once, as a user may: the first trainer may still be exiting (it has the lock until it has)
        second = client.post("/api/runs", json={"path": str(config)}).json()["id"]
        run = wait_for(client, second, lambda r: r["status"] == "running" and r["step"] > saved["step"])
        assert json.loads((registry.dir / first / "exit.json").read_text())["returncode"] == 143
        events = [json.loads(line) for line in (root / "output" / "events.jsonl").read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "start"] == [0, saved["step"]]
    finally:
        for run in registry.list():
            if run.status()[0] in ("starting", "running", "stopping"):
                registry.command(run, "kill")
