"""Attention kernels (`attention_mechanism`, `sageattention_usage`): which one a run uses, and putting it in place.

`choose` is a pure function of the key, the device (type and CUDA capability), the attention packages diffusers
can use, the compute dtypes and whether the model needs flex attention; `check` runs it right after the
Accelerator is built (before any model loads), `apply` again once the transformer is loaded, then installs it.

- 'auto': on CUDA with bf16/fp16 compute, FlashAttention 3 (`_flash_3`) on capability 9.x when
  flash_attn_interface is usable, else FlashAttention 2 (`flash`) on >= 8.0 when flash-attn is; everywhere
  else torch SDPA (`native`, torch picks its kernel). Training and validation are chosen apart: validation
  samples in the weights' dtype (no autocast), so fp32 weights under bf16 autocast train with flash and sample
  with SDPA.
- Kandinsky 5 attention goes through diffusers' `dispatch_attention_fn`: the model's public
  `set_attention_backend` sets it (diffusers only checks the package there, never the device, hence our
  device table). That call also sets diffusers' process-wide default backend; we restore it.
  A Kandinsky 5 model with `attention_type: nabla` (the 10s models) hands a flex `BlockMask` to the
  dispatcher, which only flex attention takes: 'auto' is flex there, any other explicit choice an error.
- Lumina2's processor calls `F.scaled_dot_product_attention` itself. For any backend but `native`, each
  attention module gets `RoutedProcessor`, which runs the stock processor unchanged inside a
  `TorchFunctionMode` that sends its one SDPA call to `dispatch_attention_fn` (the backend's kernel, and
  `sdpa_kernel` for the native sub-kernels). No diffusers code is copied.
- Lumina2's caption mask: `context_refiner` always receives the caption mask, and a mask keeps SDPA off its
  flash kernel. The captions of a batch are padded to the longest one (models/lumina2.py collate_text), so
  when they are all as long, the mask is all true: a hook on the rope embedder reads the caption lengths that
  diffusers has already brought to the host (`.tolist()` in its forward; no further sync), marks such a mask
  on the tensor itself, and a pre-hook on each `context_refiner` block passes None instead. The mark travels
  with the tensor, so a checkpointed block's recomputation sees the same call. The joint `layers` already get
  no mask when the caption lengths are equal. Results are identical (an all-true mask masks nothing).
  Decision, batches of unequal captions: the mask stays. On CUDA, SDPA then runs its memory-efficient kernel
  (masks allowed; not the math kernel), and backends without masks (flash-attn, FlashAttention 3, torch's
  flash, cuDNN, SageAttention) hand those masked calls to SDPA. Bucketing batches by caption length was not
  chosen: batch composition comes from the resumable, seeded sampler, and with batch size 1 (the common
  case) every caption is full length anyway.
- `sageattention` (no backward pass): validation only; training uses what 'auto' picks. `sampling(model)` is
  the context validation samples in.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_lumina2 import (
    Lumina2AttnProcessor2_0,
    Lumina2Transformer2DModel,
)
from torch.overrides import TorchFunctionMode

from difftune.config.load import ConfigError
from difftune.config.speed_keys import ATTENTION_BACKENDS, HALF_ONLY

NATIVE = "native"
SAGE = "sage"
FLEX = "flex"
STATE = "_difftune_attention"  # the model attribute `sampling` finds the installed Attention under
FULL_CAPTION = "_difftune_full_caption"  # set on a Lumina2 caption mask that masks nothing

# diffusers backend -> what the info line calls it
LABELS = {
    NATIVE: "torch SDPA", "flash": "FlashAttention 2 (flash-attn)", "_flash_3": "FlashAttention 3",
    FLEX: "flex attention", SAGE: "SageAttention", "_native_cudnn": "torch SDPA (cuDNN kernel)",
    "_native_flash": "torch SDPA (flash kernel)", "_native_efficient": "torch SDPA (memory-efficient kernel)",
    "_native_math": "torch SDPA (math kernel)",
}
# diffusers backend -> the package it needs (the names diffusers imports)
PACKAGES = {"flash": "flash_attn", "_flash_3": "flash_attn_interface", SAGE: "sageattention"}
# Backends that take bf16/fp16 only on CUDA (torch's flash kernel also runs fp32 on the CPU).
HALF_ON_CUDA = frozenset({ATTENTION_BACKENDS[m] for m in HALF_ONLY} | {"_native_flash"})
# Backends that take no attention mask: a masked call (Lumina2, unequal captions) goes to torch SDPA instead.
MASKLESS = frozenset({"flash", "_flash_3", "_native_flash", "_native_cudnn", SAGE})
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass(frozen=True)
class Kernel:
    devices: frozenset[str] | None  # device types it runs on; None: any
    min_capability: tuple[int, int] | None = None  # on CUDA
    max_major: int | None = None  # on CUDA: FlashAttention 3 is built for Hopper only
    forward_only: frozenset[str] = frozenset()  # device types where it has no backward pass (validation only)


# Where each backend runs (measured on the CPU here: torch's flash kernel runs there, and flex attention without
# a backward pass; torch's memory-efficient and cuDNN kernels do not).
KERNELS = {
    NATIVE: Kernel(None),
    "_native_math": Kernel(None),
    "_native_flash": Kernel(frozenset({"cuda", "cpu"}), (8, 0)),
    "_native_efficient": Kernel(frozenset({"cuda"}), (5, 0)),
    "_native_cudnn": Kernel(frozenset({"cuda"}), (8, 0)),
    FLEX: Kernel(frozenset({"cuda", "cpu"}), forward_only=frozenset({"cpu"})),
    "flash": Kernel(frozenset({"cuda"}), (8, 0)),
    "_flash_3": Kernel(frozenset({"cuda"}), (9, 0), max_major=9),
    SAGE: Kernel(frozenset({"cuda"}), (8, 0)),
}


class AttentionError(ConfigError):
    """An attention_mechanism the run cannot use, with the fix (`difftune train` says it without a traceback)."""

    def __init__(self, message: str) -> None:
        super().__init__([message])


@dataclass(frozen=True)
class Device:
    type: str  # "cuda", "cpu", "mps", ...
    capability: tuple[int, int] | None = None  # CUDA compute capability

    @classmethod
    def of(cls, device: torch.device | str) -> Device:
        device = torch.device(device)
        if device.type == "cuda":
            return cls("cuda", tuple(torch.cuda.get_device_capability(device)))
        return cls(device.type)

    def describe(self) -> str:
        if self.capability is None:
            return f"{self.type} device"
        return f"CUDA device of compute capability {self.capability[0]}.{self.capability[1]}"


@dataclass(frozen=True)
class Choice:
    train: str  # diffusers backend names (AttentionBackendName values)
    sample: str

    def describe(self, mechanism: str) -> str:
        text = f"attention: {LABELS[self.train]} for training"
        text += " and validation" if self.sample == self.train else f", {LABELS[self.sample]} for validation"
        return text + f" (attention_mechanism {mechanism!r})"


def installed() -> frozenset[str]:
    """The attention packages diffusers' dispatcher can use (its own import and version checks)."""
    from diffusers.models import attention_dispatch as dispatch

    usable = {"flash_attn": "_CAN_USE_FLASH_ATTN", "flash_attn_interface": "_CAN_USE_FLASH_ATTN_3",
              "sageattention": "_CAN_USE_SAGE_ATTN"}
    return frozenset(package for package, flag in usable.items() if getattr(dispatch, flag, False))


