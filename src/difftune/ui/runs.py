"""Runs started from the web UI: spawn, find again after a restart, and derive each one's status.

A run is a folder `<state>/runs/<id>/` holding `run.json` (what was started, where, by which
process), `config.json` and `multidatabackend.json` (the checked config, which the trainer reads),
`log.txt` (the trainer's stdout and stderr) and, once the trainer has ended, `exit.json` (its exit
status). The trainer runs under a small supervisor process (`python -m difftune.ui.runs`)
in its own session: closing the browser or stopping the server does not stop it, and the exit status
is recorded even when nobody is watching. Progress comes from the trainer's own `events.jsonl`, read
from the offset it had when the run started to where the run ended (an output_dir holds the log of
every run into it: see Run.read_events).

Status: `starting` (process up, no start event yet), `running`, `stopping` (a stop was sent),
`done`, `stopped`, or `failed`: an error event, or a process that ended without a final event
(a config error, a crash before training, the out-of-memory killer).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from difftune.train.commands import send_command
from difftune.ui.run_files import RunFiles

log = logging.getLogger("difftune.ui")
TERMINAL = {"done": "done", "stopped": "stopped", "error": "failed"}
MEDIA = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".mp4", ".webm")
MAX_CURVE_POINTS = 1000
SPEED_FIELDS = ("tokens_per_s", "tflops", "mfu", "peak_memory_gib")  # of the "step" event
# the errors `difftune train` prints as one "error: ..." line (cli.main): their message says what to fix, and a
# traceback would only hide it
USER_ERRORS = ("ConfigError", "DataError", "NothingToTrain", "ComponentError", "CheckpointError", "HubAccessError")


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def process_alive(pid: int | None, started: float | None) -> bool:
    """Alive, not a zombie, and the same process (its start time matches; pids are reused)."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < 1.0
    except (psutil.Error, OSError):
        return False


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def tail_lines(path: Path, count: int = 40, max_bytes: int = 65536) -> list[str]:
    """The last lines of a log, with progress-bar redraws (carriage returns) collapsed."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in data.split("\n")]
    return [line for line in lines if line.strip()][-count:]


def _info_problem(info: dict[str, Any]) -> str | None:
    """Why a run.json cannot be used (a hand-edited or damaged one), or None: each field's type is checked
    here, so that nothing later (the sort by start time, the event offsets) fails on it."""
    def number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    checks = {"id": isinstance(info.get("id"), str) and info.get("id"),
              "output_dir": isinstance(info.get("output_dir"), str) and info.get("output_dir"),
              "events_offset": isinstance(info.get("events_offset", 0), int) and info.get("events_offset", 0) >= 0,
              "started": number(info.get("started", 0)),
              "pid": info.get("pid") is None or isinstance(info.get("pid"), int),
              "pid_started": info.get("pid_started") is None or number(info.get("pid_started"))}
    bad = [key for key, ok in checks.items() if not ok]
    return f"{', '.join(bad)}: missing or of the wrong type" if bad else None


class Run:
    def __init__(self, folder: Path):
        self.folder = folder
        info = _read_json(folder / "run.json")
        if info is None:
            raise ValueError(f"{folder}: no readable run.json")
        if (problem := _info_problem(info)) is not None:
            raise ValueError(f"{folder / 'run.json'}: {problem}")
        self.info = info
        self.id: str = info["id"]
        self.output_dir = Path(info["output_dir"])
        self.events_path = self.output_dir / "events.jsonl"
        self._pos = int(info.get("events_offset", 0))
        self._partial = b""
        self._closed = False  # the rest of the log belongs to later runs
        # this run's trainer has logged its "start": the steps before it are another trainer's (one that writes into
        # the same output_dir, whose lock then made this run fail)
        self._started = False
        self._inode: int | None = None  # of the log read last: a new file (the folder deleted) is read from its start
        self.next_offset: int | None = None  # where the next run into this output_dir starts (Registry sets it)
        self.events: list[dict[str, Any]] = []  # every event but "step"s, which a long run has by the million
        self.steps: list[tuple[int, float, float | None]] = []  # (step, time, loss) of each "step" event
        self.last_step: dict[str, Any] | None = None  # the last "step" event whole (lr, throughput)
        self.files = RunFiles(self.output_dir)
        self._reading = threading.Lock()

    # --- reading
    def _events_end(self) -> int | None:
        """Where this run's slice of events.jsonl ends: an output_dir is shared by every run into it (a re-run
        with resume_from_checkpoint 'latest' reuses it), and a past run must not show the later runs' status,
        steps and samples. The supervisor records the log's size when the trainer ends; a run that ended
        without that record stops where the next run began."""
        end = (self.exit_info() or {}).get("events_end")
        return end if isinstance(end, int) and not isinstance(end, bool) else self.next_offset

    def _trainer_pid(self) -> int | None:
        pid = (self.exit_info() or {}).get("pid")
        if isinstance(pid, int):
            return pid
        return next((e.get("pid") for e in self.events if e["event"] == "start"), None)

    def read_events(self) -> list[dict[str, Any]]:
        # the web UI's polls run in worker threads (the run list every 3 s, the open run's detail every second): two
        # reading the same bytes at once counted every event twice (each checkpoint listed twice, steps out of order)
        with self._reading:
            return self._read_new_events()

    def _read_new_events(self) -> list[dict[str, Any]]:
        if self._closed:
            return self.events
        end = self._events_end()
        try:  # non-blocking and regular files only: a FIFO put in output_dir must not stall the server
            fd = os.open(self.events_path, os.O_RDONLY | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return self.events
            with os.fdopen(fd, "rb") as f:
                f.seek(0, os.SEEK_END)
                inode, self._inode = self._inode, os.fstat(f.fileno()).st_ino
                if f.tell() < self._pos or inode not in (None, self._inode):  # replaced: read it again from the start
                    self._pos, self._partial, self.events, self.steps, self.last_step = 0, b"", [], [], None
                    self._started = False
                f.seek(self._pos)
                data = f.read() if end is None else f.read(max(0, end - self._pos))
                self._pos = f.tell()
        except OSError:
            return self.events
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if not (isinstance(event, dict) and isinstance(event.get("event"), str)):
                continue
            if event["event"] == "start" and (pid := self._trainer_pid()) is not None and event.get("pid") != pid:
                self._closed = True  # another trainer's start (`difftune train` into the same output_dir)
                break
            self._started = self._started or event["event"] == "start"
            if event["event"] == "step" and not self._started:
                continue
            if event["event"] == "step" and isinstance(event.get("step"), int) and \
                    isinstance(event.get("time"), int | float):
                loss = event.get("loss")
                self.steps.append((event["step"], event["time"], loss if isinstance(loss, int | float) else None))
                self.last_step = event
                continue
            self.events.append(event)
        if end is not None and self._pos >= end:
            self._closed = True
        return self.events

    def exit_info(self) -> dict[str, Any] | None:
        return _read_json(self.folder / "exit.json")

    def alive(self) -> bool:
        if process_alive(self.info.get("pid"), self.info.get("pid_started")):
            return True
        start = next((e for e in self.events if e["event"] == "start"), None)
        return bool(start) and self.exit_info() is None and process_alive(start.get("pid"), None)

    def log_tail(self, count: int = 40) -> list[str]:
        return [self.as_user(line) for line in tail_lines(self.folder / "log.txt", count)]

    def as_user(self, text: Any) -> Any:
        """The trainer's text with the snapshot's file names (which it reads) as the user's files: an error that
        says "fix <state folder>/runs/<id>/multidatabackend.json" sends the user to a copy that nothing reads."""
        if not isinstance(text, str):
            return text
        for name, key in (("multidatabackend.json", "datasets_path"), ("config.json", "config_path")):
            if isinstance(shown := self.info.get(key), str):
                text = text.replace(str(self.folder / name), shown)
        return text

    # --- status
    def status(self) -> tuple[str, str | None]:
        """(status, message); the message says why a run failed or stopped."""
        self.read_events()
        for event in reversed(self.events):
            if event["event"] in TERMINAL:
                status = TERMINAL[event["event"]]
                return status, event.get("message") or event.get("reason")
        exit_info = self.exit_info()
        if exit_info is None and self.alive():
            if (self.folder / "stop-requested").exists():
                return "stopping", None
            started = any(e["event"] == "start" for e in self.events)
            return ("running" if started else "starting"), None
        if (self.folder / "killed").exists():
            return "stopped", "killed from the web UI"
        if exit_info is None:
            return "failed", "the training process is gone and left no exit status (was the machine restarted?)"
        code = exit_info.get("returncode")
        if code == 0:
            return "done", None
        if code in (128 + signal.SIGTERM, -signal.SIGTERM) and (self.folder / "stop-requested").exists():
            # Stop before the first step (train/commands.stop_while): no "stopped" event, the caches kept
            return "stopped", "stopped before training began (the caches filled so far are kept for the next start)"
        if isinstance(code, int) and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            hint = " (the out-of-memory killer does this)" if -code == signal.SIGKILL else ""
            return "failed", f"the training process was killed by {name}{hint}"
        cause = self.last_exception()
        if code == 2:
            return "failed", "the configuration or the datasets cannot be used" + (f": {cause}" if cause else " (see the log)")
        return "failed", f"the training process exited with status {code} before finishing" + (
            f": {cause}" if cause else " (see the log)")

    def last_exception(self) -> str | None:
        """The last 'SomeError: message' (or 'error: ...') line of the log, the crash's own words. A line ending
        in ':' is a header (`error: the configuration cannot be used:`): the problems are the '- ...' lines
        after it, and they are what the user must read."""
        lines = self.log_tail(60)
        for index in range(len(lines) - 1, -1, -1):
            line = lines[index].strip()
            if re.match(r"(\w+\.)*\w*(Error|Exception|Interrupt|Exit)\b.*|error: ", line):
                if line.endswith(":"):
                    items = itertools.takewhile(lambda item: item.strip().startswith("- "), lines[index + 1:])
                    line = "\n".join([line, *(item.strip() for item in items)])
                return line[:2000]
        return None

    def summary(self, detail: bool = False) -> dict[str, Any]:
        status, message = self.status()
        message = self.as_user(message)
        events = self.events
        start = next((e for e in events if e["event"] == "start"), None)
        steps, last = self.steps, self.last_step
        total = start.get("total_steps") if start else None
        out: dict[str, Any] = {
            "id": self.id, "status": status, "message": message, "config_path": self.info.get("config_path"),
            "output_dir": str(self.output_dir), "started": self.info.get("started"),
            "ended": next((e.get("time") for e in reversed(events) if e["event"] in TERMINAL), None)
            or (self.exit_info() or {}).get("time"),
            "step": last["step"] if last else (start or {}).get("step", 0), "total_steps": total,
            "loss": last.get("loss") if last else None, "lr": last.get("lr") if last else None,
            "its": None, "eta_s": None,
        }
        for key in SPEED_FIELDS:  # the last step's throughput (train/throughput.py); None where it was not logged
            out[key] = last.get(key) if last else None
        if len(steps) >= 2:
            window = steps[-20:]
            span = window[-1][1] - window[0][1]
            if span > 0:
                out["its"] = (window[-1][0] - window[0][0]) / span
                if total and status in ("running", "stopping"):
                    out["eta_s"] = max(0.0, (total - window[-1][0]) / out["its"])
        # a past run's files as it left them: a later run into the same output_dir moves them aside and writes its
        # own under the same names (ui/run_files.py)
        past = out["ended"] if status not in ("running", "stopping", "starting") else None
        samples = [e for e in events if e["event"] == "sample"]
        if not detail:
            last_sample = next((e for e in reversed(samples) if self.files.locate(e.get("path"), past)), None)
            out["last_sample"] = self._sample(last_sample, past) if last_sample else None
            return out
        # prompt: the prompt's name ("validation", a library name); text: the prompt itself (older runs: None)
        out["samples"] = [self._sample(e, past) for e in samples if self.files.locate(e.get("path"), past)]
        stride = max(1, len(steps) // MAX_CURVE_POINTS)
        out["losses"] = [[step, loss] for step, _, loss in steps[::stride]]
        if steps and out["losses"][-1][0] != steps[-1][0]:
            out["losses"].append([steps[-1][0], steps[-1][2]])
        out["evaluations"] = [[e["step"], e["value"]] for e in events  # CLIP scores (train/evaluation.py)
                              if e["event"] == "evaluation" and isinstance(e.get("value"), int | float)]
        out["eval_losses"] = [[e["step"], e["loss"]] for e in events  # held-out loss (train/eval_loss.py)
                              if e["event"] == "eval_loss" and isinstance(e.get("loss"), int | float)]
        pruned = {name for e in events if e["event"] == "checkpoint" for name in e.get("pruned") or []
                  if isinstance(name, str)}  # by checkpoints_total_limit, later in this run
        out["checkpoints"] = [{"step": e.get("step"), "path": self.files.locate(e.get("path"), past)}
                              for e in events if e["event"] == "checkpoint"
                              and Path(str(e.get("path"))).name not in pruned]
        done = next((e for e in events if e["event"] in ("done", "stopped") and e.get("adapter")), None)
        out["adapter"] = self.files.locate(done.get("adapter"), past) if done else None
        out["messages"] = [{"event": e["event"],
                            "message": self.as_user(e.get("message") or e.get("text") or e.get("command"))}
                           for e in events if e["event"] in ("info", "warning", "data_report", "command")][-50:]
        error = next((e for e in reversed(events) if e["event"] == "error"), None)
        user_error = error is not None and str(error.get("message", "")).startswith(tuple(f"{n}:" for n in USER_ERRORS))
        out["traceback"] = self.as_user(error.get("traceback")) if error and not user_error else None
        out["log_tail"] = self.log_tail() if status in ("failed", "starting") or detail else []
        out["outputs"] = self.outputs(past)
        return out

    def relative(self, path: str | None) -> str | None:
        """A path from the event log as a path inside output_dir (None when it lies elsewhere)."""
        return self.files.relative(path)

    def _sample(self, event: dict[str, Any], past: float | None) -> dict[str, Any]:
        # size, EMA and the image's number tell apart the samples of one step (the gallery's caption)
        return {"step": event.get("step"), "prompt": event.get("prompt"), "text": event.get("text"),
                "path": self.files.locate(event.get("path"), past), "size": event.get("size"),
                "ema": bool(event.get("ema")), "image": event.get("image")}

    def outputs(self, past: float | None = None) -> list[dict[str, Any]]:
        """Files at the top of output_dir and the media under validation/; for a past run (`past`: when it ended)
        the files as it left them (ui/run_files.py): a later run's of the same name are not its, and its own that a
        later start moved into a superseded folder are."""
        places = [""] + ([f"{name}/" for name in self.files.superseded("")] if past is not None else [])
        names: dict[str, None] = {}
        for place in places:
            for sub in ("", "validation/"):
                try:
                    entries = sorted((self.output_dir / place / sub).iterdir())
                except OSError:
                    continue
                for entry in entries:
                    # not the event log, nor hidden files (the run lock .difftune.lock, temporary files)
                    if entry.is_file() and not entry.is_symlink() and entry.name != "events.jsonl" \
                            and not entry.name.startswith(".") and (not sub or entry.suffix.lower() in MEDIA):
                        names[sub + entry.name] = None
        found = []
        for rel in sorted(names):
            started = self.info.get("started") if past is not None else None  # not an earlier run's file either
            if (where := self.files.locate(str(self.output_dir / rel), past, started)) is None:
                continue  # a later (or earlier) run's file
            try:
                found.append({"path": where, "size": (self.output_dir / where).stat().st_size})
            except OSError:
                continue
        return found


class Registry:
    """The runs this server (or an earlier one with the same state folder) started."""

    def __init__(self, state_dir: Path, base: Path):
        self.dir = Path(state_dir) / "runs"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.base = base
        self.runs: dict[str, Run] = {}
        self.children: dict[str, subprocess.Popen] = {}
        self.unreadable: set[str] = set()
        self.reload()

    def reload(self) -> None:
        for run_id in [r for r, run in self.runs.items() if not (run.folder / "run.json").exists()]:
            del self.runs[run_id]  # its folder was removed: the run is no longer listed
        for folder in sorted(self.dir.iterdir()):
            if folder.name not in self.runs and (folder / "run.json").exists():
                try:
                    self.runs[folder.name] = Run(folder)
                except (ValueError, KeyError) as e:
                    if folder.name not in self.unreadable:  # said once; the run is left out of the list
                        self.unreadable.add(folder.name)
                        log.warning("left out run %s: %s", folder.name, e)
                    continue
        self._bound_slices()

    def _bound_slices(self) -> None:
        """Each run's slice of a shared events.jsonl ends where the next run into that output_dir began."""
        by_dir: dict[str, list[Run]] = {}
        for run in self.runs.values():
            by_dir.setdefault(str(run.output_dir), []).append(run)
        for runs in by_dir.values():
            runs.sort(key=lambda r: (int(r.info.get("events_offset", 0)), r.info.get("started", 0)))
            for run, later in itertools.pairwise(runs):
                run.next_offset = int(later.info.get("events_offset", 0))

    def reap(self) -> None:
        for run_id, child in list(self.children.items()):
            if child.poll() is not None:
                del self.children[run_id]

    def list(self) -> list[Run]:
        self.reap()
        self.reload()
        return sorted(self.runs.values(), key=lambda r: r.info.get("started", 0), reverse=True)

    def get(self, run_id: str) -> Run | None:
        self.reap()
        if run_id not in self.runs or not (self.runs[run_id].folder / "run.json").exists():
            self.reload()
        return self.runs.get(run_id)

    def active_on(self, output_dir: Path) -> Run | None:
        for run in self.list():
            if run.output_dir.resolve() == output_dir.resolve() and run.status()[0] in ("starting", "running", "stopping"):
                return run
        return None

    def spawn(self, config_path: Path, output_dir: Path, config: dict[str, Any], datasets: Any,
              datasets_path: Path | None = None) -> Run:
        """Start a run of `config` and `datasets`, the values that were checked: the trainer reads a snapshot of
        them in the run's folder, not the user's files, which a save right after Start may already have changed
        (to something the check would refuse). `config_path` and `datasets_path` are only shown (in the trainer's
        messages, in place of the snapshot's)."""
        run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
        folder = self.dir / run_id
        folder.mkdir(parents=True)
        snapshot, snapshot_list = folder / "config.json", folder / "multidatabackend.json"
        _write_json(snapshot_list, datasets)
        # relative paths in both resolve against the trainer's working folder (self.base), as from the user's files;
        # data_backend_config, however spelled (`--data_backend_config`), now names the snapshot's list
        _write_json(snapshot, {**{k: v for k, v in config.items() if k.lstrip("-") != "data_backend_config"},
                               "data_backend_config": str(snapshot_list)})
        events = output_dir / "events.jsonl"
        for stale in (output_dir / "commands").glob("*.json"):  # commands meant for an earlier run
            stale.unlink(missing_ok=True)
        info = {"id": run_id, "config_path": str(config_path), "datasets_path": str(datasets_path or snapshot_list),
                "output_dir": str(output_dir),
                "events_offset": events.stat().st_size if events.exists() else 0, "started": time.time(),
                "cwd": str(self.base)}
        _write_json(folder / "run.json", info)
        command = [sys.executable, "-m", "difftune.ui.runs", str(folder), str(snapshot)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(os.devnull, "rb") as stdin:
            child = subprocess.Popen(command, cwd=self.base, env=env, stdin=stdin, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        info.update(pid=child.pid, pid_started=_create_time(child.pid))
        _write_json(folder / "run.json", info)
        self.children[run_id] = child
        run = Run(folder)
        self.runs[run_id] = run
        return run

    def command(self, run: Run, command: str) -> None:
        if command == "kill":
            (run.folder / "killed").touch()
            pid = run.info.get("pid")
            if process_alive(pid, run.info.get("pid_started")):
                # the supervisor passes it on: the trainer saves a checkpoint after its step and exits, or is
                # SIGKILLed KILL_GRACE_S later (at once when kill is sent again): see Forwarder
                os.kill(pid, signal.SIGTERM)
            return
        send_command(run.output_dir, command)
        if command == "stop":
            (run.folder / "stop-requested").touch()


# --- the supervisor: `python -m difftune.ui.runs RUN_FOLDER CONFIG` --------------------------------


KILL_GRACE_S = 10.0  # after "kill": the time the trainer has to finish its step and save, before SIGKILL


class Forwarder:
    """The supervisor's SIGTERM and SIGINT handler: passes the signal on to the trainer, which then finishes its
    optimizer step, saves an "interrupted" checkpoint and exits (train/run_lock.py). "Kill" must still end it
    promptly, whatever it is doing (a long step, a hang): a trainer still alive `grace_s` after the first
    signal, or at a second SIGTERM (kill pressed again), gets SIGKILL."""

    def __init__(self, child: subprocess.Popen, grace_s: float = KILL_GRACE_S):
        self.child = child
        self.grace_s = grace_s
        self.deadline: float | None = None

    def __call__(self, signum: int, _frame: object = None) -> None:
        if signum == signal.SIGTERM and self.deadline is not None:
            self.child.kill()
            return
        self.child.send_signal(signum)
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s

    def wait(self) -> int:
        """The trainer's exit status, once it has ended (SIGKILLed when past the deadline)."""
        while True:
            try:
                return self.child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    self.child.kill()


def supervise(folder: Path, config_path: str) -> int:
    """Run the trainer, its output into log.txt; record its exit status in exit.json."""
    command = [sys.executable, "-m", "difftune.cli", "train", "--config", config_path]
    with open(folder / "log.txt", "ab") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        forward = Forwarder(child)
        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        code = forward.wait()
    try:  # where this run's events end: later runs into the same output_dir append theirs (Run.read_events)
        output_dir = Path(json.loads((folder / "run.json").read_text())["output_dir"])
        events_end: int | None = (output_dir / "events.jsonl").stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        events_end = None
    _write_json(folder / "exit.json", {"returncode": code, "time": time.time(), "pid": child.pid,
                                       "events_end": events_end})
    return 0


if __name__ == "__main__":
    sys.exit(supervise(Path(sys.argv[1]), sys.argv[2]))
