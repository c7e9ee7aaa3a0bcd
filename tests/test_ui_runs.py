"""The web UI's run records (ui/runs.py) without training: each run's status derived from its event log, process and
exit record, a shared event log split between its runs, and the files a past run links."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from difftune.ui.runs import Run


def fake_run(tmp_path: Path, events: list[dict], pid: int | None, exit_code: int | None = None) -> Run:
    folder = tmp_path / "state" / "r1"
    out = tmp_path / "out"
    folder.mkdir(parents=True)
    out.mkdir()
    (out / "events.jsonl").write_text("".join(json.dumps({"time": time.time(), **e}) + "\n" for e in events))
    info = {"id": "r1", "output_dir": str(out), "config_path": "c.json", "started": time.time() - 3600, "pid": pid,
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


def _events(pid: int, steps: int, final: str) -> str:
    events = [{"event": "start", "total_steps": steps, "step": 0, "pid": pid}]
    events += [{"event": "step", "step": i, "loss": 1.0 / i, "lr": 1e-3, "time": float(i)} for i in range(1, steps + 1)]
    events += [{"event": "checkpoint", "step": steps, "path": f"checkpoint-{steps}"}, {"event": final, "message": final}]
    return "".join(json.dumps({"time": time.time(), **e}) + "\n" for e in events)


def test_a_past_run_shows_only_its_own_part_of_a_shared_event_log(tmp_path):
    """Two runs into one output_dir (a re-run with resume_from_checkpoint 'latest'): the first, done at 5/5, once
    showed the second's 12 steps, its checkpoints and its failure."""
    from difftune.ui.runs import Registry

    out, state = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    log = out / "events.jsonl"
    log.write_text(_events(111, 5, "done"))
    second_offset = log.stat().st_size
    log.write_text(log.read_text() + _events(222, 12, "error"))

    def add(run_id: str, offset: int, pid: int, exit_info: dict | None) -> None:
        folder = state / "runs" / run_id
        folder.mkdir(parents=True)
        (folder / "run.json").write_text(json.dumps({"id": run_id, "output_dir": str(out), "config_path": "c.json",
                                                     "started": time.time(), "events_offset": offset}))
        if exit_info is not None:
            (folder / "exit.json").write_text(json.dumps({"returncode": 0, "pid": pid, **exit_info}))

    def first() -> dict:
        return Registry(state, tmp_path).get("a").summary(detail=True)

    add("a", 0, 111, {})  # ended before exit.json recorded where its events end: the next run's start bounds it
    add("b", second_offset, 222, {})
    expected = ("done", 5, 5, 5, 1)
    summary = first()
    assert (summary["status"], summary["step"], summary["total_steps"], len(summary["losses"]),
            len(summary["checkpoints"])) == expected
    assert Registry(state, tmp_path).get("b").summary()["status"] == "failed"
    for bound in ({"events_end": second_offset}, None):  # the recorded end; another trainer's start event
        (state / "runs" / "b").rename(state / f"gone-{bound is None}")  # the second ran as `difftune train`
        (state / "runs" / "a" / "exit.json").unlink()
        if bound is not None:
            (state / "runs" / "a" / "exit.json").write_text(json.dumps({"returncode": 0, "pid": 111, **bound}))
        summary = first()
        assert (summary["status"], summary["step"], summary["total_steps"], len(summary["losses"]),
                len(summary["checkpoints"])) == expected
        add("b", second_offset, 222, {})


def test_the_supervisor_records_where_its_runs_events_end(tmp_path, monkeypatch):
    """The supervisor's exit.json holds the size of events.jsonl when the trainer ended (the trainer here is a
    stand-in script: the process edge)."""
    from difftune.ui import runs

    out, folder = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({"id": "r", "output_dir": str(out), "events_offset": 0}))
    trainer = tmp_path / "trainer.sh"
    trainer.write_text("#!/bin/sh\necho '{\"event\": \"start\", \"pid\": '$$'}' >> \"$EVENTS\"\n")
    trainer.chmod(0o755)
    monkeypatch.setenv("EVENTS", str(out / "events.jsonl"))
    monkeypatch.setattr(runs.sys, "executable", str(trainer))
    runs.supervise(folder, "c.json")
    size = (out / "events.jsonl").stat().st_size
    assert json.loads((folder / "exit.json").read_text())["events_end"] == size > 0
    (out / "events.jsonl").write_text((out / "events.jsonl").read_text() + '{"event": "error"}\n')
    assert runs.Run(folder).status()[0] == "done"


