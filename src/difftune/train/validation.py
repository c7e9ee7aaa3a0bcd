"""Validation samples through the family's stock diffusers pipeline, with the adapter as it is now."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from difftune.train.setup import Run


def validate(run: Run, label: str) -> list[Path]:
    if not run.validation:
        return []
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
            image = run.family.sample(run.comps, model, request)
            name = f"-{request.name}" if request.name else ""
            path = out_dir / f"{label}{name}-{request.width}x{request.height}.png"
            image.save(path)
            paths.append(path)
            run.events.emit("sample", step=run.state.step, path=str(path), prompt=request.name or "validation")
    finally:
        model.train()
        vae.to("cpu")
    return paths