def auto(device: Device, packages: frozenset[str] | set[str], half: bool) -> str:
    """The fastest backend that trains: FlashAttention 3 on Hopper, then FlashAttention 2, then torch SDPA."""
    if device.type != "cuda" or not half or device.capability is None:
        return NATIVE
    if device.capability[0] == 9 and "flash_attn_interface" in packages:
        return "_flash_3"
    if device.capability >= (8, 0) and "flash_attn" in packages:
        return "flash"
    return NATIVE


def _refusal(mechanism: str, backend: str, device: Device, packages: frozenset[str] | set[str],
             half: bool, where: str) -> str | None:
    """Why `backend` cannot run `where` ('training' or 'validation'), or None."""
    kernel = KERNELS[backend]
    cap = device.capability
    if kernel.devices is not None and device.type not in kernel.devices:
        names = {"cuda": "a CUDA GPU", "cpu": "the CPU"}
        needs = " or ".join(names[d] for d in ("cuda", "cpu") if d in kernel.devices)
        return f"attention_mechanism {mechanism!r} needs {needs}, and this run is on a {device.describe()}"
    if device.type == "cuda" and cap is not None:
        low = kernel.min_capability is not None and cap < kernel.min_capability
        if low or (kernel.max_major is not None and cap[0] > kernel.max_major):
            wanted = f"{kernel.min_capability[0]}.x" if kernel.max_major else \
                f">= {kernel.min_capability[0]}.{kernel.min_capability[1]}"
            return f"attention_mechanism {mechanism!r} needs a GPU of compute capability {wanted}, and this run is " \
                   f"on a {device.describe()}"
    if where == "training" and device.type in kernel.forward_only:
        return f"attention_mechanism {mechanism!r} has no backward pass on a {device.describe()}, so it cannot train there"
    package = PACKAGES.get(backend)
    if package is not None and package not in packages:
        return f"attention_mechanism {mechanism!r} needs the {package} package, which diffusers cannot use here " \
               "(not installed, or too old)"
    if backend in HALF_ON_CUDA and device.type == "cuda" and not half:
        return f"attention_mechanism {mechanism!r} needs bf16/fp16 tensors, and {where} computes in fp32"
    return None