def test_a_past_runs_view_has_its_prompts_saves_and_plain_data_errors(tmp_path):
    """Sample captions once read "step 40 · validation" (the prompt's name), the run lock was offered as an
    output, and a data error came with a traceback that hid its message."""
    run = fake_run(tmp_path, [
        {"event": "start", "total_steps": 9, "step": 0, "pid": 999999999},
        {"event": "sample", "step": 3, "path": str(tmp_path / "out" / "validation" / "a.png"), "prompt": "validation",
         "text": "a red circle", "size": "64x64", "ema": True, "image": "1of2"},
        {"event": "checkpoint", "step": 3, "path": str(tmp_path / "out" / "checkpoint-3")},
        {"event": "error", "message": "DataError: dataset(s) 'image' have no usable image\nthe data report",
         "traceback": "Traceback (most recent call last): ..."}], pid=999999999, exit_code=2)
    (tmp_path / "out" / ".difftune.lock").write_text("")
    (tmp_path / "out" / "pytorch_lora_weights.safetensors").write_text("x")
    (tmp_path / "out" / "validation").mkdir()
    (tmp_path / "out" / "validation" / "a.png").write_bytes(b"png")
    (tmp_path / "out" / "checkpoint-3").mkdir()
    for written in ("validation/a.png", "checkpoint-3", "pytorch_lora_weights.safetensors"):  # before the end
        os.utime(tmp_path / "out" / written, (time.time() - 60, time.time() - 60))
    summary = run.summary(detail=True)
    assert [(s["prompt"], s["text"]) for s in summary["samples"]] == [("validation", "a red circle")]
    # what tells a step's samples apart, for the gallery's caption (EMA or live, size, which of N)
    assert [(s["size"], s["ema"], s["image"]) for s in summary["samples"]] == [("64x64", True, "1of2")]
    assert summary["checkpoints"] == [{"step": 3, "path": "checkpoint-3"}]
    assert [o["path"] for o in summary["outputs"]] == ["pytorch_lora_weights.safetensors", "validation/a.png"]
    assert summary["status"] == "failed" and summary["message"].endswith("\nthe data report")
    assert summary["traceback"] is None  # a crash keeps its traceback (test above); a data error needs none


def test_a_past_run_links_its_own_files_after_a_later_run_set_them_aside(tmp_path):
    """A run from step 0 into the same output_dir moves the earlier result into superseded-<time>/ and writes its
    own under the same names: the past run's page linked the later run's adapter and 404 samples, and listed the
    checkpoints its checkpoints_total_limit had pruned."""
    out = tmp_path / "out"
    run = fake_run(tmp_path, [
        {"event": "start", "total_steps": 2, "step": 0, "pid": 999999999},
        {"event": "sample", "step": 2, "path": str(out / "validation" / "s.png"), "prompt": "validation"},
        {"event": "checkpoint", "step": 1, "path": str(out / "checkpoints" / "checkpoint-0000001"), "pruned": []},
        {"event": "checkpoint", "step": 2, "path": str(out / "checkpoints" / "checkpoint-0000002"),
         "pruned": ["checkpoint-0000001"]},
        {"event": "done", "adapter": str(out / "pytorch_lora_weights.safetensors")}], pid=999999999, exit_code=0)
    before, after = time.time() - 60, time.time() + 60

    def write(rel: str, when: float, folder: bool = False) -> None:
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if folder else path.write_bytes(rel.encode())
        os.utime(path, (when, when))

    for rel in ("validation/s.png", "pytorch_lora_weights.safetensors"):
        write(rel, before)
    write("checkpoints/checkpoint-0000002", before, folder=True)

    def view() -> tuple:
        summary = run.summary(detail=True)
        outputs = [o["path"] for o in summary["outputs"]]  # the Outputs card: the same files as the links
        assert outputs == sorted(x for x in [summary["adapter"], *(s["path"] for s in summary["samples"])] if x)
        return ([s["path"] for s in summary["samples"]], summary["adapter"], summary["checkpoints"],
                run.summary()["last_sample"])

    assert view()[:3] == (["validation/s.png"], "pytorch_lora_weights.safetensors",
                          [{"step": 2, "path": "checkpoints/checkpoint-0000002"}])  # the pruned one is not listed
    # the later run's start: renames keep the times, then it writes its own files of the same names
    (out / "superseded-20260101T000000Z").mkdir()
    for rel in ("validation", "pytorch_lora_weights.safetensors"):
        (out / rel).rename(out / "superseded-20260101T000000Z" / rel)
    (out / "checkpoints" / "superseded-20260101T000000Z").mkdir()
    (out / "checkpoints" / "checkpoint-0000002").rename(
        out / "checkpoints" / "superseded-20260101T000000Z" / "checkpoint-0000002")
    for rel in ("validation/s.png", "pytorch_lora_weights.safetensors"):
        write(rel, after)
    write("checkpoints/checkpoint-0000002", after, folder=True)
    write("validation/later-only.png", after)  # the later run's alone: not the past run's output
    samples, adapter, checkpoints, last = view()
    assert samples == ["superseded-20260101T000000Z/validation/s.png"] and last["path"] == samples[0]
    assert adapter == "superseded-20260101T000000Z/pytorch_lora_weights.safetensors"
    assert checkpoints == [{"step": 2, "path": "checkpoints/superseded-20260101T000000Z/checkpoint-0000002"}]
    shutil.rmtree(out / "superseded-20260101T000000Z")  # deleted by the user: nothing of that run is left
    samples, adapter, _, last = view()
    assert samples == [] and adapter is None and last is None


