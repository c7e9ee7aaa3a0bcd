"""Predicted peak accelerator memory of a config, per phase: caching, training, validation.

Weights are exact (architecture.py: meta models, quantized bytes measured per layer shape). Activations come
from the measured per-token coefficients (coefficients.py, measure.py). Optimizer state follows each optimizer's
own rule (train/optimizers.py). What the accelerator holds in each phase follows train/setup.py:

- caching: the text encoders together (at text_encoder_N_precision), then the VAE alone with one encode batch
  of `vae_batch_size` images at the largest bucket; the transformer is there too unless offload_during_startup.
- training: the transformer (base_model_precision; minus what streams with enable_group_offload /
  musubi_blocks_to_swap; divided by N with fsdp_enable), the adapter, its gradients and optimizer state, the EMA
  copy when ema_device is the accelerator, and one micro-batch's saved activations at the largest bucket (plus,
  with gradient checkpointing, one block recomputed at a time; with tread_config, the routed blocks at the image
  tokens they keep).
- validation: what training keeps (weights, adapter, optimizer state) plus the VAE and the larger of one block's
  sampling working set (two prompts with guidance) and the VAE decode at validation_resolution.
- regularisation data and eval datasets (no-grad passes: passes.py): the teacher's target is a training line and
  a note shows its pass below the training peak; the evaluation loss is a phase when it can exceed training.
- datasets encoded during training (vae_cache_disable, vae_cache_clear_each_epoch) keep the VAE in training too.
- crepa_enabled adds its own lines to training and validation (crepa.py: DINOv2, the resident VAE, the projector,
  their working sets); with it off nothing here changes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from difftune.config.crepa_keys import decodes
from difftune.memory_plan import architecture as A
from difftune.memory_plan.coefficients import COEFFICIENTS, VAE
from difftune.models.registry import FAMILY_FACTS

GIB = 2**30
TEXT_TOKENS = 256  # the text tokens planned without tokenizer_max_length (Lumina2's pipeline default)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def text_tokens(cfg: Any) -> int:
    """The prompt tokens planned for: tokenizer_max_length when set, else TEXT_TOKENS (the estimate kept from
    before; Kandinsky 5's pipelines default to 512, or 1024 for i2i, but captions rarely fill them)."""
    return getattr(cfg, "tokenizer_max_length", None) or TEXT_TOKENS


@dataclass
class Line:
    label: str
    bytes: int
    note: str = ""


@dataclass
class Phase:
    name: str
    lines: list[Line] = field(default_factory=list)

    def add(self, label: str, size: float, note: str = "") -> None:
        self.lines.append(Line(label, int(size), note))

    @property
    def total(self) -> int:
        return sum(line.bytes for line in self.lines)


@dataclass
class Prediction:
    phases: list[Phase]
    notes: list[str]
    processes: int

    @property
    def peak(self) -> int:
        return max(p.total for p in self.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: p.total).name

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)


# --- the parts that do not depend on the levers (cached per architecture) ---------------------------------


@functools.lru_cache(maxsize=8)
def _transformer(arch: A.Architecture, dtype_name: str, precision: str) -> tuple[int, A.Blocks, int]:
    """(transformer bytes at the precision, its blocks, parameter count)."""
    model = A.transformer_on_meta(arch)
    _cast(model, dtype_name)
    blocks = A.blocks_of(model, arch.family, precision)
    return A.module_bytes(model, precision), blocks, sum(p.numel() for p in model.parameters())


def _cast(model: torch.nn.Module, dtype_name: str) -> None:
    if dtype_name == "bf16":
        return  # on_meta's dtypes already
    torch.nn.Module.to(model, DTYPES[dtype_name])  # diffusers' own `to` warns about fp32 modules: kept below
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, module in model.named_modules():
        if any(k in name.split(".") for k in keep):
            module.to(torch.float32)


def trainable_shapes(cfg: Any, arch: A.Architecture) -> list[tuple[int, ...]]:
    """The shape of each trainable tensor. LoRA: peft on the meta transformer, with the
    family's targets, exactly as adapters/kinds.py attaches it. LyCORIS: lycoris-lora's network on the meta
    transformer (adapters/lycoris.py). use_dora: peft's magnitude vectors too (one fp32 value per output row of each
    adapted layer), trained, with gradients and optimizer state like the LoRA matrices."""
    return list(_trainable(arch, cfg.model_type, cfg.lora_type, cfg.lora_rank, _targets(cfg), cfg.lycoris_config,
                           bool(getattr(cfg, "use_dora", False))))