def choose(mechanism: str, device: Device, packages: frozenset[str] | set[str], *, nabla: bool = False,
           train_half: bool = True, sample_half: bool = True) -> Choice:
    """The backends for training and for validation sampling, or an AttentionError naming the key and the fix.

    `train_half` / `sample_half`: whether training (under autocast) and validation (in the weights' dtype)
    compute in bf16/fp16. `nabla`: the model's attention mask is a flex BlockMask (Kandinsky 5 NABLA)."""
    if mechanism not in ATTENTION_BACKENDS:
        raise AttentionError(f"attention_mechanism {mechanism!r} is not known; choose one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
    if nabla:
        if mechanism not in ("auto", "flex"):
            raise AttentionError(
                f"attention_mechanism {mechanism!r} cannot run this Kandinsky 5 model's sparse NABLA attention "
                "(attention_type 'nabla', the 10s models): its mask is a flex attention BlockMask, which only flex "
                "attention takes; use attention_mechanism 'auto' or 'flex'")
        choice = Choice(FLEX, FLEX)
    elif mechanism == "auto":
        choice = Choice(auto(device, packages, train_half), auto(device, packages, sample_half))
    elif mechanism == "sageattention":  # no backward pass: sampling only (sageattention_usage 'inference')
        choice = Choice(auto(device, packages, train_half), SAGE)
    else:
        backend = ATTENTION_BACKENDS[mechanism]
        choice = Choice(backend, backend)
    checks = [(choice.sample, sample_half, "validation")]
    if mechanism != "sageattention":  # training runs the 'auto' pick, which always runs
        checks.insert(0, (choice.train, train_half, "training"))
    for backend, half, where in checks:
        why = _refusal(mechanism, backend, device, packages, half, where)
        if why is not None:
            raise AttentionError(f"{why}; use attention_mechanism 'auto'")
    return choice


def compute_halves(cfg: Any) -> tuple[bool, bool]:
    """(training, validation) compute in bf16/fp16: training under mixed_precision autocast or half weights,
    validation in the weights' own dtype (validation.plain_forward takes the autocast off)."""
    weights_half = cfg.weight_dtype_name() in ("bf16", "fp16")
    return weights_half or cfg.mixed_precision in ("bf16", "fp16"), weights_half


def check(cfg: Any, device: torch.device) -> None:
    """Refuse an attention_mechanism this device cannot run, before any model loads (the NABLA check needs the
    loaded transformer's config: `apply`)."""
    train_half, sample_half = compute_halves(cfg)
    choose(cfg.attention_mechanism, Device.of(device), installed(), train_half=train_half, sample_half=sample_half)


# ----- putting a backend in place -----


class ToBackend(TorchFunctionMode):
    """Sends torch SDPA calls to diffusers' `dispatch_attention_fn` with `backend` ([B, H, L, D] <-> [B, L, H, D])."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        from diffusers.models.attention_dispatch import AttentionBackendName

        self.backend = AttentionBackendName(backend)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = dict(zip(SDPA_ARGS, args, strict=False)) | kwargs
        mask = call.get("attn_mask")
        unusual = call.get("dropout_p", 0.0) or call.get("is_causal") or call.get("enable_gqa")
        if unusual or (mask is not None and self.backend.value in MASKLESS):
            return func(*args, **kwargs)  # torch picks a kernel that takes it (memory-efficient on CUDA)
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        q, k, v = (call[name].transpose(1, 2) for name in ("query", "key", "value"))
        out = dispatch_attention_fn(q, k, v, attn_mask=mask, scale=call.get("scale"), backend=self.backend)
        return out.transpose(1, 2)


@dataclass
class Route:
    backend: str = NATIVE


class RoutedProcessor:
    """Lumina2's stock processor, run as it is, with its SDPA call sent to `route.backend`."""

    def __init__(self, stock: Any, route: Route) -> None:
        self.stock = stock
        self.route = route

    def __call__(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.route.backend == NATIVE:
            return self.stock(attn, *args, **kwargs)
        with ToBackend(self.route.backend):
            return self.stock(attn, *args, **kwargs)


# diffusers' Attention passes a processor only the keyword arguments its __call__'s signature names.
RoutedProcessor.__call__.__signature__ = inspect.signature(Lumina2AttnProcessor2_0.__call__)  # type: ignore[attr-defined]


def drop_full_caption_masks(transformer: Any) -> list[Any]:
    """Lumina2: `context_refiner` runs without its caption mask when every caption of the batch is full length."""

    def mark(module: Any, args: tuple, output: tuple) -> None:
        mask, lengths = args[1], output[4]  # rope_embedder(hidden_states, attention_mask) -> (..., cap lengths, ...)
        if all(n == mask.shape[1] for n in lengths):
            setattr(mask, FULL_CAPTION, True)

    def unmask(block: Any, args: tuple) -> tuple | None:
        if len(args) > 1 and getattr(args[1], FULL_CAPTION, False):
            return (args[0], None, *args[2:])
        return None

    handles = [transformer.rope_embedder.register_forward_hook(mark)]
    handles += [block.register_forward_pre_hook(unmask) for block in transformer.context_refiner]
    return handles


@contextmanager
def _quiet_diffusers() -> Iterator[None]:
    """set_attention_backend warns that backends are experimental on every call."""
    log = logging.getLogger("diffusers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@dataclass
class Attention:
    """The backends of a run, installed on its transformer."""

    choice: Choice
    use: Callable[[str], None]  # puts a backend in place on the model
    handles: list[Any]

    def remove(self, transformer: Any) -> None:
        """Back to torch SDPA with every mask, as loaded."""
        self.use(NATIVE)
        for handle in self.handles:
            handle.remove()
        for module in transformer.modules():
            if isinstance(getattr(module, "processor", None), RoutedProcessor):
                module.set_processor(module.processor.stock)
        delattr(transformer, STATE)


def _dispatching(transformer: Any) -> bool:
    """Whether the model's attention goes through diffusers' dispatcher (its processors name a backend)."""
    return any(hasattr(getattr(m, "processor", None), "_attention_backend") for m in transformer.modules())


def install(transformer: Any, choice: Choice) -> Attention:
    """Put `choice.train` in place on `transformer` (Kandinsky 5 or Lumina2)."""
    handles: list[Any] = []
    if isinstance(transformer, Lumina2Transformer2DModel):
        handles = drop_full_caption_masks(transformer)
        route = Route()
        if {choice.train, choice.sample} != {NATIVE}:
            for module in transformer.modules():
                processor = getattr(module, "processor", None)
                stock = processor.stock if isinstance(processor, RoutedProcessor) else processor  # installed again
                if isinstance(stock, Lumina2AttnProcessor2_0):
                    module.set_processor(RoutedProcessor(stock, route))

        def use(backend: str) -> None:
            route.backend = backend
    elif _dispatching(transformer):
        from diffusers import attention_backend

        def use(backend: str) -> None:
            # set_attention_backend also makes `backend` diffusers' process-wide default; the context
            # manager puts the default back on exit (other models, later runs in this process).
            with _quiet_diffusers(), attention_backend(NATIVE):
                transformer.set_attention_backend(backend)
    elif {choice.train, choice.sample} != {NATIVE}:
        raise AttentionError(f"attention_mechanism other than 'auto' or 'native' is not supported for "
                             f"{type(transformer).__name__}; use 'auto'")
    else:
        def use(backend: str) -> None:
            return None
    use(choice.train)
    attention = Attention(choice, use, handles)
    setattr(transformer, STATE, attention)
    return attention


def apply(cfg: Any, transformer: Any, device: torch.device, emit: Callable[..., None]) -> Attention:
    """Choose (with the loaded transformer's config) and install the run's attention; one "info" event says which."""
    train_half, sample_half = compute_halves(cfg)
    nabla = getattr(getattr(transformer, "config", None), "attention_type", None) == "nabla"
    choice = choose(cfg.attention_mechanism, Device.of(device), installed(), nabla=nabla, train_half=train_half,
                    sample_half=sample_half)
    attention = install(transformer, choice)
    emit("info", message=choice.describe(cfg.attention_mechanism))
    return attention


@contextmanager
def sampling(model: Any) -> Iterator[None]:
    """Validation sampling with the validation backend (SageAttention with attention_mechanism 'sageattention')."""
    attention = getattr(model, STATE, None)
    if attention is None or attention.choice.sample == attention.choice.train:
        yield
        return
    attention.use(attention.choice.sample)
    try:
        yield
    finally:
        attention.use(attention.choice.train)
