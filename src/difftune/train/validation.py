"""Validation samples through the family's stock diffusers pipeline, with the adapter as it is now.
Images are written as PNG; videos as MP4 plus a PNG contact sheet to glance at."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from difftune.train.setup import Run


def validate(run: Run, label: str) -> list[Path]:
    """Sample every validation request with the live weights and/or the EMA weights (ema_validation)."""
    if not run.validation:
        return []
    mode = run.cfg.ema_validation if run.ema is not None else "none"
    paths = [] if mode == "ema_only" else _sample_all(run, label, "")
    if mode != "none":
        with run.ema.swap():
            paths += _sample_all(run, label, "-ema")
    return paths


def _sample_all(run: Run, label: str, suffix: str) -> list[Path]:
    model = run.accelerator.unwrap_model(run.transformer)
    device = run.accelerator.device
    vae = run.comps.vae
    vae.to(device)
    model.eval()
    out_dir = run.output_dir / "validation"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    try:
        for request in run.validation:
            result = run.family.sample(run.comps, model, request)
            name = f"-{request.name}" if request.name else ""
            size = f"{request.width}x{request.height}" + (f"@{request.frames}" if request.frames else "")
            path = out_dir / f"{label}{name}-{size}{suffix}.png"
            written = []
            if isinstance(result, list):  # a video: the MP4, and its contact sheet under the .png name
                from difftune.data.video import contact_sheet, write_mp4

                video = path.with_suffix(".mp4")
                write_mp4(result, video, request.fps)  # atomic
                written.append(video)
                result = contact_sheet(result)
            partial = path.with_name(f".{path.name}.tmp")
            result.save(partial, format="PNG")
            os.replace(partial, path)  # a kill mid-write never leaves a truncated image under the real name
            written.append(path)
            paths += written
            for item in written:
                run.events.emit("sample", step=run.state.step, path=str(item), prompt=request.name or "validation",
                                ema=bool(suffix))
    finally:
        model.train()
        if not run.data.encode:  # the VAE stays on the accelerator when it encodes on the fly
            vae.to("cpu")
    return paths
