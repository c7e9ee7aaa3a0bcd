"""CREPA / REPA in the plan (`crepa_enabled`, train/crepa.py): what the alignment adds on the accelerator.

`Crepa` attaches in train/setup.py after the caches are filled, so the caching phases do not change. From then on
the accelerator holds, next to what training already held:

- the DINOv2 encoder, frozen, in the dtype train/crepa.encoder_dtype loads it in (bf16 with bf16 weights, else
  fp32). Exact: the model is built on the meta device from
  its config (the hub sizes of `DINOV2_SIZES`, or a local folder's config.json), by the same AutoModel class.
- the VAE, moved there by `Crepa` to decode the clean latents every step (without CREPA the caching phase parks it
  on the CPU), less its encode-only modules (train/crepa.ENCODE_ONLY) with crepa_drop_vae_encoder.
- the projector (train/crepa.projector: hidden -> 2048 -> 2048 -> DINOv2 width, fp32, counted on meta), with its
  gradients and its state in the adapter's optimizer (no EMA, not sharded: the config refuses fsdp_enable).
- what autograd keeps for the projector and the loss until the backward (`projector_saved`: counted from
  train/crepa.py's operations, checked in the tests against autograd's saved tensors).
- one at a time, while the transformer's saved activations are held: the VAE decode of the micro-batch (the same
  measured per-pixel coefficients as the validation decode), the DINOv2 pass over its frames (measured now on the
  CPU: `measure.encoder_working_set`), and the loss's temporaries. The plan adds the largest of the three.

Backbone mode (crepa_use_backbone_features): no DINOv2 and no VAE; the projector maps the hidden size to itself,
and the targets are the teacher block's tokens, which autograd already keeps as the next block's input (only their
fp32 copy is the loss's, among its temporaries).

Not modelled: the gradients that flow back through the projector (transient, at the start of the backward).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from difftune.config.crepa_keys import ENCODER_ALIASES, decodes
from difftune.memory_plan import architecture as A
from difftune.memory_plan.predict import (
    DTYPES,
    Phase,
    _Key,
    element_count,
    optimizer_bytes,
    vae_bytes,
    vae_dtype_name,
    vae_work,
)
from difftune.train.crepa import ENCODE_ONLY, PROJECTOR_WIDTH, encoder_dtype, projector

# The hub checkpoints crepa_encoder names (directly or through ENCODER_ALIASES' torch hub names): (hidden size,
# layers, attention heads, MLP ratio, SwiGLU MLP). These are the sizes transformers' conversion scripts
# (models/dinov2/convert_dinov2_to_hf.py and convert_dinov2_with_registers_to_hf.py, get_*_config) give
# facebookresearch/dinov2's ViT-S/14, B/14, L/14 and g/14, each with patch 14 and image_size 518 (a 37x37 table
# of position embeddings); the "with registers" checkpoints add 4 register tokens. The conversion saves fp32.
DINOV2_SIZES = {"small": (384, 12, 6, 4, False), "base": (768, 12, 12, 4, False), "large": (1024, 24, 16, 4, False),
                "giant": (1536, 40, 24, 4, True)}
DINOV2_PATCH, DINOV2_IMAGE, DINOV2_REGISTERS = 14, 518, 4


@dataclass(frozen=True, eq=False)
class Encoder:
    label: str  # 'dinov2_vitg14 (facebook/dinov2-giant)' or the folder
    config: Any  # the transformers config AutoModel builds it from
    dtype: torch.dtype


def hub_config(source: str) -> Any | None:
    """The transformers config of a facebook/dinov2-* checkpoint, from DINOV2_SIZES; None for any other id."""
    prefix, _, size = source.rpartition("-")
    if prefix not in ("facebook/dinov2", "facebook/dinov2-with-registers") or size not in DINOV2_SIZES:
        return None
    hidden, layers, heads, ratio, swiglu = DINOV2_SIZES[size]
    sizes = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, mlp_ratio=ratio,
                 use_swiglu_ffn=swiglu, image_size=DINOV2_IMAGE, patch_size=DINOV2_PATCH)
    if prefix.endswith("registers"):
        from transformers import Dinov2WithRegistersConfig

        return Dinov2WithRegistersConfig(**sizes, num_register_tokens=DINOV2_REGISTERS)
    from transformers import Dinov2Config

    return Dinov2Config(**sizes)


@functools.lru_cache(maxsize=8)
def encoder_of(name: str, dtype: torch.dtype) -> Encoder | None:
    """crepa_encoder as train/crepa.load_encoder resolves it (an alias, a local folder or a hub id), loaded in
    `dtype` (train/crepa.encoder_dtype); None when its size cannot be known offline (a hub id that is not one of
    the facebook/dinov2-* checkpoints)."""
    source = ENCODER_ALIASES.get(name, name)
    label = f"{name} = {source}" if source != name else name
    folder = Path(source).expanduser()
    if folder.is_dir() and (folder / "config.json").is_file():
        from transformers import AutoConfig

        return Encoder(label, AutoConfig.from_pretrained(folder), dtype)
    config = hub_config(source)
    return None if config is None else Encoder(label, config, dtype)


def encoder_on_meta(encoder: Encoder) -> torch.nn.Module:
    from transformers import AutoModel

    with torch.device("meta"):
        model = AutoModel.from_config(encoder.config)
    return model.to(encoder.dtype)


@functools.lru_cache(maxsize=8)
def encoder_size(name: str, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of its parameters and buffers, parameter count) of crepa_encoder `name`: exact, from the meta model."""
    model = encoder_on_meta(encoder_of(name, dtype))
    return A.module_bytes(model, "no_change"), sum(p.numel() for p in model.parameters())


