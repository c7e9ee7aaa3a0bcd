"""Validation samples through the family's stock diffusers pipeline, with the adapter as it is now.
Images are written as PNG; videos as MP4 plus a PNG contact sheet to glance at.

Files go to output_dir/validation as `<label>[-<prompt name>]-<W>x<H>[@<frames>][-<i>of<n>][-ema].png`: the label
says when (`step-000100`, `final-step-000400`, `manual-step-…`, `base-model`), `-<i>of<n>` numbers the
`num_validation_images` samples of one prompt (seeds validation_seed, +1, …). `base-model` holds the base
model's samples, taken before the first step with the adapter switched off (`disable_benchmark: false`,
`validation_on_startup`); with `disable_benchmark: false` each later PNG also gets `<name>-vs-base.png`, the base
model's sample of the same prompt, size and seed on its left (SimpleTuner's stitched benchmark), and with
`validation_stitch_input_location` an image-to-image or image-to-video sample gets `<name>-with-input.png`, its input
image on that side. Those comparison files are written beside the samples only: trackers see the base samples as
step 0 of each tag.

`validation_randomize` gives each validation fresh random seeds (the same for its live and EMA samples; each
"sample" event says its seed) and writes no `-vs-base` comparisons; `validation_lycoris_strength` is a LyCORIS
network's multiplier while sampling the trained weights, put back for training afterwards.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from difftune.train import attention, evaluation
from difftune.train.model_offload import model_cpu_offload
from difftune.train.run_lock import is_held

if TYPE_CHECKING:
    from difftune.models.base import SampleRequest
    from difftune.train.setup import Run


BASE_LABEL = "base-model"  # the base model's samples, before the first step


def validate(run: Run, label: str, base: bool = False) -> list[Path]:
    """Sample every validation request with the live weights and/or the EMA weights (ema_validation); with
    `base`, the base model's samples (the adapter switched off; no EMA, which equals the live weights then)."""
    if not run.validation:
        return []
    mode = "none" if base else run.cfg.ema_validation if run.ema is not None else "none"
    requests = randomized(run.validation) if run.cfg.validation_randomize else run.validation
    live, ema = [], []
    if mode != "ema_only":
        with adapter_off(run) if base else lycoris_strength(run):
            live = _sample_all(run, label, "", requests)
    if mode != "none":
        with run.ema.swap(), lycoris_strength(run):
            ema = _sample_all(run, label, "-ema", requests)
    # CLIP evaluation (no schedule set) scores the live weights' samples, or the EMA's when only they exist; of
    # num_validation_images per prompt, the first (the request's own seed), so scores compare across settings
    first = {id(request) for request in requests}
    evaluation.after_validation(run, [(request, out) for request, out, _ in live or ema if id(request) in first],
                                reusable=bool(live) and not base and not run.cfg.validation_randomize)
    return [path for _, _, written in live + ema for path in written]


def randomized(requests: list[SampleRequest]) -> list[SampleRequest]:
    """validation_randomize: the requests with fresh seeds from the operating system (not the run's seeded
    generators, which would repeat them run after run); the "sample" events say each one."""
    return [replace(request, seed=secrets.randbits(31)) for request in requests]


@contextmanager
def lycoris_strength(run: Run) -> Iterator[None]:
    """validation_lycoris_strength: a LyCORIS network's multiplier while the trained weights sample, the training
    multiplier back afterwards (so training continues bit for bit). Nothing to do when unset or not LyCORIS."""
    network = getattr(run.adapter, "network", None)  # adapters/kinds.py LycorisAdapter
    strength = run.cfg.validation_lycoris_strength
    if network is None or strength is None:
        yield
        return
    multiplier = network.multiplier
    network.set_multiplier(strength)
    try:
        yield
    finally:
        network.set_multiplier(multiplier)


