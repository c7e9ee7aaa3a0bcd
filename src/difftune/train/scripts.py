"""User commands run after a checkpoint or an upload (`post_checkpoint_script`, `post_upload_script`), driven by the
event stream like the hub uploads (train/hub.py).

A `ScriptRunner` subscribes to the run's events on process 0: a "checkpoint" event (regular, rolling, manual,
interrupted or final) starts post_checkpoint_script; a "hub_upload" event starts post_upload_script with the
uploaded folder's hub URL, and without push_to_hub the end of the run ("done" or "stopped") starts it once for the
saved result. Each command is split like a shell line (shlex), then SimpleTuner's placeholders are filled in each
argument (config/extra_output_keys.py checks them at load time), and it runs in the background without a shell, its
output captured. A command that cannot start or exits non-zero is a "warning" event with the end of its output;
training goes on. When the run ends (`Events.close`), running commands are waited for, at most `FINAL_WAIT_S`.
"""

from __future__ import annotations

import shlex
import subprocess
import threading
import time
from typing import Any

FINAL_WAIT_S = 1800.0
TAIL_CHARS = 2000  # of a failed command's output, in its warning


def values(cfg: Any, step: Any, local: str = "", remote: str = "") -> dict[str, Any]:
    """Every placeholder's value (SimpleTuner's set and the validation_* keys); unset ones are empty."""
    out = {key: ("" if getattr(cfg, key) is None else getattr(cfg, key))
           for key in type(cfg).model_fields if key.startswith("validation_")}
    return out | {
        "local_checkpoint_path": local, "global_step": step, "remote_checkpoint_path": remote,
        "tracker_run_name": cfg.tracker_run_name or "", "tracker_project_name": cfg.tracker_project_name or "",
        "model_family": cfg.model_family, "model_type": cfg.model_type, "lora_type": cfg.lora_type,
        "huggingface_path": cfg.hub_model_id or "",
    }


def command(template: str, filled: dict[str, Any]) -> list[str]:
    """The argument list: `template` split like a shell line, then each word's placeholders filled (a value with
    spaces stays one argument; SimpleTuner fills the line first, then splits it)."""
    return [word.format_map(filled) for word in shlex.split(template)]


class ScriptRunner:
    name = "post scripts"

    def __init__(self, run: Any):
        self.run = run
        self.cfg = run.cfg
        self.threads: list[threading.Thread] = []

    def __call__(self, kind: str, record: dict[str, Any]) -> None:
        cfg = self.cfg
        if kind == "checkpoint" and cfg.post_checkpoint_script:
            self.start("post_checkpoint_script", values(cfg, record["step"], local=record["path"]))
        elif kind == "hub_upload" and cfg.post_upload_script:
            self.start("post_upload_script", values(cfg, record.get("step"), local=record.get("local", ""),
                                                    remote=record.get("remote", "")))
        elif kind in ("done", "stopped") and cfg.post_upload_script and not cfg.push_to_hub and record.get("adapter"):
            self.start("post_upload_script", values(cfg, record.get("step"), local=str(self.run.output_dir)))

    def start(self, key: str, filled: dict[str, Any]) -> None:
        emit = self.run.events.emit
        try:
            argv = command(getattr(self.cfg, key), filled)
        except (ValueError, TypeError, KeyError, IndexError) as e:  # a format spec the value does not take
            emit("warning", message=f"{key}: its placeholders could not be filled ({type(e).__name__}: {e}); "
                                    "training went on")
            return
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, errors="replace")
        except OSError as e:
            emit("warning", message=f"{key} could not start ({type(e).__name__}: {e}): {shlex.join(argv)}; training "
                                    "went on")
            return
        emit("script", quiet=True, key=key, argv=argv, pid=process.pid, step=filled["global_step"])
        thread = threading.Thread(target=self._wait, args=(key, argv, process), name=f"difftune-{key}", daemon=True)
        thread.start()
        self.threads.append(thread)

    def _wait(self, key: str, argv: list[str], process: subprocess.Popen) -> None:
        output, _ = process.communicate()
        emit = self.run.events.emit
        if process.returncode == 0:
            emit("info", quiet=True, message=f"{key} finished: {shlex.join(argv)}")
            return
        tail = output[-TAIL_CHARS:].strip()
        emit("warning", message=f"{key} exited with status {process.returncode}: {shlex.join(argv)}; training went "
                                "on" + (f". Its output ends: {tail}" if tail else ""))

    def close(self) -> None:
        """Wait for the commands still running (at most FINAL_WAIT_S in all)."""
        running = [t for t in self.threads if t.is_alive()]
        if running:
            self.run.events.write(f"waiting for {len(running)} post_checkpoint_script/post_upload_script command(s) "
                                  f"(at most {FINAL_WAIT_S:g} s; Ctrl-C abandons them)")
        deadline = time.monotonic() + FINAL_WAIT_S
        for thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in running):
            self.run.events.emit("warning", message=f"post_checkpoint_script/post_upload_script commands were still "
                                                    f"running after {FINAL_WAIT_S:g} s; the run ends without them "
                                                    "(they go on)")


def attach(run: Any) -> None:
    """Subscribe the runner to the run's events (process 0, a script set). Before the hub uploader: subscribers
    close last-attached first, so the uploads still waited for at the end reach this runner."""
    if run.ranks.main and (run.cfg.post_checkpoint_script or run.cfg.post_upload_script):
        run.events.subscribers.append(ScriptRunner(run))
