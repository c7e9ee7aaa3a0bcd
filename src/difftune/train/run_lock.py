"""What guards a command-line run from the outside world: SIGTERM, Ctrl-C and a second run into the same output_dir.

SIGTERM (`kill`, `timeout`, `docker stop`, Slurm or Kubernetes preemption, the web UI's "kill") stops a run the
way Ctrl-C does: `Terminated` is a KeyboardInterrupt, so every place that saves an "interrupted" checkpoint and
logs a `stopped` event on Ctrl-C does so on SIGTERM too. Only the command line installs the handler
(`sigterm_stops`); a program that calls `build_run`/`train` itself keeps its own signal handling.

A SIGTERM, or a Ctrl-C on the command line, that arrives during an optimizer step waits for the step to end
(`held`): in the middle of one the sampler position and the noise generator have moved on while the weights have
not, and a checkpoint saved there would resume with other batches and noise than the uninterrupted run. A second
one (REPEAT_S or more later) stops at once. Several processes (torchrun passes SIGTERM on to every worker) hold it
through the whole loop until the exchange after each step (`loop.handle_commands`): each says whether it got one,
and all stop after the same step, where the checkpoint's collectives meet; sampling that process 0 does alone
meanwhile (validation, CLIP evaluation) looks at `is_held` and stops at the next transformer call.

The lock (`output_dir_lock`) is an flock on `output_dir/.difftune.lock`, which holds the pid of the run that took
it. The kernel releases it when that process ends in any way (SIGKILL and the out-of-memory killer included), so a
lock file left behind is simply taken over; the file itself stays (removing it would let a run that opened it a
moment earlier lock a file no longer in the folder while a third locks the new one).
"""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".difftune.lock"
# A run that has just logged its end may still be closing its trackers and webhooks (the web UI then already
# offers to start the next run in that folder): it gets this long to let go before the new run gives up.
LOCK_WAIT_S = 2.0


class NotWritable(Exception):
    """output_dir (or a folder a run writes in it) refuses a new file: the command line prints it as `error: ...`."""


def check_writable(output_dir: Path) -> None:
    """Before any model loads: output_dir, its checkpoints/ and validation/ (those that exist; else the folder that
    would hold output_dir) take a new file, tried by making and removing one (permission bits say nothing of a
    read-only mount or of root). Otherwise the run died at its first checkpoint, losing the steps before it."""
    output_dir = Path(output_dir)
    for folder in (output_dir, output_dir / "checkpoints", output_dir / "validation"):
        if folder.exists() and not folder.is_dir():  # a stray file where a run makes its folder
            raise NotWritable(f"output_dir: {folder} is a file, where the run writes a folder: move it away, or "
                              "choose another output_dir")
    folders = [f for f in (output_dir, output_dir / "checkpoints", output_dir / "validation") if f.is_dir()]
    if not folders:
        folders = [p for p in output_dir.parents if p.is_dir()][:1]
    for folder in folders:
        try:
            fd, name = tempfile.mkstemp(prefix=".difftune-write-test-", dir=folder)
            os.close(fd)
            os.unlink(name)
        except OSError as e:
            raise NotWritable(f"output_dir: cannot write in {folder} ({e.strerror or e}); make it writable, or "
                              "choose another output_dir") from e
    for name in ("events.jsonl", LOCK_FILE):  # left by an earlier run as another user (sudo difftune train)
        if (output_dir / name).is_file():
            try:
                open(output_dir / name, "a").close()  # noqa: SIM115 - opened to be closed at once
            except OSError as e:
                raise NotWritable(f"output_dir: cannot write {output_dir / name} ({e.strerror or e}); give it "
                                  "to this user (an earlier run as another user left it), or choose another "
                                  "output_dir") from e


class Terminated(KeyboardInterrupt):
    """A run stopped by a signal: SIGTERM, or Ctrl-C's SIGINT while `sigterm_stops` handles it."""

    def __init__(self, signum: int, reason: str | None = None):
        self.signum = signum
        self.reason = reason or ("interrupted" if signum == signal.SIGINT else
                                 f"terminated by {signal.Signals(signum).name}")
        super().__init__(self.reason)


def stops_on_sigterm() -> bool:
    """Whether SIGTERM stops this process the kept way (inside `sigterm_stops`: caches and checkpoints kept)."""
    return signal.getsignal(signal.SIGTERM) is _on_sigterm


def request_stop(reason: str) -> None:
    """From any thread: stop as SIGTERM does (`sigterm_stops` must be in force), the stop said as `reason`."""
    global _reason
    _reason = reason
    os.kill(os.getpid(), signal.SIGTERM)


def stop_reason(error: KeyboardInterrupt) -> str:
    """What the `stopped` event and the interrupted checkpoint say about how the run was stopped."""
    return error.reason if isinstance(error, Terminated) else "interrupted"


# The handler's state. Python runs signal handlers in the main thread, which is also the one that trains.
_depth = 0  # of `held` blocks
_pending: int | None = None  # a SIGTERM that arrived inside one
_last: float | None = None  # when (time.monotonic) the last SIGTERM acted on arrived
_reason: str | None = None  # what the next Terminated says (request_stop), else the signal's name
# A SIGTERM within this many seconds of the last one is the same request delivered again, not a second one: a
# group kill (timeout, Slurm's scancel, `kill -- -PGID`) reaches each torchrun worker directly and once more through
# torchrun's forwarding. Raised, it would stop one process mid-step while the others wait in a collective, or cut
# short the interrupted checkpoint the first one started.
REPEAT_S = 3.0


