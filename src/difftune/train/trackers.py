"""Experiment trackers (`report_to`): the event stream forwarded to accelerate's trackers.

`attach` subscribes a `TrackerForwarder` to the run's `Events` (process 0 only: the other processes'
event streams are silent), so the loop never calls a tracker. Every value is taken from an event the
loop already writes: "step" (loss, learning rate, step time), "memory" (peak memory by phase), "sample"
(validation images; videos as the MP4 where the tracker plays video, W&B, and as the contact sheet
image everywhere), "evaluation" (CLIP scores), "eval_loss" (the loss on eval datasets).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from difftune.config.reporting_keys import TRACKERS
from difftune.config.schema import TrainConfig
from difftune.config.webhook_keys import public_value
from difftune.train.events import TERM_FIELDS, Events


def log_with(cfg: TrainConfig) -> list[str] | None:
    """Accelerator(log_with=...) for `report_to`."""
    return list(TRACKERS[cfg.report_to]) or None


def tracker_folder(output_dir: Path, logging_dir: str | None = None) -> Path:
    """Accelerator(project_dir=...): TensorBoard writes under <this>/<tracker_project_name>."""
    return output_dir / (logging_dir or "tensorboard")


def flat_config(cfg: TrainConfig) -> dict[str, bool | int | float | str]:
    """The config as tracker hyperparameters: TensorBoard's hparams take only scalars and strings."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in cfg.model_dump(mode="json").items():
        if value is None:
            continue
        if key == "webhook_config":  # inline JSON holds the webhook URLs, which are secrets
            value = public_value(value)
        out[key] = value if isinstance(value, bool | int | float | str) else json.dumps(value)
    return out


def _tag(text: str) -> str:
    return re.sub(r"[^\w./-]+", "_", text)


class TrackerError(RuntimeError):
    """A tracker that cannot start (a W&B login missing): said in one line with the fix."""


class TrackerForwarder:
    """Forwards events to `accelerator.log` / each tracker's `log_images`. Values are logged at the step
    the run has reached (memory events before the first step at the resume step, or 0)."""

    name = "tracker forwarding"

    def __init__(self, cfg: TrainConfig, accelerator: Any, output_dir: Path):
        self.accelerator = accelerator
        self.step = 0
        self.last: tuple[int, float] | None = None  # (step, elapsed) of the previous step event
        try:
            accelerator.init_trackers(
                cfg.tracker_project_name or "difftune", config=flat_config(cfg),
                init_kwargs={"wandb": {"name": cfg.tracker_run_name, "dir": str(output_dir)}},
            )
        except Exception as e:
            if not type(e).__module__.startswith("wandb"):
                raise
            # before any model loads: no login, a bad key, no network to W&B
            raise TrackerError(f"report_to {cfg.report_to!r}: W&B did not start ({type(e).__name__}: {e}); log in "
                               "with `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to log here and "
                               "`wandb sync` later, or set report_to to 'tensorboard' or 'none'") from e

    def __call__(self, kind: str, record: dict[str, Any]) -> None:
        step = record.get("step")
        if isinstance(step, int):
            self.step = max(self.step, step)
        if kind == "start":
            self.last = (record.get("step", 0), 0.0)
        elif kind == "step":
            values = {"train/loss": record["loss"], "train/lr": record["lr"]}
            # train/throughput.py's figures, when the step has them (MFU only where the device's peak is known)
            values |= {f"train/{k}": record[k] for k in ("tflops", "tokens_per_s", "mfu", "peak_memory_gib",
                                                           *TERM_FIELDS) if k in record}
            if self.last is not None and record["step"] > self.last[0]:
                values["train/step_time_s"] = (record["elapsed"] - self.last[1]) / (record["step"] - self.last[0])
            self.last = (record["step"], record["elapsed"])
            self.accelerator.log(values, step=self.step)
        elif kind == "memory":
            phase = _tag(record.get("phase", "phase"))
            values = {f"memory/{phase}/{key.removesuffix('_bytes')}_gib": value / 2**30
                      for key, value in record.items() if key.endswith("_bytes") and isinstance(value, int | float)}
            if values:
                self.accelerator.log(values, step=self.step)
        elif kind == "evaluation":
            values = {f"eval/{record['metric']}": record["value"]}
            values |= {f"eval/{record['metric']}/{_tag(name)}": v for name, v in record.get("scores", {}).items()}
            self.accelerator.log(values, step=self.step)
        elif kind == "eval_loss":  # train/eval_loss.py: the pooled loss, and each eval dataset's unless pooled
            values = {"eval/loss": record["loss"]}
            values |= {f"eval/loss/{_tag(name)}": v for name, v in record.get("datasets", {}).items()}
            self.accelerator.log(values, step=self.step)
        elif kind == "sample":
            self._sample(record)

    def _sample(self, record: dict[str, Any]) -> None:
        path = Path(record["path"])
        image = f"/{record['image']}" if record.get("image") else ""  # num_validation_images: one tag per image
        # the main prompt's samples (named "validation") under validation/<size>; a library prompt's under its name
        prompt = record.get("prompt") or "validation"
        named = "" if prompt == "validation" else f"{prompt}/"
        tag = "validation/" + _tag(f"{named}{record.get('size', '')}{image}"
                                   + ("-ema" if record.get("ema") else "")).rstrip("/")
        for tracker in self.accelerator.trackers:
            if path.suffix == ".mp4":
                if tracker.name == "wandb":  # TensorBoard's add_video needs moviepy: it gets the contact sheet
                    import wandb

                    tracker.log({tag + "/video": wandb.Video(str(path), format="mp4")}, step=self.step)
                continue
            import numpy as np
            from PIL import Image

            with Image.open(path) as image:
                pixels = np.asarray(image.convert("RGB"))
            if tracker.name == "tensorboard":
                tracker.log_images({tag: pixels[None]}, step=self.step, dataformats="NHWC")
            else:
                tracker.log_images({tag: [pixels]}, step=self.step)

    def close(self) -> None:
        self.accelerator.end_training()


def attach(cfg: TrainConfig, accelerator: Any, events: Events, output_dir: Path, main: bool) -> None:
    """Subscribe the trackers of `report_to` to `events` (on process 0; nothing for 'none')."""
    if main and log_with(cfg):
        events.subscribers.append(TrackerForwarder(cfg, accelerator, output_dir))
