"""Webhooks (`webhook_config`, `webhook_reporting_interval`), driven by the event stream like the hub uploads
(train/hub.py) and the user scripts (train/scripts.py).

A `WebhookNotifier` subscribes to the run's events on process 0 and turns them into messages: the start, a progress
event every webhook_reporting_interval steps ('raw' webhooks only, as SimpleTuner), each validation's samples (one
message per validation; Discord: the files attached, at most 10 a message; raw: JSON with the paths and the PNGs as
base64), checkpoints, warnings, errors and the end. It is attached as soon as the run's event log exists
(setup.build_run), so a run that fails before its first step (discovery, loading the model, caching) sends that error
too (`events.failures_reported`); setup's warnings are not sent. Each webhook has its own background thread and
bounded queue, so training never waits on the network and one slow endpoint never delays another: a full queue
drops the message, a failed POST is retried (`ATTEMPTS`, growing pauses; an HTTP 429's retry_after is honoured),
and what fails in the end is a "warning" event, at most one a minute per webhook. When the run ends, or fails
(`Events.close`), the queues are flushed for at most `FINAL_WAIT_S` seconds. The URLs are secrets: messages name a webhook by `Webhook.masked`.

Sent with urllib (no new dependency): raw webhooks get `application/json`, Discord `multipart/form-data` with a
`content` field and the files as file0, file1, ... (SimpleTuner's request).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import ssl
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.client import HTTPException
from pathlib import Path
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

from difftune.config.webhook_keys import Webhook

QUEUE_SIZE = 64  # messages waiting per webhook; more are dropped (with a warning)
TIMEOUT_S = 10.0  # one POST
ATTEMPTS = 4
BACKOFF_S = 2.0  # pause before retry n: BACKOFF_S * 2**(n-1)
MAX_RETRY_AFTER_S = 60.0  # a 429's retry_after beyond this is cut to it
FINAL_WAIT_S = 30.0  # the end of the run waits this long, at most, for unsent messages
WARN_EVERY_S = 60.0  # at most one warning per webhook in this time; the others are counted
MAX_ATTACHMENTS = 10  # Discord's limit per message
MAX_FILE_BYTES = 8 * 2**20  # Discord's smallest upload limit; larger samples are named, not attached
MAX_TEXT = 2000  # Discord's message length
SOURCE = "webhooks"  # marks this module's own warnings, which are never sent (a failing endpoint would loop)


@dataclass
class Message:
    level: str  # 'critical', 'error', 'warning', 'info'
    text: str  # the Discord message, without its prefix
    payload: dict[str, Any]  # the raw webhook's JSON
    files: list[Path] = field(default_factory=list)  # Discord attachments
    raw_only: bool = False  # progress: not for Discord


class Sender:
    """One webhook's queue and thread."""

    def __init__(self, hook: Webhook, notifier: WebhookNotifier):
        self.hook, self.notifier = hook, notifier
        self.jobs: queue.Queue = queue.Queue(QUEUE_SIZE)
        self.stop = threading.Event()  # set when the final wait is over: remaining messages are given up
        self.context = ssl._create_unverified_context() if hook.ssl_no_verify else None  # noqa: S323 - asked for
        self.last_warning = -float("inf")
        self.suppressed = 0
        self.thread = threading.Thread(target=self._work, name=f"difftune-webhook-{hook.kind}", daemon=True)
        self.thread.start()

    def offer(self, message: Message) -> None:
        try:
            self.jobs.put_nowait(message)
        except queue.Full:
            self.warn(f"its queue is full ({QUEUE_SIZE} messages: the endpoint is slower than the run), a message "
                      "was dropped")

    def _work(self) -> None:
        while (message := self.jobs.get()) is not None:
            if not self.stop.is_set():
                self._deliver(message)
        # the None of close(): nothing follows

    def _deliver(self, message: Message) -> None:
        error = ""
        for attempt in range(1, ATTEMPTS + 1):
            wait = BACKOFF_S * 2 ** (attempt - 1)
            try:
                with urlopen(self._request(message), timeout=TIMEOUT_S, context=self.context) as answer:
                    answer.read()
                return
            except HTTPError as e:
                error = f"HTTP {e.code} {e.reason}"
                if e.code == 429:
                    wait = retry_after(e)
                elif e.code < 500:  # the endpoint refuses this message: sending it again would not help
                    break
            except (URLError, OSError, ValueError, HTTPException) as e:  # refused, unreachable, timed out, TLS
                error = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt < ATTEMPTS and self.stop.wait(wait):
                break
        self.warn(f"a message could not be sent ({error})")

    def _request(self, message: Message) -> Request:
        headers = {"User-Agent": "difftune"}
        if self.hook.kind == "raw":
            body = json.dumps(message.payload, default=str).encode()
            headers["Content-Type"] = "application/json"
        else:
            prefix = self.hook.message_prefix if self.hook.message_prefix is not None else self.notifier.project
            body, headers["Content-Type"] = multipart(clip(f"`({prefix})` {message.text}"), message.files)
        return Request(self.hook.url, data=body, headers=headers, method="POST")

    def warn(self, text: str) -> None:
        """A warning event, at most one per WARN_EVERY_S; the ones held back are counted into the next."""
        now = time.monotonic()
        if now - self.last_warning < WARN_EVERY_S:
            self.suppressed += 1
            return
        more = f" ({self.suppressed} more webhook problems were not reported)" if self.suppressed else ""
        self.last_warning, self.suppressed = now, 0
        self.notifier.events.emit("warning", source=SOURCE, message=f"webhook {self.hook.kind} "
                                  f"{self.hook.masked}: {text}; training went on{more}")