def _on_sigterm(signum: int, _frame: object) -> None:
    global _pending, _last, _reason
    reason, _reason = _reason, None  # request_stop's, for this signal only (a held or repeated one says the signal)
    now = time.monotonic()
    if _last is not None and now - _last < REPEAT_S:
        return
    _last = now
    if _depth and _pending is None:
        _pending = signum
        print("stopping after the step in progress, with a checkpoint (again, 3 s or more from now: at once)",
              file=sys.stderr, flush=True)
        return
    _pending = None
    raise Terminated(signum, reason)


@contextmanager
def sigterm_stops() -> Iterator[None]:
    """The command line's `train` and `cache`: SIGTERM, and Ctrl-C's SIGINT where Python's own handler has it, raise
    `Terminated` (a KeyboardInterrupt) while inside, held to the end of a `held` block like SIGTERM: Ctrl-C in the
    middle of a step saved the step before with the data position (and noise) of the step it cut, so the resume
    skipped a batch. The handlers that were there before are put back afterwards."""
    global _pending, _last
    _pending, _last = None, None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    ctrl_c = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous_int = signal.signal(signal.SIGINT, _on_sigterm) if ctrl_c else None
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if ctrl_c:
            signal.signal(signal.SIGINT, previous_int)


@contextmanager
def held(on: bool = True) -> Iterator[None]:
    """Inside (with `on`), a first SIGTERM is held rather than raised in the middle of the work: it is raised when
    the outermost `held` block ends (also when the block is left by `continue`), or taken earlier with `take_held`.
    A second one (REPEAT_S or more after the first) is raised at once. Without `sigterm_stops` installed it changes
    nothing."""
    global _depth, _pending
    if not on:
        yield
        return
    _depth += 1
    signum = None
    try:
        yield
    finally:
        _depth -= 1
        if not _depth:
            signum, _pending = _pending, None  # an exception from the block goes on instead
    if signum is not None:
        raise Terminated(signum)


def is_held() -> bool:
    """Whether a SIGTERM is held now (for work that can be abandoned early: validation's sampling)."""
    return _pending is not None


def take_held() -> int | None:
    """The SIGTERM held so far (its number), if any; it is then no longer held."""
    global _pending
    signum, _pending = _pending, None
    return signum


class OutputDirInUse(RuntimeError):
    """Another live run holds the output_dir's lock."""


def _holder(fd: int) -> str:
    """The pid written in the lock file, as text for the message."""
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "a process that has not written its pid yet"


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def in_use(output_dir: Path) -> str | None:
    """Who holds output_dir's lock ('pid 123'), or None when no run does (the web UI asks before it starts one)."""
    try:
        fd = os.open(Path(output_dir) / LOCK_FILE, os.O_RDWR)
    except OSError:
        return None  # no lock file (or none readable): no run took it
    try:
        if _try_lock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        return _holder(fd)
    except OSError:
        return None  # a file system without locks: the trainer says so itself
    finally:
        os.close(fd)


@contextmanager
def output_dir_lock(output_dir: Path, main: bool | None = None, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold output_dir's lock while inside, or fail (within `wait_s`) with `OutputDirInUse` naming the folder and
    the other run's pid. Only process 0 of a multi-process run locks (the processes share the folder): `main`, or
    unset, the process whose RANK (set by torchrun and accelerate launch, before any model or accelerator exists)
    is 0."""
    if main is None:
        main = os.environ.get("RANK", "0") == "0"
    if not main:
        yield
        return
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(output_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    registered = False  # in _held (retake_if_lost may swap the fd there for a new lock file's)
    try:
        deadline = time.monotonic() + wait_s
        try:
            while not _try_lock(fd):
                if time.monotonic() >= deadline:
                    raise OutputDirInUse(
                        f"output_dir {output_dir.resolve()} is in use by another training run ({_holder(fd)}); wait "
                        "for it to end or stop it, or choose another output_dir")
                time.sleep(0.1)
        except OSError as e:  # a file system without locks (some network mounts): train, but say so
            print(f"note: output_dir {output_dir} cannot be locked ({e.strerror}); a second run into it would not "
                  "be refused", file=sys.stderr)
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[output_dir], registered = fd, True
        yield
    finally:
        os.close(_held.pop(output_dir, fd) if registered else fd)  # releases the lock


_held: dict[Path, int] = {}  # output_dir -> the fd of the lock this process holds there


def retake_if_lost() -> str | None:
    """The lock file of a held output_dir deleted (the folder removed while training): lock a new one, so that a
    second run into the folder is refused again. Returns what happened, for the warning (None: nothing was lost)."""
    for output_dir, fd in list(_held.items()):
        if os.fstat(fd).st_nlink:
            continue
        output_dir.mkdir(parents=True, exist_ok=True)
        new = os.open(output_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_lock(new):
            holder = _holder(new)
            os.close(new)
            return f"another run has locked {output_dir} meanwhile ({holder}): both now write there"
        os.ftruncate(new, 0)
        os.pwrite(new, f"{os.getpid()}\n".encode(), 0)
        os.close(fd)
        _held[output_dir] = new
        return f"its lock ({LOCK_FILE}) is taken again"
    return None
