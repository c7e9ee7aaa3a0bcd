"""The output_dir lock and the web UI supervisor's stop of a trainer: real processes, no model (each test takes
about a second). The full command-line runs (SIGTERM mid-training, a second `difftune train` refused) are in
tests/test_kill.py and tests/test_train.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from difftune.train.run_lock import LOCK_FILE, LOCK_WAIT_S, OutputDirInUse, output_dir_lock
from difftune.ui.runs import Forwarder

HOLD = """
import sys, time
from pathlib import Path
from difftune.train.run_lock import output_dir_lock
with output_dir_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(120)
"""


def holder(output_dir: Path) -> subprocess.Popen:
    """Another process that takes output_dir's lock and keeps it until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(output_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_live_holder_refuses_and_a_killed_ones_lock_is_taken_over(tmp_path):
    out = tmp_path / "output"
    proc = holder(out)
    try:
        assert (out / LOCK_FILE).read_text().strip() == str(proc.pid)
        began = time.monotonic()
        with pytest.raises(OutputDirInUse) as info, output_dir_lock(out, wait_s=0.5):
            pass
        assert 0.5 <= time.monotonic() - began < 5
        assert str(info.value) == (f"output_dir {out.resolve()} is in use by another training run (pid {proc.pid}); "
                                   "wait for it to end or stop it, or choose another output_dir")
        with output_dir_lock(out, main=False):  # a process other than 0 of a multi-process run does not lock
            pass
    finally:
        proc.kill()  # SIGKILL: the lock file stays, with the dead pid in it
        proc.wait()
    assert (out / LOCK_FILE).read_text().strip() == str(proc.pid)
    with output_dir_lock(out):
        assert (out / LOCK_FILE).read_text().strip() == str(os.getpid())
        with pytest.raises(OutputDirInUse, match=f"pid {os.getpid()}"), output_dir_lock(out, wait_s=0):
            pass  # a second lock in the same process is refused too (one lock per open file)
    with output_dir_lock(out):  # released on leaving: the next run (the web UI's restart) takes it
        pass


def test_the_process_rank_decides_who_locks(tmp_path, monkeypatch):
    """torchrun and accelerate launch set RANK: only process 0 takes the lock, the others share the folder."""
    out = tmp_path / "output"
    proc = holder(out)
    try:
        monkeypatch.setenv("RANK", "1")
        with output_dir_lock(out):
            pass
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(OutputDirInUse), output_dir_lock(out, wait_s=0):
            pass
    finally:
        proc.kill()
        proc.wait()


def test_a_run_that_is_ending_gets_a_moment_to_let_go(tmp_path):
    """The web UI offers the next start as soon as a run has logged its end, while it may still be closing its
    trackers: a lock released within LOCK_WAIT_S is taken, not refused."""
    out = tmp_path / "output"
    proc = holder(out)
    try:
        threading.Timer(0.5, proc.kill).start()
        began = time.monotonic()
        with output_dir_lock(out):
            assert 0.4 < time.monotonic() - began < LOCK_WAIT_S
    finally:
        proc.kill()
        proc.wait()


STUBBORN = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: print("saving", flush=True))  # a trainer busy with a long step
print("up", flush=True)
time.sleep(120)
"""

POLITE = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # saves and exits at once
print("up", flush=True)
time.sleep(120)
"""


