"""The optimizers a run can train with: `build_optimizer(name, params, ...)`.

Import-light on purpose: this module imports neither torch nor any optimizer library at import time,
so `config/schema.py` can read `OPTIMIZERS` (name -> one-line description) and still fail a bad config
in milliseconds. Each library is imported only when its optimizer is built (bitsandbytes alone takes
seconds to import).

Every name takes the same five settings (learning_rate, betas, weight_decay, eps), which map onto the
libraries as follows:

- `adamw`: `torch.optim.AdamW`. Its state follows the weights' dtype.
- `adamw_bf16`: `optimi.AdamW(kahan_sum=True)` from torch-optimi. On bf16 or fp16 weights it keeps a
  Kahan compensation buffer (one more tensor the size of the weights, in their dtype) that holds the
  part of each update too small for bf16, so many tiny updates add up instead of rounding away. It is
  deterministic (no stochastic rounding), so a resumed run repeats the uninterrupted one exactly. On
  fp32 weights no buffer is made and it is plain AdamW. (optimi would switch Kahan summation on by
  itself for low-precision weights, since its default is `kahan_sum=None`; we pass True so the name
  keeps its meaning.) Its moment estimates are kept in the weights' dtype, as torch's AdamW does.
- `optimi-adamw`: `optimi.AdamW` with its defaults: Kahan summation only on bf16/fp16 weights, the
  Triton kernel on CUDA when Triton is installed, a for-loop elsewhere.
- `optimi-stableadamw`: `optimi.StableAdamW` (AdamW with per-tensor update clipping, like AdaFactor,
  and eps inside the square root of the RMS), with the same defaults as `optimi-adamw`.
- `lion`: `lion_pytorch.Lion`. It has no epsilon, so `eps` is ignored. Lion's updates are signs, so
  it wants a learning rate 3-10x smaller than AdamW's, and a weight decay 3-10x larger.
- `optimi-lion`: `optimi.Lion` from torch-optimi (like `lion`, no epsilon; Kahan summation on bf16/fp16
  weights, the Triton kernel on CUDA when Triton is installed).
- `prodigy`: `prodigyopt.Prodigy`. Prodigy estimates the step size itself, and `lr` multiplies that
  estimate, so 1.0 is the usual value. The learning rate given is passed through unchanged (a warning
  is emitted when it is below 0.1, because a typical AdamW rate such as 1e-4 makes Prodigy nearly
  stand still). Weight decay is decoupled (AdamW-style, Prodigy's default).
- `adamw8bit`: `bitsandbytes.optim.AdamW8bit`. Both moments are stored in 8 bits with block-wise
  quantisation for every tensor of at least 4096 elements; smaller tensors keep 32-bit state
  (bitsandbytes' `min_8bit_size`). bitsandbytes 0.50 runs it on the CPU as well as on CUDA.

SimpleTuner's names for the same implementations are accepted as aliases (`OPTIMIZER_ALIASES`):
`torch-adamw` is `adamw`, `bnb-adamw8bit` is `adamw8bit`.

`clip_gradients` applies `max_grad_norm` by norm or by value (`grad_clip_method`).

All of them are `torch.optim.Optimizer`s whose `state_dict()` survives `torch.save` then
`torch.load(weights_only=True)`, and loading it into a freshly built optimizer continues exactly where
the saved one was (tests/test_optimizers.py checks this for every name).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

OPTIMIZERS: dict[str, str] = {
    "adamw": "PyTorch AdamW. The reference choice for fp32 weights (LoRA adapters train in fp32).",
    "adamw_bf16": "AdamW with Kahan-compensated updates (torch-optimi), so small updates are not lost on "
    "bf16 weights; same as AdamW on fp32 weights.",
    "lion": "Lion (lion-pytorch): sign updates, half of AdamW's state memory; use a 3-10x smaller "
    "learning rate and larger weight decay than AdamW. adam_epsilon is unused.",
    "optimi-stableadamw": "StableAdamW (torch-optimi): AdamW with per-tensor update clipping, stable "
    "without gradient clipping; Kahan summation on bf16 weights.",
    "optimi-adamw": "AdamW from torch-optimi: a Triton kernel on CUDA, Kahan summation on bf16 weights.",
    "optimi-lion": "Lion from torch-optimi: sign updates like 'lion', with Kahan summation on bf16 weights; "
    "use a 3-10x smaller learning rate than AdamW. adam_epsilon is unused.",
    "prodigy": "Prodigy (prodigyopt): estimates its own step size; learning_rate multiplies it, so set "
    "learning_rate to 1.0.",
    "adamw8bit": "8-bit AdamW (bitsandbytes): optimizer state quantised to 8 bits, about 75% less state "
    "memory than AdamW; tensors under 4096 elements keep 32-bit state.",
}

# SimpleTuner's names -> ours (the same library and class)
OPTIMIZER_ALIASES: dict[str, str] = {"torch-adamw": "adamw", "bnb-adamw8bit": "adamw8bit"}

# Device types each name is known to run on. Others are probed (one real step on a small tensor).
_KNOWN_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class _Spec:
    package: str  # the pip distribution that provides it ("" for torch itself)
    module: str
    build: Callable[..., Any]


def _adamw(mod: Any, params: list, lr: float, betas: tuple, weight_decay: float, eps: float) -> Any:
    return mod.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)


def _optimi(cls: str, kahan_sum: bool | None) -> Callable[..., Any]:
    def build(mod: Any, params: list, lr: float, betas: tuple, weight_decay: float, eps: float) -> Any:
        return getattr(mod, cls)(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps,
                                 kahan_sum=kahan_sum, **_no_triton_off_cuda(params))
    return build


def _no_triton_off_cuda(params: list) -> dict[str, bool]:
    """optimi's StableAdamW (0.3) decides on Triton before it has looked at any parameter, so with a
    CUDA build of torch (which ships Triton) it takes the Triton kernel for CPU tensors and fails ("0
    active drivers"). Off CUDA the for-loop is the only path anyway: say so."""
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return {} if tensors and all(t.is_cuda for t in tensors) else {"triton": False}


def _lion(mod: Any, params: list, lr: float, betas: tuple, weight_decay: float, eps: float) -> Any:
    return mod.Lion(params, lr=lr, betas=betas, weight_decay=weight_decay)


def _prodigy(mod: Any, params: list, lr: float, betas: tuple, weight_decay: float, eps: float) -> Any:
    if lr < 0.1:
        warnings.warn(
            f"prodigy estimates the step size itself and learning_rate multiplies it: 1.0 is usual, "
            f"got {lr:g}, which makes training about {1 / lr:.0f}x slower. It is used as given.",
            UserWarning,
            stacklevel=3,
        )
    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Using decoupled weight decay"
        return mod.Prodigy(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, decouple=True)


def _adamw8bit(mod: Any, params: list, lr: float, betas: tuple, weight_decay: float, eps: float) -> Any:
    return mod.optim.AdamW8bit(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)


_SPECS: dict[str, _Spec] = {
    "adamw": _Spec("", "torch", _adamw),
    "adamw_bf16": _Spec("torch-optimi", "optimi", _optimi("AdamW", kahan_sum=True)),
    "lion": _Spec("lion-pytorch", "lion_pytorch", _lion),
    "optimi-stableadamw": _Spec("torch-optimi", "optimi", _optimi("StableAdamW", kahan_sum=None)),
    "optimi-adamw": _Spec("torch-optimi", "optimi", _optimi("AdamW", kahan_sum=None)),
    "optimi-lion": _Spec("torch-optimi", "optimi", _lion),  # the same signature as lion-pytorch's
    "prodigy": _Spec("prodigyopt", "prodigyopt", _prodigy),
    "adamw8bit": _Spec("bitsandbytes", "bitsandbytes", _adamw8bit),
}
assert set(_SPECS) == set(OPTIMIZERS)


def _check_name(name: str) -> _Spec:
    name = OPTIMIZER_ALIASES.get(name, name)
    if name not in _SPECS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return _SPECS[name]


def _import(name: str) -> Any:
    spec = _check_name(name)
    try:
        return importlib.import_module(spec.module)
    except ImportError as e:
        raise ImportError(
            f"optimizer {name!r} needs the package {spec.package!r} ({e}); install it with "
            f"`pip install {spec.package}`, or choose another optimizer"
        ) from e


def build_optimizer(
    name: str,
    params: Iterable[torch.nn.Parameter],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
) -> torch.optim.Optimizer:
    """The optimizer `name` (a key of OPTIMIZERS) over `params`, with one parameter group.

    Raises ValueError for an unknown name or no parameters, ImportError when the library is missing,
    and RuntimeError when the parameters live on a device the optimizer cannot run on.
    """
    name = OPTIMIZER_ALIASES.get(name, name)
    spec = _check_name(name)
    params = list(params)
    if not params:
        raise ValueError("build_optimizer: no parameters to optimize")
    mod = _import(name)
    for device in sorted({str(p.device) for p in params}):
        reason = _probe(name, device) if device.split(":")[0] not in _KNOWN_DEVICE_TYPES else None
        if reason:
            raise RuntimeError(f"optimizer {name!r} cannot run on {device}: {reason}")
    return spec.build(mod, params, lr, tuple(betas), weight_decay, eps)


@functools.cache
def _probe(name: str, device: str) -> str | None:
    """None if `name` builds and takes a step on `device`, else why not (one line)."""
    try:
        import torch

        mod = _import(name)
        # 4096 elements: the smallest tensor bitsandbytes gives 8-bit state, so its 8-bit kernel runs.
        p = torch.nn.Parameter(torch.zeros(64, 64, device=device))
        p.grad = torch.ones_like(p)
        _SPECS[name].build(mod, [p], 1.0, (0.9, 0.999), 0.0, 1e-8).step()
        if not bool(torch.isfinite(p).all()) or bool((p == 0).all()):
            return "a test step gave no update"
    except Exception as e:  # any failure means "not usable here"; the reason is reported
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}".rstrip(": ")
    return None


