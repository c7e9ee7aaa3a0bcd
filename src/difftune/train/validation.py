"""Validation samples through the family's stock diffusers pipeline, with the adapter as it is now.
Images are written as PNG; videos as MP4 plus a PNG contact sheet to glance at."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftune.train import attention, evaluation
from difftune.train.model_offload import model_cpu_offload

if TYPE_CHECKING:
    from difftune.models.base import SampleRequest
    from difftune.train.setup import Run


def validate(run: Run, label: str) -> list[Path]:
    """Sample every validation request with the live weights and/or the EMA weights (ema_validation)."""
    if not run.validation:
        return []
    mode = run.cfg.ema_validation if run.ema is not None else "none"
    live = [] if mode == "ema_only" else _sample_all(run, label, "")
    ema = []
    if mode != "none":
        with run.ema.swap():
            ema = _sample_all(run, label, "-ema")
    # CLIP evaluation (eval_steps_interval 0) scores the live weights' samples, or the EMA's when only they exist
    evaluation.after_validation(run, [(request, out) for request, out, _ in live or ema])
    return [path for _, _, written in live + ema for path in written]


def sample_requests(run: Run, requests: list[SampleRequest]) -> list[tuple[SampleRequest, Any]]:
    """Sample `requests` with the live weights, writing nothing: (request, image or list of frames) pairs."""
    return [(request, out) for request, out, _ in _sample_all(run, None, "", requests)]


@contextmanager
def plain_forward(model: Any) -> Iterator[Any]:
    """The module as the stock pipeline would run it: its own forward, in its own dtype.

    Under mixed precision, accelerate replaces a prepared module's forward with one that autocasts and
    casts every output to fp32. A pipeline driving that wrapper hands fp32 latents to a bf16 VAE (a
    crash) and samples with other numerics than a user's `load_lora_weights` would. The wrapper is put
    back afterwards: training needs it. (`unwrap_model(keep_fp32_wrapper=False)` would strip it for good.)
    """
    wrapped, original = model.__dict__.get("forward"), model.__dict__.get("_original_forward")
    if wrapped is None or original is None:
        yield model
        return
    model.forward = original
    try:
        yield model
    finally:
        model.forward = wrapped


@contextmanager
def as_loaded(model: Any) -> Iterator[None]:
    """LoRA weights in the dtype a user's pipeline holds them while sampling, then back to fp32.

    Adapters train in fp32 on a bf16/fp16 base; `load_lora_weights` (peft) puts each LoRA layer in the
    dtype of the layer it adapts. Sampling with the same rounding makes the samples the user's samples.
    A full fine-tune is sampled as it trains (its saved folder loads in the same dtypes), and LyCORIS
    has no stock loader to imitate."""
    kept = []
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if base is None or not hasattr(module, "lora_A") or getattr(base, "weight", None) is None:
            continue
        # A bitsandbytes 4-bit layer stores packed uint8 weights: its compute dtype is the model's dtype.
        dtype = getattr(base, "compute_dtype", None) or base.weight.dtype
        for p in module.parameters():
            if p.requires_grad and p.dtype != dtype and dtype.is_floating_point:
                kept.append((p, p.data))
                p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, data in kept:
            p.data = data


Sampled = tuple["SampleRequest", Any, list[Path]]  # request, image or frames, files written


def _sample_all(run: Run, label: str | None, suffix: str, requests: list[SampleRequest] | None = None) -> list[Sampled]:
    model = run.accelerator.unwrap_model(run.transformer)
    device = run.accelerator.device
    vae = run.comps.vae
    offload = model_cpu_offload(run.cfg.enable_model_cpu_offload, model, vae, device)
    with plain_forward(model), as_loaded(model), offload, attention.sampling(model):  # sageattention: sampling only
        return _sample_requests(run, model, vae, label, suffix, run.validation if requests is None else requests)


def _sample_requests(run: Run, model: Any, vae: Any, label: str | None, suffix: str,
                     requests: list[SampleRequest]) -> list[Sampled]:
    """Sample each request; with a `label`, write its files (and "sample" events)."""
    model.eval()
    out_dir = run.output_dir / "validation"
    out_dir.mkdir(parents=True, exist_ok=True)
    done = []
    try:
        for request in requests:
            result = run.family.sample(run.comps, model, request)
            if label is None:
                done.append((request, result, []))
                continue
            name = f"-{request.name}" if request.name else ""
            size = f"{request.width}x{request.height}" + (f"@{request.frames}" if request.frames else "")
            path = out_dir / f"{label}{name}-{size}{suffix}.png"
            written = []
            frames = result
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
            done.append((request, frames, written))
            for item in written:
                run.events.emit("sample", step=run.state.step, path=str(item), prompt=request.name or "validation",
                                ema=bool(suffix), size=size)
    finally:
        model.train()
        if not run.data.encode:  # the VAE stays on the accelerator when it encodes on the fly
            vae.to("cpu")
    return done