def test_a_run_stopped_before_its_first_step_is_stopped_not_failed(tmp_path):
    """Stop during caching ends the trainer with SIGTERM's status (143) and no "stopped" event."""
    run = fake_run(tmp_path, [], pid=None, exit_code=143)
    (run.folder / "stop-requested").touch()
    status, message = run.status()
    assert status == "stopped" and "before training began" in message


def test_polls_at_once_read_each_event_once(tmp_path, monkeypatch):
    """The page polls the run list and the open run in worker threads: two reading the new bytes at once counted
    every event twice (each checkpoint listed twice, the loss curve's steps out of order)."""
    import threading

    events = [{"event": "start", "total_steps": 20000, "step": 0, "pid": 999999999}]
    for step in range(1, 20001):
        events.append({"event": "step", "step": step, "loss": 0.5})
        if step % 1000 == 0:
            events.append({"event": "checkpoint", "step": step, "path": f"/x/checkpoint-{step:07d}", "pruned": []})
    run = fake_run(tmp_path, events, pid=999999999, exit_code=0)
    together, fdopen = threading.Barrier(2), os.fdopen

    class Log:  # each reader, having read, waits for the other before going on: the race, every time
        def __init__(self, *args):
            self.file = fdopen(*args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def __getattr__(self, name):
            return getattr(self.file, name)

        def read(self, *args):
            data = self.file.read(*args)
            try:
                together.wait(timeout=1)
            except threading.BrokenBarrierError:
                pass  # the other reader waits for this one to finish: they take turns
            return data

    monkeypatch.setattr(os, "fdopen", Log)
    threads = [threading.Thread(target=run.read_events) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [s for s, _, _ in run.steps] == list(range(1, 20001))
    assert [e["step"] for e in run.events if e["event"] == "checkpoint"] == list(range(1000, 20001, 1000))


def test_the_trainers_messages_name_the_users_files_not_the_runs_snapshot(tmp_path):
    """The trainer reads a snapshot of the checked config in the run's folder: its errors said "fix
    <state>/runs/<id>/multidatabackend.json", a copy nothing reads."""
    snapshot = tmp_path / "state" / "r1"
    problem = f"{snapshot / 'multidatabackend.json'}: dataset 'imgs': instance_data_dir is not a folder; fix the path"
    run = fake_run(tmp_path, [{"event": "start", "total_steps": 2, "step": 0, "pid": 999999999},
                              {"event": "error", "message": f"ConfigError: {problem}", "traceback": "tb"}],
                   pid=999999999, exit_code=2)
    run.info.update(config_path="/home/me/config/config.json", datasets_path="/home/me/config/multidatabackend.json")
    (run.folder / "log.txt").write_text(f"error: {problem}\n  - {snapshot / 'config.json'}: learning_rate: bad\n")
    summary = run.summary(detail=True)
    assert summary["message"] == "ConfigError: /home/me/config/multidatabackend.json: dataset 'imgs': " \
        "instance_data_dir is not a folder; fix the path"
    assert summary["log_tail"] == [summary["message"].replace("ConfigError:", "error:"),
                                   "  - /home/me/config/config.json: learning_rate: bad"]
    assert str(snapshot) not in json.dumps(summary["messages"] + summary["log_tail"])


def test_a_past_run_between_two_others_links_its_own_files_not_the_earlier_ones():
    """Runs A, B, C into one output_dir: B's page took A's adapter (the oldest superseded folder was tried first)
    and listed files B never wrote."""
    import tempfile

    from difftune.ui.run_files import RunFiles

    out = Path(tempfile.mkdtemp())
    now = time.time()
    for folder, when in (("superseded-20260101T000000Z", now - 100), ("superseded-20260102T000000Z", now - 50),
                         ("", now + 50)):  # A's, B's, C's
        (out / folder).mkdir(exist_ok=True)
        (out / folder / "lora.safetensors").write_text(folder)
        os.utime(out / folder / "lora.safetensors", (when, when))
    (out / "superseded-20260101T000000Z" / "a-only.png").write_text("A")
    os.utime(out / "superseded-20260101T000000Z" / "a-only.png", (now - 100, now - 100))
    files = RunFiles(out)
    assert files.locate(str(out / "lora.safetensors"), now) == "superseded-20260102T000000Z/lora.safetensors"
    assert files.locate(str(out / "a-only.png"), now, started=now - 60) is None  # B never wrote it
    assert files.locate(str(out / "a-only.png"), now - 90) == "superseded-20260101T000000Z/a-only.png"  # A's