@contextmanager
def adapter_off(run: Run) -> Iterator[None]:
    """The base model, whatever the adapter holds (init_lora included): a peft LoRA is disabled
    (diffusers' `disable_adapters`), a LyCORIS network runs at multiplier 0 (its weight-decomposed variants add
    their initial difference, zero). A full fine-tune has nothing to switch off: before its first step its weights
    are the base model's, and later there is no base model left to sample."""
    network = getattr(run.adapter, "network", None)  # adapters/kinds.py LycorisAdapter
    model = run.accelerator.unwrap_model(run.transformer)
    if network is not None:
        multiplier = network.multiplier
        network.set_multiplier(0.0)
        try:
            yield
        finally:
            network.set_multiplier(multiplier)
    elif getattr(model, "_hf_peft_config_loaded", False):
        model.disable_adapters()
        try:
            yield
        finally:
            model.enable_adapters()
    elif run.state.step == 0:
        yield
    else:
        raise RuntimeError(f"a full fine-tune at step {run.state.step} has no base model left to sample")


def sample_requests(run: Run, requests: list[SampleRequest]) -> list[tuple[SampleRequest, Any]]:
    """Sample `requests` with the live weights, writing nothing: (request, image or list of frames) pairs."""
    with lycoris_strength(run):
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
def as_loaded(model: Any, network: Any = None) -> Iterator[None]:
    """LoRA weights in the dtype a user's pipeline holds them while sampling, then back to fp32.

    Adapters train in fp32 on a bf16/fp16 base; `load_lora_weights` (peft) puts each LoRA layer in the
    dtype of the layer it adapts. Sampling with the same rounding makes the samples the user's samples.
    A LyCORIS `network` goes to the base's dtype as `adapters.lycoris.load_lycoris` puts it: without
    autocast, its `full` and `glora` modules would multiply fp32 weights with bf16 activations (an error).
    A full fine-tune is sampled as it trains (its saved folder loads in the same dtypes)."""
    kept = []
    if network is not None:
        from difftune.adapters.lycoris import base_dtype

        dtype = base_dtype(model)
        for p in network.parameters():
            if p.dtype != dtype and p.is_floating_point():
                kept.append((p, p.data))
                p.data = p.data.to(dtype)
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


class SamplingAbandoned(Exception):
    """A held SIGTERM (several processes: the others wait while process 0 samples) stops the sampling at the next
    transformer call: finishing it could outlast torchrun's 30 s before SIGKILL, losing the interrupted checkpoint."""


def _abandon_when_stopping(_module: Any, _args: Any) -> None:
    if is_held():
        raise SamplingAbandoned


def _sample_all(run: Run, label: str | None, suffix: str, requests: list[SampleRequest] | None = None) -> list[Sampled]:
    model = run.accelerator.unwrap_model(run.transformer)
    device = run.accelerator.device
    vae = run.comps.vae
    offload = model_cpu_offload(run.cfg.enable_model_cpu_offload, model, vae, device)
    network = getattr(run.adapter, "network", None)  # LyCORIS
    stop = model.register_forward_pre_hook(_abandon_when_stopping)
    try:
        with plain_forward(model), as_loaded(model, network), offload, attention.sampling(model):  # sageattention: sampling only
            return _sample_requests(run, model, vae, label, suffix, run.validation if requests is None else requests)
    finally:
        stop.remove()


def sample_size(request: SampleRequest) -> str:
    return f"{request.width}x{request.height}" + (f"@{request.frames}" if request.frames else "")


def file_name(label: str, request: SampleRequest, suffix: str = "", index: int = 0, count: int = 1) -> str:
    """The PNG of one sample (see the module's docstring); `index` of `count` per prompt, zero-padded so that
    names sort in order."""
    name = f"-{request.name}" if request.name else ""
    image = f"-{index + 1:0{len(str(count))}d}of{count}" if count > 1 else ""
    return f"{label}{name}-{sample_size(request)}{image}{suffix}.png"


def _save_png(image: Any, path: Path) -> None:
    partial = path.with_name(f".{path.name}.tmp")
    image.save(partial, format="PNG")
    os.replace(partial, path)  # a kill mid-write never leaves a truncated image under the real name


def side_by_side(left: Any, right: Any) -> Any:
    """Two images side by side, top-aligned on a white canvas as tall as the taller."""
    from PIL import Image

    left, right = left.convert("RGB"), right.convert("RGB")
    both = Image.new("RGB", (left.width + right.width, max(left.height, right.height)), "white")
    both.paste(left, (0, 0))
    both.paste(right, (left.width, 0))
    return both


def _with_base(base: Path, image: Any) -> Any:
    """The base model's sample (a PNG file) left of `image`."""
    from PIL import Image

    with Image.open(base) as left:
        return side_by_side(left, image)