@functools.lru_cache(maxsize=8)
def encoder_work(name: str, dtype: torch.dtype, size: int) -> tuple[int, int]:
    """(bytes per image, bytes whatever the count) of crepa_encoder `name`'s no-grad forward at size x size."""
    from difftune.memory_plan.measure import encoder_working_set

    encoder = encoder_of(name, dtype)
    return encoder_working_set(encoder.config, encoder.dtype, size)


def projector_sizes(hidden: int, width: int) -> list[tuple[int, ...]]:
    """Shapes of the projector's tensors, from train/crepa.projector itself (built on meta)."""
    with torch.device("meta"):
        module = projector(hidden, width, 0)
    return [tuple(p.shape) for p in module.parameters()]


def offsets(cfg: Any, frames: int) -> list[int]:
    """The frame offsets train/crepa.alignment compares (images: 0 only)."""
    distance = cfg.crepa_adjacent_distance if frames > 1 else 0
    return list(range(-distance, distance + 1)) if cfg.crepa_cumulative_neighbors else sorted({-distance, 0, distance})


def projector_saved(cfg: Any, batch: int, frames: int, per_frame: int, hidden: int, width: int) -> int:
    """Bytes the projector and the alignment loss hold until the backward (train/crepa.term), for `batch` samples
    of `frames` latent frames of `per_frame` tokens, all fp32: what autograd keeps (the captured tokens' copy, none
    when the block already gives fp32: weights in fp32 without autocast; the MLP's four 2048-wide activations, each
    Linear's and each SiLU's input) and the projector's output, which lives through the targets' decode and DINOv2
    pass (the loss keeps it when aligning token by token, with the normalized targets of each frame offset)."""
    tokens = batch * frames * per_frame
    copy_bytes = 0 if cfg.weight_dtype_name() == "fp32" and cfg.mixed_precision == "no" else hidden * 4
    saved = tokens * (copy_bytes + 4 * PROJECTOR_WIDTH * 4 + width * 4)
    if cfg.crepa_spatial_align:  # crepa_spatial_align off: the cosine of per-frame means keeps almost nothing
        saved += sum(batch * max(0, frames - abs(d)) * per_frame * width * 4 for d in offsets(cfg, frames))
    return saved


def loss_temporaries(cfg: Any, batch: int, frames: int, per_frame: int, width: int) -> int:
    """The loss's transient bytes (fp32), an upper bound: the targets on the token grid and, aligning token by token,
    the cosine's normalized tokens and their product (at most a whole offset's); crepa_similarity_threshold's cosine
    afterwards normalizes both sides again and keeps none of it."""
    targets = batch * frames * per_frame * width * 4
    if not cfg.crepa_spatial_align:  # the full targets go once their per-frame mean is taken
        return targets
    return (4 if cfg.crepa_similarity_threshold is not None else 3) * targets


def vae_encoder_freed(cfg: Any) -> int:
    """Bytes crepa_drop_vae_encoder frees (the VAE's encode-only modules at the planned dtype); 0 when off."""
    if not (decodes(cfg) and getattr(cfg, "crepa_drop_vae_encoder", False)):
        return 0
    return _vae_encoder_bytes(cfg.model_family, cfg.model_source(), cfg.flavour(), vae_dtype_name(cfg), _Key(cfg))


@functools.lru_cache(maxsize=16)
def _vae_encoder_bytes(family: str, source: str, flavour: str, dtype: str, cfg_ref: Any) -> int:
    vae = A.vae_on_meta(cfg_ref).to(DTYPES[dtype])
    names = ENCODE_ONLY.get(type(vae).__name__, ())  # another class: train/crepa.py refuses to drop anything
    return sum(A.module_bytes(getattr(vae, n), "no_change") for n in names if getattr(vae, n, None) is not None)