def child(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_kill_from_the_web_ui_passes_sigterm_on_and_then_sigkills(tmp_path):
    """The supervisor's handler: a trainer that exits on SIGTERM (saving its checkpoint) ends with its own status; one
    still alive after the grace period, or sent "kill" a second time, is SIGKILLed."""
    polite = child(POLITE)
    forward = Forwarder(polite, grace_s=30)
    forward(signal.SIGTERM)
    assert forward.wait() == 143

    stubborn = child(STUBBORN)
    forward = Forwarder(stubborn, grace_s=1.0)
    began = time.monotonic()
    forward(signal.SIGTERM)
    assert stubborn.stdout.readline().strip() == "saving"  # it got the SIGTERM first
    assert forward.wait() == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - began < 10

    again = child(STUBBORN)
    forward = Forwarder(again, grace_s=60)
    forward(signal.SIGTERM)
    assert again.stdout.readline().strip() == "saving"
    forward(signal.SIGTERM)  # kill pressed again: at once
    began = time.monotonic()
    assert forward.wait() == -signal.SIGKILL and time.monotonic() - began < 5


def test_a_held_sigterm_is_raised_at_the_block_end_and_a_second_one_at_once(monkeypatch):
    from difftune.train import run_lock
    from difftune.train.run_lock import Terminated, held, sigterm_stops, take_held

    monkeypatch.setattr(run_lock, "REPEAT_S", 0.0)  # every signal here is a new request (see the test below)

    def term():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs at the next bytecode; this leaves it time

    reached = []
    with pytest.raises(Terminated, match="terminated by SIGTERM"), sigterm_stops(), held():
        term()
        reached.append("after the first")  # held: the block goes on
    assert reached == ["after the first"]

    with pytest.raises(Terminated), sigterm_stops(), held():
        term()
        with held():  # nested (several processes: the whole loop, and each step in it)
            pass  # leaving an inner block raises nothing
        reached.append("after the inner block")
        term()  # a second one: at once
        reached.append("never")
    assert reached[-1] == "after the inner block"

    with sigterm_stops(), held():
        term()
        assert take_held() == signal.SIGTERM  # taken (the loop's exchange between processes): no longer raised
    with held():  # no handler of ours installed: nothing to hold
        assert take_held() is None


def test_ctrl_c_is_held_to_the_step_end_like_sigterm(capsys):
    """Ctrl-C in the middle of a step saved the step before with the data position of the step it cut: the resume
    skipped a batch. On the command line it waits for the step's end too, says so, and keeps Ctrl-C's meaning."""
    from difftune.train.run_lock import Terminated, held, sigterm_stops

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's process has it (a test
    reached = []                                                       # worker may have SIGINT ignored)
    with pytest.raises(Terminated) as info, sigterm_stops(), held():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        reached.append("after Ctrl-C")
    assert reached == ["after Ctrl-C"] and info.value.reason == "interrupted" and info.value.signum == signal.SIGINT
    assert "stopping after the step in progress" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    signal.signal(signal.SIGINT, before)


def test_the_same_sigterm_delivered_twice_is_one_request():
    """A group kill reaches a torchrun worker directly and again through torchrun: taken as a second SIGTERM, it
    stopped one process at once, mid-step, while the other waited in a collective (and was SIGKILLed 30 s later)."""
    from difftune.train import run_lock
    from difftune.train.run_lock import Terminated, held, sigterm_stops

    def term():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)

    reached = []
    with pytest.raises(Terminated), sigterm_stops(), held():
        term()
        term()  # the same request, delivered again within REPEAT_S: still held
        reached.append("the step finishes")
    assert reached == ["the step finishes"]
    with sigterm_stops():  # outside a held block the first raises; a repeat during the interrupted save does not
        with pytest.raises(Terminated):
            term()
        term()
        reached.append("the save finishes")
    assert reached[-1] == "the save finishes" and run_lock.REPEAT_S >= 1



def test_an_output_dir_that_takes_no_file_fails_before_any_model_loads(tmp_path, dataset, monkeypatch, capsys):
    """A read-only checkpoints/ (a remounted share, another owner after a copy): `check` said OK and `train` died at
    its first checkpoint with a traceback. Permission bits cannot show it (root, read-only mounts): a file is made.
    (Made to fail here at the OS edge, since the tests may run as root.)"""
    import errno
    import tempfile

    from conftest import write_config
    from difftune.cli import main
    from difftune.train import run_lock, setup

    path = write_config(tmp_path, dataset, max_train_steps=1)
    out = tmp_path / "output"
    (out / "checkpoints").mkdir(parents=True)
    run_lock.check_writable(out)  # writable: passes, leaves nothing
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]
    real = tempfile.mkstemp

    def read_only_checkpoints(*args, dir=None, **kwargs):
        if Path(dir) == out / "checkpoints":
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(run_lock.tempfile, "mkstemp", read_only_checkpoints)
    monkeypatch.setattr(setup, "build_run", lambda *a, **k: pytest.fail("a model loaded"))
    for command in ("check", "train", "cache"):
        capsys.readouterr()
        assert main([command, "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"error: output_dir: cannot write in {out / 'checkpoints'} (Permission denied)" in err, command
        assert "Traceback" not in err
    # a stray file where the run makes a folder
    (out / "validation").write_text("x")
    capsys.readouterr()
    assert main(["check", "--config", str(path)]) == 2
    assert f"error: output_dir: {out / 'validation'} is a file, where the run writes a folder" in capsys.readouterr().err
    (out / "validation").unlink()
    # an events.jsonl an earlier run as another user left (sudo difftune train)
    monkeypatch.setattr(run_lock.tempfile, "mkstemp", real)
    (out / "events.jsonl").write_text("")

    def foreign(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(run_lock, "open", foreign, raising=False)
    capsys.readouterr()
    assert main(["check", "--config", str(path)]) == 2
    assert f"error: output_dir: cannot write {out / 'events.jsonl'} (Permission denied)" in capsys.readouterr().err


def test_a_held_sigterm_abandons_validation_sampling(tmp_path, dataset):
    """Several processes hold a SIGTERM for the whole loop: process 0 went on sampling (minutes at real size), past
    torchrun's 30 s before SIGKILL, and the interrupted checkpoint was lost. The sampling now stops at the next
    transformer call; the signal stays held for the loop's stop after the step."""
    import json

    from conftest import write_config
    from difftune.config import load_config
    from difftune.train import loop
    from difftune.train.run_lock import held, sigterm_stops, take_held
    from difftune.train.setup import build_run

    path = write_config(tmp_path, dataset, max_train_steps=1, validation_prompt="a red circle",
                        validation_resolution="32x32", validation_num_inference_steps=2)
    run = build_run(load_config(path))
    with sigterm_stops(), held():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert loop.sample(run, "step-000001") == []
        assert take_held() == signal.SIGTERM
    run.events.close()
    log = [json.loads(line) for line in (run.output_dir / "events.jsonl").read_text().splitlines()]
    assert any("validation step-000001 abandoned: a stop signal came" in e.get("message", "") for e in log)
    assert not list((run.output_dir / "validation").glob("*.png"))
