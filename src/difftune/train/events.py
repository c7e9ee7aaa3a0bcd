"""Progress out: a console progress bar and a JSONL event log in output_dir.

The trainer only calls `emit`; readers (the console, the web UI later, tests) consume the log. The
trainer never imports a UI.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

# The regularizers' figures a "step" event may carry (loop.optimizer_step: their mean over the step), with their
# label on the progress bar; trackers log them as train/<name>.
TERM_FIELDS = {"crepa_loss": "CREPA", "layersync_similarity": "sync"}


def finite(value: Any) -> Any:
    """`value` with NaN and infinities as null: the log is strict JSON (a loss that went NaN written as `NaN`
    broke JavaScript's JSON.parse, and the web server, which answers with strict JSON, could not send it on)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


class Events:
    def __init__(self, log_path: Path | None, total_steps: int = 0, console: bool = True):
        self.log_path = log_path
        self.console = console
        self.bar: tqdm | None = None
        self.total_steps = total_steps
        self._log = None
        self._log_failed = False
        self._start_line: str | None = None  # the "start" record, for a log begun again (_lost)
        self._checked = 0.0  # when (time.monotonic) the log file was last looked at
        # Subscribers see every event after it is logged (trackers, hub uploads: train/reporting.py). Each may
        # have a close(), called before the log closes. Uploads emit from their own thread, hence the lock.
        self.subscribers: list[Callable[[str, dict[str, Any]], None]] = []
        self._lock = threading.RLock()
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, kind: str, quiet: bool = False, **data: Any) -> None:
        """Log an event; `quiet` keeps it off the console (when a summary there already says it)."""
        record = {"event": kind, "time": time.time(), **data}
        with self._lock:
            if self.log_path is not None and not self._log_failed:
                try:
                    self._append(json.dumps(finite(record), default=str) + "\n")
                except OSError as e:  # a full disk: the log stops, the run (and its next checkpoint) goes on
                    self._log_failed = True
                    self.write(f"WARNING: cannot write {self.log_path} ({e.strerror or e}): the event log stops "
                               "here, training goes on")
        failed = []
        for subscriber in list(self.subscribers):
            try:
                subscriber(kind, record)
            except Exception as e:  # noqa: BLE001 - a tracker's failure must not stop training
                self.subscribers.remove(subscriber)
                failed.append(f"{getattr(subscriber, 'name', type(subscriber).__name__)} failed and is switched "
                              f"off: {type(e).__name__}: {e}")
        for message in failed:  # after every subscriber has seen this event
            self.emit("warning", message=message)
        if not self.console or quiet:
            return
        if kind == "step":
            shown = {"loss": f"{data['loss']:.4f}", "lr": f"{data['lr']:.2e}"}
            if "tokens_per_s" in data:  # train/throughput.py
                shown["tok/s"] = f"{data['tokens_per_s']:.4g}"
            if "mfu" in data:
                shown["MFU"] = f"{100 * data['mfu']:.1f}%"
            shown |= {label: f"{data[name]:.4f}" for name, label in TERM_FIELDS.items() if name in data}
            self._bar(data["step"]).set_postfix(shown, refresh=False)
            self.bar.update(data["step"] - self.bar.n)
        elif kind in ("info", "warning", "error", "eval_loss"):  # eval_loss: train/eval_loss.py
            self.write(("" if kind in ("info", "eval_loss") else kind.upper() + ": ") + data["message"])

    def _append(self, line: str) -> None:
        if line.startswith('{"event": "start"'):  # written again at the head of a log that was deleted
            self._start_line = line
        if self._log is not None and time.monotonic() >= self._checked + 1.0:  # one fstat a second at most
            self._checked = time.monotonic()
            try:
                deleted = os.fstat(self._log.fileno()).st_nlink == 0  # (the output folder, say)
            except (OSError, AttributeError, ValueError):  # a log without a file descriptor
                deleted = False
            if deleted:
                line = self._lost() + line
        if self._log is None:
            self._log = open(self.log_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            if self._log.tell() and not _ends_with_newline(self.log_path):  # a line an earlier run left cut
                self._log.write("\n")
        self._log.write(line)
        self._log.flush()  # readers (the web UI, a tail -f) see each event at once

    def _lost(self) -> str:
        """The lines a new log begins with after the old one was deleted: a warning, and the run's "start" again
        (the web UI counts a run's steps from its start)."""
        assert self._log is not None
        self._log.close()
        self._log = None
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        from difftune.train.run_lock import retake_if_lost

        relocked = retake_if_lost()  # the folder's lock file went with it: a second run would not be refused
        notice = {"event": "warning", "time": time.time(),
                  "message": f"{self.log_path} was deleted while this run trained (with its output folder?); the "
                             "log begins again here" + (f"; {relocked}" if relocked else "")}
        self.write(f"WARNING: {notice['message']}")
        return json.dumps(notice) + "\n" + (self._start_line or "")

    def _bar(self, step: int) -> tqdm:
        if self.bar is None:
            self.bar = tqdm(total=self.total_steps, initial=step - 1, desc="training", unit="step",
                            dynamic_ncols=True, file=sys.stderr)
        return self.bar

    def activity(self, text: str | None) -> None:
        """What the run does between steps (a validation sample: minutes for a video), on the progress bar in place
        of "training"; None puts "training" back. Console only: the samples' own events go to the log."""
        if self.console and self.bar is not None:
            self.bar.set_description_str(text or "training", refresh=True)

    def write(self, text: str) -> None:
        if not self.console:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        # Last attached, first closed: a closing subscriber may still emit (a final upload's warning), and the
        # ones attached before it (the trackers) still see that.
        while self.subscribers:
            subscriber = self.subscribers[-1]
            try:
                if hasattr(subscriber, "close"):
                    subscriber.close()
            except Exception as e:  # noqa: BLE001 - the run's result is already saved
                self.write(f"WARNING: {type(e).__name__} while closing {type(subscriber).__name__}: {e}")
            finally:
                if subscriber in self.subscribers:
                    self.subscribers.remove(subscriber)
        if self._log is not None:
            try:
                self._log.close()
            except OSError:  # its last write failed: said when it did
                pass
            self._log = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@contextmanager
def failures_reported(events: Events, stage: str) -> Iterator[None]:
    """Around the work before the training loop (setup.build_run; train/loop.py reports its own): an exception is
    logged as an "error" event (Ctrl-C: "stopped") with `stage`, and the events are closed, so the subscribers
    already attached (the webhooks) send it and flush their queues, bounded, before the process exits. Then the
    exception goes on up. The event stays off the console: the command line prints the error itself."""
    try:
        yield
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (run_lock.Terminated, which names its signal)
        events.emit("stopped", quiet=True, step=0, stage=stage, reason=getattr(e, "reason", "interrupted"))
        events.close()
        raise
    except BaseException as e:
        events.emit("error", quiet=True, step=0, stage=stage, message=f"{type(e).__name__}: {e}",
                    traceback=traceback.format_exc())
        events.close()
        raise