def _targets(cfg: Any) -> Any:
    targets = cfg.lora_target_modules
    if targets is None:
        from difftune.models import get_family

        targets = get_family(cfg.model_family).lora_target_modules
    return targets if isinstance(targets, str) else tuple(targets)


@functools.lru_cache(maxsize=8)
def _trainable(arch: A.Architecture, model_type: str, lora_type: str, rank: int, targets: Any,
               lycoris_config: str | None, dora: bool = False) -> tuple[tuple[int, ...], ...]:
    model = A.transformer_on_meta(arch)
    if model_type == "full":
        return tuple(tuple(p.shape) for p in model.parameters())
    model.requires_grad_(False)
    if lora_type == "lycoris":
        import json
        from pathlib import Path

        from difftune.adapters.lycoris import attach_lycoris

        config = json.loads(Path(lycoris_config).read_text(encoding="utf-8-sig"))  # the schema checked it
        _network, params = attach_lycoris(model, config, family=arch.family)
        return tuple(tuple(p.shape) for p in params)
    from peft import LoraConfig

    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, use_dora=dora,
                                 target_modules=targets if isinstance(targets, str) else list(targets)))
    return tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)


def optimizer_bytes(name: str, shapes: list[Any], itemsize: int, settings: dict[str, Any] | None = None) -> int:
    """Optimizer state of tensors of `shapes` (or element counts: 1-D) in a dtype of `itemsize` bytes
    (train/optimizers.py; SimpleTuner's other names: optimizer_catalog.state_bytes). `settings`: optimizer_config."""
    from difftune.train.optimizer_catalog import MORE_SPECS, state_bytes
    from difftune.train.optimizers import OPTIMIZER_ALIASES

    name = OPTIMIZER_ALIASES.get(name, name)
    shapes = [(s,) if isinstance(s, int) else tuple(s) for s in shapes]
    if name in MORE_SPECS:
        return sum(state_bytes(name, shape, itemsize, settings) for shape in shapes)
    sizes = [math.prod(shape) for shape in shapes]
    total = sum(sizes)
    kahan = total * itemsize if itemsize < 4 else 0  # Kahan buffer on bf16/fp16 weights (torch-optimi)
    if name == "adamw8bit":  # bitsandbytes: 2 bytes per element (+ one fp32 absmax per 256) from 4096 elements
        return sum(2 * n + 8 * math.ceil(n / 256) if n >= 4096 else 8 * n for n in sizes)
    per = {"adamw": 2 * total * itemsize, "adamw_bf16": 2 * total * itemsize + kahan,
           "optimi-adamw": 2 * total * itemsize + kahan, "optimi-stableadamw": 2 * total * itemsize + kahan,
           "lion": total * itemsize, "optimi-lion": total * itemsize + kahan,
           "prodigy": 4 * total * itemsize,  # Prodigy: exp_avg, exp_avg_sq, s and the initial weights p0
           "adamw_schedulefree": 2 * total * itemsize}  # z and exp_avg_sq (samples keep a copy of y in CPU memory)
    return per[name]


def element_count(shapes: list[Any]) -> int:
    return sum(s if isinstance(s, int) else math.prod(s) for s in shapes)


# --- activations ----------------------------------------------------------------------------------------


# Config keys that leave the saved activations as they are: the attention kernel's name, and Kandinsky 5's
# visual_cond (image-to-image's input latents and mask widen only the patch embedder's input: +136 bytes per image
# token, under 0.01% of the blocks' figure), so the i2i flavours use K5 Image Lite's measurement.
SAME_ACTIVATIONS = ("attention_type", "visual_cond")


def coefficients_for(arch: A.Architecture, full: bool = False) -> tuple[dict[str, dict[str, tuple[float, ...]]], str]:
    """(the measured coefficients of this architecture, where they come from)."""
    if arch.name in COEFFICIENTS:
        return COEFFICIENTS[arch.name], "measured at real size (coefficients.py)"
    for name, entry in COEFFICIENTS.items():
        found = _known_config(arch.family, name)
        if found is not None and all(arch.config.get(k) == v or (isinstance(v, tuple) and list(v) == arch.config.get(k))
                                     for k, v in found.items() if k not in SAME_ACTIVATIONS):
            return entry, f"measured on {name} (coefficients.py)"
    return _measured_now(arch, full), "measured now on the CPU (a model not in coefficients.py)"