def optimizer_support(device: str | torch.device | None = None) -> dict[str, str | None]:
    """For each name: None if it works on `device`, else the reason it does not.

    `device` defaults to the current accelerator ('cuda' when available, else 'cpu'). Each answer comes
    from building the optimizer there and taking one step on a small tensor (cached per process).
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = str(torch.device(device))
    return {name: _probe(name, device) for name in OPTIMIZERS}


def supported_optimizers(device: str | torch.device | None = None) -> list[str]:
    """The names of OPTIMIZERS that work on `device` (default: the current accelerator, else the CPU)."""
    return [name for name, reason in optimizer_support(device).items() if reason is None]


def clip_gradients(accelerator: Any, params: list, max_grad_norm: float | None, method: str = "norm") -> Any:
    """Apply `max_grad_norm` and return the gradients' global norm before clipping (measured in any case,
    so a non-finite gradient is seen). 'norm': scale all gradients so their global norm is at most
    max_grad_norm. 'value': clamp each element to [-max_grad_norm, max_grad_norm]."""
    if method not in ("norm", "value"):
        raise ValueError(f"grad_clip_method {method!r}: use 'norm' or 'value'")
    limit = max_grad_norm if max_grad_norm is not None else math.inf
    norm = accelerator.clip_grad_norm_(params, limit if method == "norm" else math.inf)  # inf: only measures
    if method == "value" and math.isfinite(limit):
        accelerator.clip_grad_value_(params, limit)
    return norm
