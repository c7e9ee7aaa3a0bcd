"""The event log and the output folder's lock when the folder is deleted under a running trainer."""

from __future__ import annotations

import json
import shutil

from difftune.train.events import Events
from difftune.train.run_lock import in_use, output_dir_lock


def test_a_deleted_output_folder_gets_its_log_and_lock_back(tmp_path):
    """`rm -rf output` while training: events went on into the deleted file (the web UI lost the run) and the lock
    went with the folder (a second run into it would not be refused)."""
    out = tmp_path / "output"
    with output_dir_lock(out, main=True):
        events = Events(out / "events.jsonl", console=False)
        events.emit("start", total_steps=3, step=0, pid=1)
        events.emit("info", message="one")
        shutil.rmtree(out)
        assert in_use(out) is None  # nothing to refuse a second run with
        events._checked = 0.0  # the file is looked at once a second: now
        events.emit("info", message="two")
        lines = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        # the run's start again: the web UI counts a run's steps from it
        assert [e["event"] for e in lines] == ["warning", "start", "info"] and lines[2]["message"] == "two"
        assert "was deleted while this run trained" in lines[0]["message"] and "taken again" in lines[0]["message"]
        assert in_use(out) is not None  # locked again
        events._checked = 0.0
        events.emit("info", message="three")  # once: no second warning
        assert len((out / "events.jsonl").read_text().splitlines()) == 4
        events.close()
    assert in_use(out) is None
