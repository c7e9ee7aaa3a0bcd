"""Measured activation memory of a transformer's blocks, on the CPU (`python -m difftune.memory_plan.measure`).

What is measured: the bytes autograd keeps for the backward pass (the saved activations), which is what grows
with the tokens and the batch. Method:

- The family's transformer is built at its real width with only 2 blocks per stack (random weights, bf16, the
  fp32 modules the class keeps in fp32), the adapter attached as training attaches it (peft LoRA on the family's
  targets, trained in fp32) or the base left trainable (full fine-tune), and the family's own `predict` runs it
  under bf16 autocast, as the training loop does.
- `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd saves. Saved tensors are summed by
  storage (views of one storage count once; parameters do not count), and attributed to the block running at
  the time (forward hooks). A stack's second block is the per-block figure (the first also saves what all blocks
  share: rotary tables, the time embedding); the rest is "outside the blocks".
- With gradient checkpointing (diffusers' `enable_gradient_checkpointing`, non-reentrant torch.utils.checkpoint)
  a checkpointed block saves only its inputs; its activations exist again, one block at a time, while the
  backward pass recomputes it: the planner adds one block's full activations for that.
- Each figure is fitted per block as a * image_tokens + b * text_tokens (least squares over several token
  counts) and checked on another count. Attention runs PyTorch's CPU flash kernel, which saves O(tokens) (the
  output and the log-sum-exp), as the CUDA flash/memory-efficient kernels do.

bf16 matrix products are emulated (`FastBf16`): this CPU has no bf16 matrix unit (0.2 GFLOP/s), so matmuls and
attention on bf16 tensors run in fp32 and their results are rounded to bf16. Every tensor autograd sees has the
dtype, shape and storage of a real bf16 run; only the arithmetic inside those kernels differs.

`peak_live_bytes` measures the peak of storages alive at once inside a call (checked after every operator): the
VAE's encode and decode, and the whole training step in the tests; `encoder_working_set` the CREPA encoder's forward.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

# aten ops whose bf16 CPU kernels are the slow ones; run in fp32, rounded back to the dtype the op would give
SLOW_BF16 = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward", "convolution_backward"}


class FastBf16(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name not in SLOW_BF16 or not any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
                                            for t in tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        up_args, up_kwargs = tree_map(_up, (args, kwargs))
        out = func(*up_args, **up_kwargs)
        if name == "_scaled_dot_product_flash_attention_for_cpu":
            return out[0].to(torch.bfloat16), out[1]  # (attention in the input dtype, log-sum-exp in fp32)
        return tree_map(_down, out)


def _up(t: Any) -> Any:
    return t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t


def _down(t: Any) -> Any:
    return t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t


class ShapesOnly(TorchDispatchMode):
    """The heavy operators (matrix products, convolutions, attention) return zeros of the exact shape, strides
    and dtype their kernel gives (from its meta implementation), each in a storage of its own, without computing:
    the bytes autograd saves depend on shapes and dtypes, never on values, and computing them takes hours on 2
    shared CPU cores. Every other operator (norms, activations, rotary, casts, views) runs for real."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ not in SLOW_BF16:
            return func(*args, **kwargs)
        try:
            meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        except (NotImplementedError, RuntimeError):
            return func(*args, **kwargs)
        return tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).zero_()
                        if isinstance(t, torch.Tensor) else t, meta)


