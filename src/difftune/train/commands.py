"""Commands in: a folder of small JSON files that anyone (the web UI, a script) may drop into
`output_dir/commands/`; the trainer polls it between steps, acts, and deletes each file.

Files rather than a socket: the trainer needs no server, and a command survives a UI restart. A command sent
before this trainer process started is dropped (it was meant for a run that died); one sent while it starts up
waits for its first step, but for "stop", which `stop_while` acts on during caching too.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import threading
import time
from pathlib import Path

COMMANDS = ("stop", "sample", "save")


def commands_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "commands"


def send_command(output_dir: Path, command: str) -> Path:
    """Queue a command for the run writing to `output_dir`. Written atomically (temp file + rename)."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}; use one of {', '.join(COMMANDS)}")
    folder = commands_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"command": command, "time": time.time()}, f)
    path = folder / f"{time.time_ns()}-{command}.json"
    os.replace(tmp, path)
    return path


@functools.cache
def _process_start() -> float:
    import psutil

    return psutil.Process().create_time()


def poll_commands(output_dir: Path, stale: list[str] | None = None) -> list[str]:
    """Pending commands, oldest first; each file is removed once read. Unreadable files are dropped, and so are
    commands sent before this process started (to a run that died before it read them: a stop would end the next
    run, its resume, at its first step); `stale` gets a line for each of those."""
    folder = commands_dir(output_dir)
    if not folder.is_dir():
        return []
    found = []
    started = _process_start()
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            command, sent = data.get("command"), float(data.get("time", started))
        except (OSError, ValueError, AttributeError, TypeError):
            command, sent = None, started
        path.unlink(missing_ok=True)
        if command in COMMANDS and sent < started:
            if stale is not None:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(sent))
                stale.append(f"ignored a {command!r} command sent at {when}, before this run started ({path.name})")
        elif command in COMMANDS:
            found.append(command)
    return found


@contextlib.contextmanager
def stop_while(output_dir: Path, what: str, interval: float = 0.5, on: bool = True):
    """While inside (caching, before the first step): a "stop" command stops the run at once, as SIGTERM does (the
    caches filled so far kept), where it waited for the first step before. Other commands wait for the loop. Only
    where SIGTERM stops the kept way (`difftune train` and `cache`); elsewhere nothing is watched."""
    from difftune.train.run_lock import request_stop, stops_on_sigterm

    if not (on and stops_on_sigterm()):
        yield
        return
    done = threading.Event()
    folder = commands_dir(output_dir)

    def watch() -> None:
        started = _process_start()
        while not done.wait(interval):
            for path in sorted(folder.glob("*-stop.json")) if folder.is_dir() else []:
                try:
                    sent = float(json.loads(path.read_text()).get("time", started))
                except (OSError, ValueError, AttributeError, TypeError):
                    continue
                if sent >= started and not done.is_set():  # a stale one is the loop's to report (poll_commands);
                    path.unlink(missing_ok=True)  # after `what`, the loop's own polling takes it
                    request_stop(f"stop command while {what}")
                    return

    thread = threading.Thread(target=watch, name="difftune-stop-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()