def with_input(request: SampleRequest, image: Any, side: str) -> Any:
    """The request's input image, scaled to the sample's height (its own aspect kept: what the user gave), on the `side`
    of `image` (a sample, or a video's contact sheet, whose first row then starts or ends with the input its first
    frame was made from)."""
    given = request.image
    if given.height != request.height:
        given = given.resize((max(1, round(given.width * request.height / given.height)), request.height))
    return side_by_side(given, image) if side == "left" else side_by_side(image, given)


def _kept(run: Run, folder: Path, label: str, request: SampleRequest, result: Any, suffix: str, index: int,
          count: int) -> list[Path]:
    """_write, where a sample that cannot be written (a full disk) is a warning: the run and the checkpoint due at
    this step go on (the checkpoint's own write then succeeds or says why not)."""
    from difftune.train.checkpoint import write_failure

    try:
        return _write(run, folder, label, request, result, suffix, index, count)
    except Exception as e:
        if (reason := write_failure(e)) is None:
            raise
        for partial in folder.glob(".*.tmp"):
            with suppress(OSError):
                partial.unlink(missing_ok=True)
        run.events.emit("warning", message=f"sample not saved: cannot write in {folder} ({reason}); training goes on")
        return []


def _write(run: Run, folder: Path, label: str, request: SampleRequest, result: Any, suffix: str, index: int,
           count: int) -> list[Path]:
    """One sample's files and "sample" events; with disable_benchmark false, its comparison with the base model."""
    path = folder / file_name(label, request, suffix, index, count)
    written = []
    if isinstance(result, list):  # a video: the MP4, and its contact sheet under the .png name
        from difftune.data.video import contact_sheet, write_mp4

        video = path.with_suffix(".mp4")
        write_mp4(result, video, request.fps)  # atomic
        written.append(video)
        result = contact_sheet(result)
    _save_png(result, path)
    written.append(path)
    numbered = {"image": f"{index + 1}of{count}"} if count > 1 else {}  # trackers tag each image apart
    for item in written:
        # `prompt` names the prompt (the library's name, "validation"); `text` is what was asked for ("": none)
        run.events.emit("sample", step=run.state.step, path=str(item), prompt=request.name or "validation",
                        text=request.prompt, ema=bool(suffix), size=sample_size(request), seed=request.seed,
                        **numbered)
    base = folder / file_name(BASE_LABEL, request, "", index, count)
    # validation_randomize: the base sample had another seed, a comparison would mislead
    if label != BASE_LABEL and not run.cfg.disable_benchmark and not run.cfg.validation_randomize and base.is_file():
        _save_png(_with_base(base, result), path.with_name(f"{path.stem}-vs-base.png"))
    if (side := run.cfg.validation_stitch_input_location) and request.image is not None:
        _save_png(with_input(request, result, side), path.with_name(f"{path.stem}-with-input.png"))
    return written


def _sample_requests(run: Run, model: Any, vae: Any, label: str | None, suffix: str,
                     requests: list[SampleRequest]) -> list[Sampled]:
    """Sample each request (num_validation_images times, seed +1 each); with a `label`, write its files (and
    "sample" events). Without one (an evaluation) each request is sampled once, with its own seed."""
    model.eval()
    out_dir = run.output_dir / "validation"
    out_dir.mkdir(parents=True, exist_ok=True)
    count = 1 if label is None else run.cfg.num_validation_images
    done = []
    total = len(requests) * count
    try:
        for number, (request, index) in enumerate((r, i) for r in requests for i in range(count)):
            one = request if index == 0 else replace(request, seed=request.seed + index)
            # a video sample can take minutes: the progress bar says what the run is doing meanwhile
            run.events.activity(f"{'sampling' if label is None else 'validating'} {number + 1}/{total} "
                                f"({sample_size(one)})")
            result = run.family.sample(run.comps, model, one)
            written = [] if label is None else _kept(run, out_dir, label, one, result, suffix, index, count)
            done.append((one, result, written))
    finally:
        run.events.activity(None)
        model.train()
        # the VAE stays on the accelerator when it encodes on the fly, or when CREPA decodes with it every step
        if not run.data.encode and (run.crepa is None or run.crepa.backbone):
            vae.to("cpu")
    return done