def _known_config(family: str, name: str) -> dict[str, Any] | None:
    flavours = {"Lumina2 2.0": ("lumina2", "2.0"), "K5 Image Lite": ("kandinsky5-image", "t2i-lite-sft"),
                "K5 Image Lite (i2i)": ("kandinsky5-image", "i2i-lite-sft"),
                "K5 Video Lite": ("kandinsky5-video", "t2v-lite-sft-5s"),
                "K5 Video Pro": ("kandinsky5-video", "t2v-pro-sft-5s-hd")}
    if name not in flavours or flavours[name][0] != family:
        return None
    found = A.real_architecture(*flavours[name])
    return found[1] if found else None


@functools.lru_cache(maxsize=4)
def _measured_now(arch: A.Architecture, full: bool) -> dict[str, dict[str, tuple[float, ...]]]:
    params = sum(p.numel() for p in A.transformer_on_meta(arch).parameters())
    if params > 200_000_000:
        raise ValueError(f"{arch.name}: no measured activation coefficients for this architecture, and it is too "
                         "large to measure now; run `python -m difftune.memory_plan.measure` on it")
    from difftune.memory_plan.measure import calibrate

    keys = ("lora", "checkpointed", "full") if full else ("lora", "checkpointed")  # 'full' only when it trains so
    return calibrate(arch, say=lambda *a, **k: None, keys=keys)