def _gib(n: float) -> str:
    """As render.gib: GiB, or MiB below 0.1 GiB."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 0.1 * 2**30 else f"{n / 2**20:.1f} MiB"


def add_training(cfg: Any, arch: A.Architecture, bucket: tuple[int, ...], tokens: int, phase: Phase,
                 notes: list[str]) -> None:
    """CREPA's lines of the training phase (see the module docstring)."""
    batch = cfg.train_batch_size
    frames_pixel = bucket[2] if len(bucket) > 2 and bucket[2] else 1
    frames = (frames_pixel - 1) // 4 + 1 if arch.family == "kandinsky5-video" else 1  # latent frames
    per_frame = tokens // frames
    hidden = arch.config.get("hidden_size") or arch.config["model_dim"]
    if cfg.crepa_use_backbone_features:
        _projector_lines(cfg, phase, hidden, hidden, batch, frames, per_frame)
        phase.add("CREPA targets: the teacher block's tokens (fp32) and the loss temporaries",
                  loss_temporaries(cfg, batch, frames, per_frame, hidden),
                  f"teacher: block {cfg.crepa_teacher_block_index}, no encoder and no VAE decode")
        return
    freed = vae_encoder_freed(cfg)
    phase.add("CREPA: VAE (decodes the clean latents every step)", vae_bytes(cfg) - freed,
              f"encoder freed by crepa_drop_vae_encoder (-{_gib(freed)})" if freed else "kept on the accelerator")
    width, height = bucket[0], bucket[1]
    pixels = batch * frames_pixel * width * height * 3
    # the decode's working set, then its frames in fp32 (train/crepa.py's .float()); the video VAE decodes in tiles,
    # and vae_work counts one tile: its whole bf16 output is added too
    video = arch.family == "kandinsky5-video"
    decode = batch * vae_work(cfg, "decode", bucket) + pixels * ((2 if video else 0) + 4)
    encoder = encoder_of(cfg.crepa_encoder, encoder_dtype(cfg.weight_dtype_name()))
    if encoder is None:
        notes.append(f"CREPA: crepa_encoder {cfg.crepa_encoder!r} is not a local folder nor one of the "
                     "facebook/dinov2-* checkpoints whose sizes difftune knows: its weights, its working set and "
                     "the projector (sized by its width) are left out of this plan")
        phase.add(f"CREPA: VAE decode ({'x'.join(map(str, bucket))} x batch {batch})", decode)
        return
    size, params = encoder_size(cfg.crepa_encoder, encoder.dtype)
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(encoder.dtype, str(encoder.dtype))
    phase.add(f"CREPA: DINOv2 {encoder.label}: {params / 1e6:.1f}M parameters, {dtype}", size,
              "frozen")
    width_out = encoder.config.hidden_size
    _projector_lines(cfg, phase, hidden, width_out, batch, frames, per_frame)
    side = cfg.crepa_encoder_image_size
    images = batch * frames
    per_image, fixed = encoder_work(cfg.crepa_encoder, encoder.dtype, side)
    dino = fixed + images * (per_image + 3 * width * height * 4 + 3 * side * side * 4)  # + its fp32 inputs
    loss = loss_temporaries(cfg, batch, frames, per_frame, width_out)
    parts = {f"VAE decode (x batch {batch})": decode,
             f"DINOv2 pass ({images} frame{'s' if images > 1 else ''} at {side} px)": dino, "loss temporaries": loss}
    largest = max(parts, key=lambda k: parts[k])
    phase.add(f"CREPA targets: {largest}", parts[largest],
              "the largest of " + ", ".join(f"{k} {_gib(v)}" for k, v in parts.items()) + ", one after another")
    notes.append("CREPA: DINOv2's weights exact (meta model), its forward's working set measured now on the CPU (2 "
                 "layers at real width, no grad), the VAE decode from the validation decode's coefficients; not added: "
                 "the gradients flowing back through the projector (transient, at the start of the backward)")


def _projector_lines(cfg: Any, phase: Phase, hidden: int, width: int, batch: int, frames: int, per_frame: int) -> None:
    sizes = projector_sizes(hidden, width)
    count = element_count(sizes)
    phase.add(f"CREPA: projector ({count / 1e6:.1f}M parameters, fp32)", count * 4, "trained; not in the EMA")
    phase.add("CREPA: projector gradients", count * 4)
    phase.add(f"CREPA: projector optimizer state ({cfg.optimizer})",
              optimizer_bytes(cfg.optimizer, sizes, 4, cfg.optimizer_settings()))
    phase.add("CREPA: projector and loss, saved activations",
              projector_saved(cfg, batch, frames, per_frame, hidden, width),
              f"{batch * frames * per_frame} tokens, fp32, kept until the backward")


def add_validation(cfg: Any, arch: A.Architecture, phase: Phase) -> None:
    """What CREPA keeps on the accelerator while validation samples: the encoder, the projector and its optimizer
    state (the VAE is the validation's own line)."""
    hidden = arch.config.get("hidden_size") or arch.config["model_dim"]
    if cfg.crepa_use_backbone_features:
        sizes = projector_sizes(hidden, hidden)
        phase.add("CREPA: projector and its optimizer state (kept)",
                  element_count(sizes) * 4 + optimizer_bytes(cfg.optimizer, sizes, 4, cfg.optimizer_settings()))
        return
    encoder = encoder_of(cfg.crepa_encoder, encoder_dtype(cfg.weight_dtype_name()))
    if encoder is None:
        return  # the training phase's note says what is left out
    size = encoder_size(cfg.crepa_encoder, encoder.dtype)[0]
    sizes = projector_sizes(hidden, encoder.config.hidden_size)
    phase.add("CREPA: DINOv2, projector and its optimizer state (kept)",
              size + element_count(sizes) * 4 + optimizer_bytes(cfg.optimizer, sizes, 4, cfg.optimizer_settings()))