def retry_after(e: HTTPError) -> float:
    """Seconds a 429 asks to wait: Discord's JSON retry_after, or the Retry-After header; capped."""
    seconds = 1.0
    try:
        seconds = float(json.loads(e.read() or b"{}").get("retry_after", seconds))
    except (ValueError, AttributeError, OSError):
        pass
    try:
        seconds = max(seconds, float(e.headers.get("Retry-After", 0)))
    except (TypeError, ValueError):
        pass
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def multipart(content: str, files: list[Path]) -> tuple[bytes, str]:
    """A multipart/form-data body with the text field `content` and each file as file0, file1, ..."""
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="content"\r\n\r\n'.encode() + content.encode()]
    for index, path in enumerate(files):
        kind = "video/mp4" if path.suffix == ".mp4" else "image/png"
        head = (f'--{boundary}\r\nContent-Disposition: form-data; name="file{index}"; filename="{path.name}"\r\n'
                f"Content-Type: {kind}\r\n\r\n")
        parts.append(head.encode() + path.read_bytes())
    return b"\r\n".join(parts) + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 1] + "…"


def png_base64(path: Path) -> str | None:
    try:
        return base64.b64encode(path.read_bytes()).decode() if path.suffix == ".png" else None
    except OSError:
        return None


class WebhookNotifier:
    name = "webhooks"

    def __init__(self, cfg: Any, events: Any, hooks: list[Webhook]):
        self.cfg, self.events = cfg, events
        self.project = self.cfg.tracker_project_name or "difftune"
        # SimpleTuner's job id (SIMPLETUNER_JOB_ID), else the run's name
        self.job_id = os.environ.get("SIMPLETUNER_JOB_ID") or self.cfg.tracker_run_name
        self.senders = [Sender(hook, self) for hook in hooks]
        self.lock = threading.RLock()  # events arrive from the loop and from upload threads
        self.samples: list[dict[str, Any]] = []  # the validation being collected
        self.loss: float | None = None
        self.total = 0
        self.last: tuple[int, float] | None = None  # (step, elapsed) of the previous progress event
        self.started = False  # before the "start" event (loading, caching) only a failure is sent

    def __call__(self, kind: str, record: dict[str, Any]) -> None:
        if record.get("source") == SOURCE:
            return
        with self.lock:
            if self.samples and (kind != "sample" or record.get("step") != self.samples[0].get("step")):
                self._send(self._validation())
            if kind == "sample":
                self.samples.append(record)
            elif (message := self._message(kind, record)) is not None:
                self._send(message)

    def _send(self, message: Message) -> None:
        for sender in self.senders:
            if sender.hook.wants(message.level) and not (message.raw_only and sender.hook.kind != "raw"):
                if sender.hook.kind == "discord" and len(message.files) > MAX_ATTACHMENTS:
                    for start in range(0, len(message.files), MAX_ATTACHMENTS):
                        sender.offer(Message(message.level, message.text, message.payload,
                                             message.files[start:start + MAX_ATTACHMENTS]))
                else:
                    sender.offer(message)

    def _payload(self, kind: str, level: str, title: str, text: str, step: Any, **extra: Any) -> dict[str, Any]:
        """SimpleTuner's structured event fields (type, severity, title, message, job_id, timestamp)."""
        return {"type": kind, "severity": level, "title": title, "message": text, "job_id": self.job_id,
                "project": self.project, "step": step, "timestamp": datetime.now(tz=timezone.utc).isoformat(),
                **extra}

    def _message(self, kind: str, record: dict[str, Any]) -> Message | None:
        step = record.get("step")
        if not self.started and kind not in ("start", "error", "stopped"):
            return None  # setup's warnings (a skipped file each) are in the log and the data report
        if kind == "start":
            self.started = True
            self.total = record.get("total_steps", 0)
            self.last = (step or 0, 0.0)
            text = (f"Training resumed at step {step} of {self.total}" if step else
                    f"Training started: {self.total} steps")
            return Message("info", text, self._payload("training.status", "info", "Training started", text, step,
                                                       data={"status": "started", "total_steps": self.total}))
        if kind == "step":
            self.loss = record["loss"]
            interval = self.cfg.webhook_reporting_interval
            if not interval or step % interval:
                return None
            return self._progress(record)
        if kind == "checkpoint":
            final = step == self.total and not record.get("rolling")
            text = f"Checkpoint saved at step {step}{self._loss()}: {record['path']}"
            return Message("info", text, self._payload(
                "training.checkpoint", "info", "Checkpoint saved", text, step,
                checkpoint={"path": record["path"], "label": Path(record["path"]).name, "is_final": final,
                            "rolling": bool(record.get("rolling")), "reason": record.get("reason")}))
        if kind == "warning":
            return Message("warning", f"Warning: {record['message']}", self._payload(
                "notification", "warning", "Warning", record["message"], step))
        if kind == "error":
            when = "before its first step" if record.get("stage") == "setup" else f"at step {step}"
            text = f"Training failed {when}: {record['message']}"
            return Message("error", text, self._payload("error", "error", "Training failed", text, step,
                                                        data={"traceback": (record.get("traceback") or "")[-4000:]}))
        if kind in ("done", "stopped"):
            if kind == "done":
                text = f"Training finished at step {step}{self._loss()}; the result is in {record.get('adapter')}"
            else:
                text = f"Training stopped at step {step} ({record.get('reason', 'stopped')})"
            status = "completed" if kind == "done" else "stopped"
            level = "warning" if record.get("reason") == "interrupted" else "info"
            return Message(level, text, self._payload("training.status", level, f"Training {status}", text, step,
                                                      data={"status": status, "result": record.get("adapter")}))
        return None

    def _loss(self) -> str:
        return f" (loss {self.loss:.4f})" if self.loss is not None else ""

    def _progress(self, record: dict[str, Any]) -> Message:
        step, elapsed = record["step"], record.get("elapsed", 0.0)
        metrics = {"loss": record["loss"], "learning_rate": record["lr"]}
        if self.last is not None and step > self.last[0] and elapsed > self.last[1]:
            metrics["steps_per_s"] = (step - self.last[0]) / (elapsed - self.last[1])
        self.last = (step, elapsed)
        metrics |= {k: record[k] for k in ("tokens_per_s", "mfu", "tflops") if k in record}  # train/throughput.py
        percent = 100.0 * step / self.total if self.total else None
        eta = ((self.total - step) / metrics["steps_per_s"]) if "steps_per_s" in metrics else None
        text = f"Step {step} of {self.total}: loss {record['loss']:.4f}, lr {record['lr']:.3g}"
        return Message("info", text, self._payload(
            "training.progress", "info", "Training progress", text, step,
            progress={"label": "training", "current": step, "total": self.total, "percent": percent,
                      "eta_seconds": eta, "metrics": metrics}), raw_only=True)

    def _validation(self) -> Message:
        samples, self.samples = self.samples, []
        step = samples[0].get("step")
        files = [Path(s["path"]) for s in samples]
        large = [p.name for p in files if not p.is_file() or p.stat().st_size > MAX_FILE_BYTES]
        prompts = list(dict.fromkeys(s.get("prompt", "") for s in samples))
        text = (f"Validation at step {step}{self._loss()}: " + ", ".join(prompts)
                + (f" (not attached, too large: {', '.join(large)})" if large else ""))
        assets = [{"path": s["path"], "kind": "video" if s["path"].endswith(".mp4") else "image",
                   "prompt": s.get("prompt"), "ema": s.get("ema", False), "seed": s.get("seed")} for s in samples]
        images = [b for p in files if p.name not in large and (b := png_base64(p)) is not None]
        return Message("info", text, self._payload("training.validation", "info", "Validation", text, step,
                                                   validation={"prompts": prompts, "assets": assets},
                                                   images=images),
                       files=[p for p in files if p.name not in large])

    def close(self) -> None:
        """Send the validation still collected, then wait for the queues (at most FINAL_WAIT_S in all)."""
        with self.lock:
            if self.samples:
                self._send(self._validation())
        deadline = time.monotonic() + FINAL_WAIT_S
        for sender in self.senders:
            try:
                sender.jobs.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                pass
        for sender in self.senders:
            sender.thread.join(max(0.0, deadline - time.monotonic()))
        for sender in self.senders:
            if sender.thread.is_alive():
                sender.stop.set()  # its thread gives the rest up (it is a daemon: the process does not wait)
                sender.last_warning = -float("inf")
                sender.warn(f"messages were still unsent after {FINAL_WAIT_S:g} s; the run ends without them")
            elif sender.suppressed:
                self.events.emit("warning", source=SOURCE, message=f"webhook {sender.hook.kind} "
                                 f"{sender.hook.masked}: {sender.suppressed} more webhook problems were not reported")


def attach(cfg: Any, events: Any, main: bool) -> None:
    """Subscribe the notifier to the run's events (process 0, webhook_config set). The first subscriber, attached
    as soon as the event log exists (setup.build_run), so a failure while loading or caching is sent too, and
    closed last (subscribers close last-attached first), so the trackers', scripts' and uploads' last warnings
    reach it."""
    if main and cfg.webhook_config:
        events.subscribers.append(WebhookNotifier(cfg, events, cfg.webhooks()))