def _to_meta(t: Any) -> Any:
    return t.to("meta") if isinstance(t, torch.Tensor) else t


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created inside the mode and alive at once, checked after every operator. `exclude`:
    tensors whose storages never count (a model's weights: an operator's output can be a view of one, `t()`)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self.ref = StorageWeakRef
        self.live: dict[int, tuple[Any, int]] = {}
        self.current = self.peak = 0
        self.excluded = {t.untyped_storage()._cdata for t in exclude}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (r, _) in self.live.items() if r.expired()]:
            self.current -= self.live.pop(key)[1]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage._cdata not in self.live and storage._cdata not in self.excluded:
                    self.live[storage._cdata] = (self.ref(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def peak_live_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    with LiveBytes() as meter, FastBf16():
        result = fn()
    return meter.peak, result


# --- saved activations per block ------------------------------------------------------------------------


class SavedBytes:
    """Bytes autograd saves, by the block (or 'outside') that was running, each storage once."""

    def __init__(self, model: torch.nn.Module, stacks: tuple[str, ...]):
        self.exclude = {p.untyped_storage()._cdata for p in model.parameters()}
        self.seen: set[int] = set()
        self.by: dict[str, int] = {"outside": 0}
        self.running: list[str] = []
        self.handles = []
        self.labels: dict[torch.nn.Module, str] = {}
        for stack in stacks:
            for index, block in enumerate(getattr(model, stack, [])):
                label = f"{stack}.{index}"
                self.labels[block] = label
                self.by[label] = 0
                self.handles.append(block.register_forward_pre_hook(lambda m, a, label=label: self.running.append(label)))
                self.handles.append(block.register_forward_hook(lambda m, a, o: self.running.pop() and None))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            key = t.untyped_storage()._cdata
            if key not in self.exclude and key not in self.seen:
                self.seen.add(key)
                self.by[self.running[-1] if self.running else "outside"] += t.untyped_storage().nbytes()
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class KeptBytes(SavedBytes):
    """SavedBytes, counting only what autograd still holds when `kept` is asked (after the forward: the loss's
    graph). A tensor saved by a graph that dies inside the forward is transient, not an activation: peft's DoRA
    builds B·A through lora_A(eye) with gradients on, then only uses it detached (peft/tuners/lora/dora.py)."""

    def __init__(self, model: torch.nn.Module, stacks: tuple[str, ...]):
        super().__init__(model, stacks)
        from torch.multiprocessing.reductions import StorageWeakRef

        self.ref = StorageWeakRef
        self.held: dict[int, tuple[Any, int, str]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self.exclude and (key not in self.held or self.held[key][0].expired()):
                label = self.running[-1] if self.running else "outside"
                self.held[key] = (self.ref(storage), storage.nbytes(), label)
        return t

    def kept(self) -> dict[str, int]:
        out = dict.fromkeys(self.by, 0)
        for ref, size, label in self.held.values():
            if not ref.expired():
                out[label] += size
        return out


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Skip torch.nn.init while a model is built: its weights are filled with noise afterwards anyway."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def build_real(arch: Any, **changes: Any) -> torch.nn.Module:
    """The transformer for real on the CPU (a meta model lacks the tables a module computes at init, such as
    Lumina2's rotary frequencies), in the dtypes from_pretrained(bf16) gives, weights filled as bench_memory does."""
    import diffusers

    from difftune import bench_memory as real
    from difftune.memory_plan.architecture import TRANSFORMER_CLASS

    cls = getattr(diffusers, TRANSFORMER_CLASS[arch.family])
    config = {**arch.config, **changes}
    if arch.family != "lumina2":
        config.setdefault("attention_type", "regular")
    with no_init():
        model = cls.from_config(config)
    # diffusers' own `to` warns about its fp32 modules (printed in the middle of the wizard): kept just below
    torch.nn.Module.to(model, torch.bfloat16)
    for name, module in model.named_modules():  # diffusers' _keep_in_fp32_modules rule (bench_memory.on_meta)
        if any(k in name.split(".") for k in getattr(model, "_keep_in_fp32_modules", None) or []):
            module.to(torch.float32)
    chunk = torch.randn(real.CHUNK, generator=torch.Generator().manual_seed(0)).mul_(0.02)
    with torch.no_grad():
        for p in model.parameters():
            real.fill(p.data, chunk.to(p.dtype))
    return model


def reduced_model(arch: Any, mode: str, rank: int = 16, dora: bool = False) -> torch.nn.Module:
    """The architecture at real width with 2 blocks per stack, random weights, the adapter as training has it
    (`dora`: peft's use_dora, as adapters/kinds.py attaches it)."""
    fewer = {"num_layers": 2, "num_refiner_layers": 2} if arch.family == "lumina2" else \
        {"num_text_blocks": 2, "num_visual_blocks": 2}
    model = build_real(arch, **fewer)
    model.train()
    if mode == "lora":
        from peft import LoraConfig

        from difftune.adapters.casts import skip_casts_under_autocast
        from difftune.models import get_family

        targets = get_family(arch.family).lora_target_modules
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, use_dora=dora,
                                     target_modules=targets if isinstance(targets, str) else list(targets)))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        skip_casts_under_autocast(model)  # as the trainer's LoRA (adapters/casts.py)
    else:
        model.requires_grad_(True)
    return model


def inputs(family: str, config: dict[str, Any], latent: tuple[int, int, int], text: int, batch: int = 1) -> dict:
    """Latents [B, C, (T,) h, w] and the text dict the family's `predict` takes, as the cache holds them."""
    frames, h, w = latent
    g = torch.Generator().manual_seed(0)
    if family == "lumina2":
        noisy = torch.randn(batch, config["in_channels"], h, w, generator=g)
        embeds = {"prompt_embeds": torch.randn(batch, text, config["cap_feat_dim"], generator=g),
                  "attention_mask": torch.ones(batch, text, dtype=torch.bool)}
    else:
        shape = (batch, config["out_visual_dim"], frames, h, w) if family == "kandinsky5-video" else \
            (batch, config["out_visual_dim"], h, w)
        noisy = torch.randn(*shape, generator=g)
        embeds = {"prompt_embeds": torch.randn(batch, text, config["in_text_dim"], generator=g),
                  "pooled": torch.randn(batch, config["in_text_dim2"], generator=g)}
    return {"noisy": noisy.bfloat16(), "text": embeds}


def image_tokens(family: str, config: dict[str, Any], latent: tuple[int, int, int]) -> int:
    frames, h, w = latent
    patch = config.get("patch_size", 2)
    p = patch[-1] if isinstance(patch, list | tuple) else patch
    return (frames if family == "kandinsky5-video" else 1) * (h // p) * (w // p)


def saved_by_block(arch: Any, model: torch.nn.Module, latent: tuple[int, int, int], text: int, checkpointing: bool,
                   batch: int = 1, backward: bool = False, compute: bool = True, kept: bool = False) -> dict[str, int]:
    """{'<stack>.<i>' or 'outside': saved bytes} of one training forward of `model` (and its backward if asked).
    `compute` False: the heavy operators give zeros of the right shape (ShapesOnly). `kept`: only what the loss's
    graph still holds after the forward (KeptBytes), not what transient graphs saved on the way."""
    from difftune.memory_plan.architecture import STACKS
    from difftune.models import get_family

    family = get_family(arch.family)
    meter = (KeptBytes if kept else SavedBytes)(model, STACKS[arch.family])
    if checkpointing:
        model.enable_gradient_checkpointing()
        checkpoint = model._gradient_checkpointing_func

        def labelled(block: torch.nn.Module, *args: Any) -> Any:  # the saved inputs belong to the block
            meter.running.append(meter.labels[block])
            try:
                return checkpoint(block, *args)
            finally:
                meter.running.pop()

        model._gradient_checkpointing_func = labelled
    else:
        model.disable_gradient_checkpointing()
    data = inputs(arch.family, arch.config, latent, text, batch)
    sigmas = torch.full((batch,), 0.5)
    try:
        with (FastBf16() if compute else ShapesOnly()), torch.autocast("cpu", dtype=torch.bfloat16), \
                torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
            # image-to-image: the network takes the input image's latents beside the noisy ones (video's predict
            # fills its own conditioning channels in)
            cond = {"conditioning": torch.zeros_like(data["noisy"])} \
                if arch.family == "kandinsky5-image" and arch.config.get("visual_cond") else {}
            out = family.predict(model, data["noisy"], sigmas, data["text"], **cond)
            loss = out.float().square().mean()
        if kept:
            meter.by = meter.kept()
        if backward:
            with (FastBf16() if compute else ShapesOnly()):
                loss.backward()
    finally:
        meter.close()
    return meter.by


def per_stack(by: dict[str, int]) -> dict[str, int]:
    """Per-block bytes of each stack (its second block) and 'outside' (everything else, incl. shared tensors)."""
    stacks = {label.rsplit(".", 1)[0] for label in by if label != "outside"}
    out = {}
    total = sum(by.values())
    for stack in stacks:
        indices = sorted(int(label.rsplit(".", 1)[1]) for label in by if label.startswith(stack + "."))
        out[stack] = by[f"{stack}.{indices[-1]}"]
    out["outside"] = total - sum(out[s] * len([k for k in by if k.startswith(s + ".")]) for s in stacks)
    return out


def fit(samples: list[tuple[int, int, dict[str, int]]]) -> dict[str, tuple[float, float, float]]:
    """Per stack: bytes = a * image_tokens + b * text_tokens + c (c: what a block saves whatever the tokens, such
    as its modulation vectors) -> {stack: (a, b, c)}, least squares over the samples."""
    out = {}
    for stack in samples[0][2]:
        x = torch.tensor([[float(n), float(t), 1.0] for n, t, _ in samples], dtype=torch.float64)
        y = torch.tensor([[float(s[stack])] for _, _, s in samples], dtype=torch.float64)
        solution = torch.linalg.lstsq(x, y).solution.flatten().tolist()
        out[stack] = tuple(round(v, 1) for v in solution)
    return out


# token layouts measured: (latent (frames, h, w), text tokens). Three layouts fix (a, b, c) of each stack; activations
# are linear in tokens (flash attention), which tests/test_memory_plan.py checks on a third, larger layout.
FIT_LAYOUTS = [((1, 32, 32), 64), ((1, 48, 48), 64), ((1, 32, 32), 256)]  # Lumina2 rope: text < 300
CHECK_LAYOUT = ((1, 64, 64), 192)


def calibrate(arch: Any, layouts=FIT_LAYOUTS, say=print, compute: bool = False,
              keys: tuple[str, ...] = ("lora", "checkpointed", "full")) -> dict[str, dict[str, tuple[float, ...]]]:
    """{'lora'|'checkpointed'|'full': {stack: (a, b, c)}} for one architecture. 'checkpointed' is measured with
    LoRA: a checkpointed block saves its inputs only, whatever trains."""
    result = {}
    for mode, checkpointing, key in (("lora", False, "lora"), ("lora", True, "checkpointed"), ("full", False, "full")):
        if key not in keys:
            continue
        model = reduced_model(arch, mode)
        samples = []
        for latent, text in layouts:
            started = time.perf_counter()
            by = per_stack(saved_by_block(arch, model, latent, text, checkpointing, compute=compute))
            samples.append((image_tokens(arch.family, arch.config, latent), text, by))
            say(f"  {arch.name} {key} latent={latent} text={text}: "
                f"{ {k: round(v / 2**20, 2) for k, v in by.items()} } MiB ({time.perf_counter() - started:.1f} s)",
                flush=True)
        result[key] = fit(samples)
        del model
    return result


def vae_per_pixel(video: bool, say=print) -> dict[str, float]:
    """Peak live bytes above the weights of one image's (one clip's) VAE encode and decode, per pixel (per
    pixel-frame), at real channel widths, bf16, no grad; the video VAE with the family's framewise and tiling
    settings."""
    import diffusers

    from difftune.memory_plan.architecture import FLUX_VAE

    with no_init():
        vae = diffusers.AutoencoderKLHunyuanVideo() if video else diffusers.AutoencoderKL(**FLUX_VAE)
    vae.to(torch.bfloat16).eval()
    if video:
        from difftune.models.kandinsky5_video import configure_vae

        configure_vae(vae)
    out = {}
    for what in ("encode", "decode"):
        rates = []
        # the video VAE at small clips: its working set is per pixel-frame, and a 256 px 17-frame clip needed
        # more CPU memory than this machine had free (the process was killed at 20 GB)
        for side, frames in (((64, 9), (96, 9), (64, 17)) if video else ((256, 0), (384, 0))):
            shape = (1, 3, frames, side, side) if video else (1, 3, side, side)
            latent = (1, 16, (frames - 1) // 4 + 1, side // 8, side // 8) if video else (1, 16, side // 8, side // 8)
            x = torch.zeros(shape if what == "encode" else latent, dtype=torch.bfloat16)
            started = time.perf_counter()
            with torch.no_grad(), LiveBytes() as meter, ShapesOnly():
                vae.encode(x) if what == "encode" else vae.decode(x)
            pixels = side * side * (frames or 1)
            rates.append(meter.peak / pixels)
            say(f"  VAE {'video' if video else 'image'} {what} {side}px: peak {meter.peak / 2**20:.1f} MiB "
                f"({time.perf_counter() - started:.1f} s)", flush=True)
        out[what] = round(max(rates), 2)
    return out


def encoder_working_set(config: Any, dtype: torch.dtype, size: int) -> tuple[int, int]:
    """(bytes per image, bytes whatever the count) of a CREPA encoder's no-grad forward at size x size pixels
    (train/crepa.py): the peak of live tensors above its weights. Built by the AutoModel class of `config` at real
    width with 2 layers (a layer's working set does not depend on the depth: the tests check it against a whole
    model computed for real), run under ShapesOnly at 1 and 2 images, so that the count's share and the rest (such
    as the interpolated position table) come apart. The input pixels are not counted (the caller adds them). Seconds
    on the CPU for the largest DINOv2."""
    from transformers import AutoModel

    fewer = copy.deepcopy(config)
    fewer.num_hidden_layers = min(2, config.num_hidden_layers)
    with no_init():
        model = AutoModel.from_config(fewer)
    model.to(dtype).eval()
    peaks = []
    for count in (1, 2):
        x = torch.zeros(count, 3, size, size, dtype=dtype)
        with torch.no_grad(), LiveBytes(exclude=[*model.parameters(), *model.buffers()]) as meter, ShapesOnly():
            model(pixel_values=x)
        peaks.append(meter.peak)
    return peaks[1] - peaks[0], 2 * peaks[0] - peaks[1]


def main(argv: list[str] | None = None) -> None:
    from difftune.memory_plan.architecture import Architecture, real_architecture

    parser = argparse.ArgumentParser(description="re-measure memory_plan/coefficients.py (CPU, minutes)")
    parser.add_argument("--only", nargs="*", help="architecture names (substrings)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    table = {}
    for family, flavour in (("lumina2", "2.0"), ("kandinsky5-image", "t2i-lite-sft"),
                            ("kandinsky5-video", "t2v-lite-sft-5s"), ("kandinsky5-video", "t2v-pro-sft-5s-hd")):
        name, config = real_architecture(family, flavour)
        if args.only and not any(s in name for s in args.only):
            continue
        arch = Architecture(family, name, config, known=True)
        table[name] = calibrate(arch)
        print(f"{name!r}: {table[name]!r},", flush=True)
    if not args.only or any("VAE" in s for s in args.only):
        vae = {"FLUX": vae_per_pixel(False), "HunyuanVideo": vae_per_pixel(True)}
        print(f"VAE = {vae!r}")
    print("COEFFICIENTS = {")
    for name, entry in table.items():
        print(f"    {name!r}: {entry!r},")
    print("}")


if __name__ == "__main__":
    main()