def tokens_of(arch: A.Architecture, bucket: tuple[int, ...]) -> int:
    """Image tokens of a (width, height[, frames]) bucket: latent (8x) / patch^2, times latent frames (4x)."""
    w, h = bucket[0], bucket[1]
    frames = bucket[2] if len(bucket) > 2 and bucket[2] else 1
    patch = arch.config.get("patch_size", 2)
    p = patch[-1] if isinstance(patch, list | tuple) else patch
    latent_frames = (frames - 1) // 4 + 1 if arch.family == "kandinsky5-video" else 1
    return latent_frames * (h // 8 // p) * (w // 8 // p)


def block_bytes(table: dict, stack: str, tokens: int, text: int) -> float:
    """One sample's bytes saved by one block of `stack`: a * image tokens + b * text tokens + c."""
    a, b, c = table.get(stack, (0.0, 0.0, 0.0))
    return a * tokens + b * text + c


# the block stack TREAD routes, per Family.tread_layout (train/tread.py LAYOUTS)
TREAD_STACK = {"joint": "layers", "visual": "visual_transformer_blocks"}


def tread_tokens(cfg: Any, arch: A.Architecture, blocks: A.Blocks, tokens: int, fixed: int = 0
                 ) -> tuple[str, dict[int, int], set[int]]:
    """(the stack TREAD routes, {block index: image tokens that block sees}, the routes' first blocks) for
    tread_config, as train/tread.py routes: a route's blocks see what is left once int(ratio x routable) tokens
    are dropped; `fixed` tokens (image-to-video's input frame) are never routed, nor are caption tokens. A route's
    first block is given the whole sequence (its hook gathers inside the block), so with gradient checkpointing
    it keeps a full-size input. ('', {}, set()) without tread_config."""
    config = getattr(cfg, "tread_config", None)
    if config is None:
        return "", {}, set()
    from difftune.models import get_family
    from difftune.train.tread import resolve_routes

    stack = TREAD_STACK[get_family(arch.family).tread_layout]
    seen: dict[int, int] = {}
    routes = resolve_routes(config.routes, blocks.count.get(stack, 0))  # TreadError names a route off the model
    for route in routes:
        seen.update(dict.fromkeys(range(route.start, route.end + 1), tokens - int(route.ratio * (tokens - fixed))))
    return stack, seen, {route.start for route in routes}


def activation_bytes(cfg: Any, arch: A.Architecture, blocks: A.Blocks, tokens: int, text: int,
                     coefficients: dict, fixed: int = 0) -> tuple[int, int, str]:
    """(saved activations of one micro-batch, the backward's transient (one block recomputed), explanation).
    With tread_config the routed blocks save (and recompute) at their fewer image tokens; `fixed`: see
    tread_tokens."""
    mode = "full" if cfg.model_type == "full" else "lora"
    plain = coefficients[mode]
    batch = cfg.train_batch_size
    routed, seen, starts = tread_tokens(cfg, arch, blocks, tokens, fixed)

    def per_block(table: dict, stack: str, index: int = -1, entering: bool = False) -> float:
        # 'outside' may be negative: see measure.per_stack. `entering`: the block's input (checkpointed)
        kept = stack == routed and index in seen and not (entering and index in starts)
        return block_bytes(table, stack, seen[index] if kept else tokens, text) * batch

    tread_note = ""
    if seen:
        kept = "/".join(str(k) for k in sorted(set(seen.values())))
        tread_note = f"; TREAD: {len(seen)} of {blocks.count[routed]} {routed} at {kept} image tokens"
    if not cfg.gradient_checkpointing:
        saved = sum(per_block(plain, s, i) for s, n in blocks.count.items() for i in range(n))
        saved += per_block(plain, "outside")
        return int(saved), 0, (f"{tokens} image + {text} text tokens x batch {batch}, every block's activations"
                               + tread_note)
    interval = getattr(cfg, "gradient_checkpointing_interval", None) or 1
    ckpt = coefficients["checkpointed"]
    saved = per_block(ckpt, "outside")
    # gradient_checkpointing_backend 'unsloth': the checkpointed blocks' inputs wait in CPU memory; in the backward
    # the recomputed block's input and the next one (prefetched) are back (train/activation_offload.py)
    offloaded = getattr(cfg, "gradient_checkpointing_backend", "torch") == "unsloth"
    entering = [per_block(ckpt, stack, i, entering=True) for stack, n in blocks.count.items()
                for i in range(0, n, interval)]  # blocks 0, k, 2k, ... are checkpointed (ceil(n / k) of them)
    saved += sum(per_block(plain, stack, i) for stack, n in blocks.count.items() for i in range(n) if i % interval)
    saved += 0 if offloaded else sum(entering)
    transient = max(per_block(plain, s, i) for s, n in blocks.count.items() for i in range(n))
    transient += 2 * max(entering, default=0) if offloaded else 0
    every = "every block" if interval == 1 else f"every {interval}th block"
    where = (f", their inputs in CPU memory ({sum(entering) / 2**30:.1f} GiB pinned; 2 back at a time in the "
             "backward)") if offloaded else ""
    return int(saved), int(transient), (f"{tokens} image + {text} text tokens x batch {batch}, {every} checkpointed"
                                        + where + tread_note)


# --- the phases -----------------------------------------------------------------------------------------


def largest_bucket(found: list[Any] | None, cfg: Any, held_out: bool = False) -> tuple[int, ...]:
    """The largest (width, height[, frames]) group of the trained samples; the validation size without data. Eval
    datasets (held out) are left out, unless `held_out`: they are measured without gradients, far below a training
    step's peak, but their latents are cached as the trained ones are (the VAE's phase)."""
    groups = [s.group for d in (found or []) if held_out or not d.held_out for s in d.samples]
    if not groups:
        w, h = max(cfg.validation_sizes(), key=lambda s: s[0] * s[1])
        if FAMILY_FACTS[cfg.model_family].video:  # clips of the validation length (the schema's default: 61)
            return (w, h, getattr(cfg, "validation_num_video_frames", None) or 61)
        return (w, h)
    return max(groups, key=lambda g: g[0] * g[1] * (g[2] if len(g) > 2 and g[2] else 1))


def predict(cfg: Any, found: list[Any] | None = None, processes: int = 1) -> Prediction:
    """Peak accelerator bytes per phase for TrainConfig `cfg`; `found`: the discovered datasets (train/plan.py)."""
    arch = A.architecture_of(cfg)
    dtype = cfg.weight_dtype_name()
    precision = cfg.base_model_precision
    transformer, blocks, _params = _transformer(arch, dtype, precision)
    notes: list[str] = []
    fsdp = bool(getattr(cfg, "fsdp_enable", False)) and processes > 1
    shards = processes if fsdp else 1
    bucket = largest_bucket(found, cfg)
    tokens = tokens_of(arch, bucket)
    text = text_tokens(cfg)
    coefficients, source = coefficients_for(arch, cfg.model_type == "full")
    notes.append(f"architecture: {arch.name}; activations {source}")
    notes.append(f"largest bucket {'x'.join(map(str, bucket[:2]))}"
                 + (f", {bucket[2]} frames" if len(bucket) > 2 and bucket[2] else "") + f": {tokens} image tokens")

    # streamed blocks (train/offload.py): their frozen bytes leave; at most 2 groups are back at once
    streamed, kept, stream_note = streaming(cfg, blocks)
    resident = transformer - streamed + kept

    sizes = trainable_shapes(cfg, arch)
    trainable = element_count(sizes)
    train_itemsize = DTYPE_BYTES[dtype] if cfg.model_type == "full" else 4  # adapters train in fp32
    adapter_bytes = 0 if cfg.model_type == "full" else trainable * 4
    grads = trainable * train_itemsize
    opt = optimizer_bytes(cfg.optimizer, sizes, train_itemsize, cfg.optimizer_settings())
    ema = trainable * 4 if cfg.use_ema and cfg.ema_device == "accelerator" else 0

    training = Phase("training")
    what = f"transformer ({precision if precision != 'no_change' else dtype})"
    if cfg.model_type == "full":
        training.add(what, transformer / shards, "trained in place" + (f", sharded over {shards}" if fsdp else ""))
    else:
        training.add(what, resident / shards, stream_note or (f"sharded over {shards}" if fsdp else "frozen"))
        training.add(f"adapter ({trainable / 1e6:.1f}M parameters, fp32)", adapter_bytes / shards)
    if getattr(cfg, "optimizer_offload_gradients", False):  # each leaves the accelerator as the backward makes it
        training.add("gradients", 0, f"{grads / GIB:.2f} GiB in CPU memory (optimizer_offload_gradients)")
    else:
        training.add("gradients", grads / shards)
    if getattr(cfg, "optimizer_cpu_offload_method", "none") == "cpu":  # train/optimizer_offload.py: it steps there
        training.add(f"optimizer state ({cfg.optimizer})", 0, f"{opt / GIB:.2f} GiB in CPU memory "
                     "(optimizer_cpu_offload_method 'cpu')")
        opt = 0
    else:
        training.add(f"optimizer state ({cfg.optimizer})", opt / shards)
    if ema:
        training.add("EMA copy (fp32)", ema)
    if fsdp:
        largest = max(blocks.bytes_each.values())
        training.add("FSDP: gathered blocks", 2 * largest, "the running block and the next, whole")
    fixed = tokens_of(arch, bucket[:2]) if FAMILY_FACTS[cfg.model_family].first_frame(cfg.flavour()) else 0
    saved, transient, act_note = activation_bytes(cfg, arch, blocks, tokens, text, coefficients, fixed)
    training.add("saved activations", saved, act_note)
    if transient:
        training.add("recomputed block (backward)", transient, "gradient checkpointing recomputes one block at a time"
                     + (", with its input and the next one's back from CPU memory"
                        if getattr(cfg, "gradient_checkpointing_backend", "torch") == "unsloth" else ""))
    if getattr(cfg, "use_dora", False) and cfg.model_type != "full":  # DoRA's saved products (memory_plan/dora.py)
        from difftune.memory_plan import dora

        dora.add_training(cfg, arch, blocks, coefficients, bucket, text, DTYPE_BYTES[dtype], training)
    if getattr(cfg, "crepa_enabled", False):  # CREPA / REPA: DINOv2, the VAE, the projector (memory_plan/crepa.py)
        from difftune.memory_plan import crepa

        crepa.add_training(cfg, arch, bucket, tokens, training, notes)
    encodes = (getattr(cfg, "vae_cache_disable", False) or getattr(cfg, "vae_cache_ondemand", False)
               or any(getattr(d, "on_the_fly", False) for d in found or []))
    if not decodes(cfg) and encodes:
        # train/caching.py keeps the VAE on the accelerator for datasets encoded during training (CREPA's decoding
        # line above counts the same VAE)
        training.add("VAE (latents encoded during training)", vae_bytes(cfg),
                     "vae_cache_disable, vae_cache_clear_each_epoch or vae_cache_ondemand: it encodes batches")

    caching = caching_phase(cfg, arch, largest_bucket(found, cfg, held_out=True), transformer, processes)
    kept = resident / shards + adapter_bytes / shards + opt / shards + ema
    # sampling runs only with something to sample (the main prompt and the libraries), so it is no phase without
    validation = [validation_phase(cfg, arch, blocks, coefficients, kept, text)] if cfg.validation_prompts() else []
    if not validation:
        notes.append("no validation phase: no validation_prompt (nor prompt library) to sample")
    encoding = [encoding_phase(cfg, bucket, kept)] if encodes else []
    from difftune.memory_plan import passes

    # the regularisation teacher and the evaluation loss (no-grad passes)
    extra = passes.add(cfg, arch, blocks, coefficients, found, bucket, training, kept, notes)
    return Prediction([*caching, training, *validation, *encoding, *extra], notes, processes)


def encoding_phase(cfg: Any, bucket: tuple[int, ...], kept: float) -> Phase:
    """Latents encoded during training (vae_cache_disable and vae_cache_clear_each_epoch: each micro-batch's;
    vae_cache_ondemand: the unwritten ones of a batch, vae_batch_size at a time): the VAE's work beside what training
    keeps. It runs before the step's forward pass, so the step's activations are not there."""
    n = max(cfg.train_batch_size, cfg.vae_batch_size)
    phase = Phase("training: encoding latents")
    phase.add("weights, adapter, optimizer state and EMA (kept)", kept)
    phase.add("VAE", vae_bytes(cfg))
    phase.add(f"VAE encode ({'x'.join(map(str, bucket))} x {n})", vae_work(cfg, "encode", bucket) * n,
              "vae_cache_disable, vae_cache_clear_each_epoch or vae_cache_ondemand")
    return phase


def streaming(cfg: Any, blocks: A.Blocks) -> tuple[int, int, str]:
    """(bytes that stream out, bytes of the groups held at once, note) for enable_group_offload or
    musubi_blocks_to_swap, with train/offload.py's rules."""
    if getattr(cfg, "enable_group_offload", False):
        per_group = getattr(cfg, "group_offload_blocks_per_group", 1) or 1
        out = sum(blocks.bytes_each[s] * n for s, n in blocks.count.items())
        held = 2 if getattr(cfg, "group_offload_use_stream", False) else 1  # the next one prefetched, or none
        kept = held * per_group * max(blocks.bytes_each.values())
        return out, min(kept, out), f"every block streams; {held} group{'s' if held > 1 else ''} of {per_group} held"
    swap = getattr(cfg, "musubi_blocks_to_swap", None) or 0
    if swap:
        last = list(blocks.count)[-1]
        n = min(swap, blocks.count[last])
        out = blocks.bytes_each[last] * n
        return out, min(out, 2 * blocks.bytes_each[last]), f"the last {n} {last} stream; 2 held"
    return 0, 0, ""


@functools.lru_cache(maxsize=16)
def _text_encoders(family: str, source: str, flavour: str, dtype: str, precisions: tuple[str, str], tokens: int,
                   cfg_ref: Any) -> tuple[tuple[str, int, int], ...]:
    """((label, bytes at its precision, activation bytes), ...) of the family's text encoders."""
    out = []
    for index, (label, module) in enumerate(A.text_encoders_on_meta(cfg_ref)):
        precision = precisions[index] if index < 2 else "no_change"
        _cast(module, dtype)
        out.append((f"{label} ({precision if precision != 'no_change' else dtype})", A.module_bytes(module, precision),
                    _text_activations(module, tokens)))
    return tuple(out)


@functools.lru_cache(maxsize=16)
def _vae_bytes(family: str, source: str, flavour: str, dtype: str, cfg_ref: Any) -> int:
    vae = A.vae_on_meta(cfg_ref)
    _cast(vae, dtype)
    return A.module_bytes(vae, "no_change")


class _Key:
    """A config passed through lru_cache by the fields that decide the result (the others are ignored)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cfg, name)

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key)


def text_encoder_parts(cfg: Any) -> tuple[tuple[str, int, int], ...]:
    return _text_encoders(cfg.model_family, cfg.model_source(), cfg.flavour(), cfg.weight_dtype_name(),
                          (cfg.text_encoder_1_precision, cfg.text_encoder_2_precision), text_tokens(cfg), _Key(cfg))


def vae_dtype_name(cfg: Any) -> str:
    """The VAE's dtype: vae_dtype when set (models/vae_dtype.py), else the weights'."""
    return getattr(cfg, "vae_dtype", None) or cfg.weight_dtype_name()


def vae_bytes(cfg: Any) -> int:
    return _vae_bytes(cfg.model_family, cfg.model_source(), cfg.flavour(), vae_dtype_name(cfg), _Key(cfg))


def caching_phase(cfg: Any, arch: A.Architecture, bucket: tuple[int, ...], transformer: int,
                  processes: int = 1) -> list[Phase]:
    # train/setup.py: the transformer waits in CPU memory while the caches fill with offload_during_startup,
    # model CPU offload, block streaming (which takes its blocks' weights after caching), or FSDP's RAM-efficient
    # loading (in process 0's CPU memory, on the meta device elsewhere, until it is sharded)
    ram_efficient = getattr(cfg, "fsdp_enable", False) and getattr(cfg, "fsdp_cpu_ram_efficient_loading", False) \
        and processes > 1
    parked = cfg.offload_during_startup or ram_efficient or any(getattr(cfg, k, None) for k in (
        "enable_model_cpu_offload", "enable_group_offload", "musubi_blocks_to_swap"))
    startup = 0 if parked else transformer
    text = Phase("caching: text")
    for label, size, work in text_encoder_parts(cfg):
        text.add(label, size)
        text.add(f"{label.split(' (')[0]}: activations", work, f"every layer's hidden states at {text_tokens(cfg)} "
                 "tokens (estimate)")
    if startup:
        text.add("transformer (resident: offload_during_startup off)", startup, "joins before caching, to fail fast")
    vae_phase = Phase("caching: latents")
    vae_phase.add("VAE", vae_bytes(cfg))
    vae_phase.add(f"VAE encode ({'x'.join(map(str, bucket))} x vae_batch_size {cfg.vae_batch_size})",
                  vae_work(cfg, "encode", bucket) * cfg.vae_batch_size)
    if startup:
        vae_phase.add("transformer (resident: offload_during_startup off)", startup)
    return [text, vae_phase]


def _text_activations(module: torch.nn.Module, tokens: int) -> int:
    config = getattr(module, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(getattr(config, "text_config", None), "hidden_size", 0)
    layers = getattr(config, "num_hidden_layers", None) or \
        getattr(getattr(config, "text_config", None), "num_hidden_layers", 0)
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 0)
    logits = tokens * vocab * 4 if hasattr(module, "lm_head") else 0
    return (layers + 1) * tokens * hidden * 2 + logits


def vae_work(cfg: Any, what: str, bucket: tuple[int, ...]) -> int:
    """Peak working bytes of one image's (or clip's) VAE encode/decode above its weights (coefficients.VAE)."""
    name = "HunyuanVideo" if cfg.model_family == "kandinsky5-video" else "FLUX"
    per_pixel = VAE.get(name, {}).get(what)
    if per_pixel is None:
        return 0
    w, h = bucket[0], bucket[1]
    if name == "HunyuanVideo":  # tiled above 256 px and 16-frame windows (models/kandinsky5_video.py)
        frames = bucket[2] if len(bucket) > 2 and bucket[2] else 1
        return int(per_pixel * min(w, 256) * min(h, 256) * min(frames, 17))
    return int(per_pixel * w * h)


def validation_phase(cfg: Any, arch: A.Architecture, blocks: A.Blocks, coefficients: dict, kept: float,
                     text: int) -> Phase:
    phase = Phase("validation")
    phase.add("what training keeps (weights, adapter, optimizer, EMA)", kept)
    if getattr(cfg, "crepa_enabled", False):  # the VAE less what crepa_drop_vae_encoder freed; DINOv2, projector
        from difftune.memory_plan import crepa

        freed = crepa.vae_encoder_freed(cfg)
        phase.add("VAE", vae_bytes(cfg) - freed, "encoder freed (crepa_drop_vae_encoder)" if freed else "")
        crepa.add_validation(cfg, arch, phase)
    else:
        phase.add("VAE", vae_bytes(cfg))
    sizes = cfg.validation_sizes()
    frames = getattr(cfg, "validation_num_video_frames", None) or (61 if arch.family == "kandinsky5-video" else 0)
    worst = max(sizes, key=lambda s: s[0] * s[1])
    bucket = (worst[0], worst[1], frames) if frames else worst
    tokens = tokens_of(arch, bucket)
    plain = coefficients["lora"]
    block = max(block_bytes(plain, s, tokens, text) for s in blocks.count)
    sampling = 2 * block  # guidance: the prompt and the negative prompt in one batch
    decode = vae_work(cfg, "decode", bucket)
    label = f"sampling {'x'.join(map(str, worst))}" + (f", {frames} frames" if frames else "")
    if sampling >= decode:
        phase.add(f"{label}: one block's working set (x2 for guidance)", sampling, "upper bound: a block's saved "
                  "activations")
    else:
        phase.add(f"{label}: VAE decode", decode)
    return phase
