"""The optimizers a run can train with: `build_optimizer(name, params, ...)`.

Import-light on purpose: this module imports neither torch nor any optimizer library at import time,
so `config/schema.py` can read `OPTIMIZERS` (name -> one-line description) and `setting_problem` (the
checks of `optimizer_config`) and still fail a bad config in milliseconds. Each library is imported only
when its optimizer is built (bitsandbytes alone takes seconds to import).

Every name takes the same five settings (learning_rate, betas, weight_decay, eps). Unset betas, weight_decay
and eps (adam_beta1, adam_beta2, adam_weight_decay, adam_epsilon) are the name's own defaults, SimpleTuner's for
that name (`DEFAULTS`), so the same name trains the same way in both. They map onto the libraries as follows:

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
  estimate, so 1.0 is the usual value. The learning rate given is passed through unchanged (`check`
  and `train` print a note when it is below 0.1, because a typical AdamW rate such as 1e-4 makes Prodigy
  nearly stand still). Weight decay is decoupled (AdamW-style, Prodigy's default). On FSDP2 shards its estimate
  is summed over the processes (train/prodigy_fsdp.py), so it equals one process's.
- `adamw8bit`: `bitsandbytes.optim.AdamW8bit`. Both moments are stored in 8 bits with block-wise
  quantisation for every tensor of at least 4096 elements; smaller tensors keep 32-bit state
  (bitsandbytes' `min_8bit_size`). bitsandbytes 0.50 runs it on the CPU as well as on CUDA.
- `adamw_schedulefree`: `schedulefree.AdamWScheduleFree` (Facebook's schedule_free package; Defazio et al.,
  "The Road Less Scheduled"). Besides AdamW's second moment it keeps z, the plain gradient-step sequence; the
  weights it evaluates are x, a running average of the z's, and the weights the model trains at (where the
  gradients are taken) are y = (1 - beta1) z + beta1 x. There is no first moment: beta1 (adam_beta1) sets that
  interpolation. Weight decay is decoupled and taken at y. Its state is z and the second moment (AdamW's size).
  The averaging does what a decaying learning-rate schedule does, so the rate stays constant: lr_scheduler must
  be 'constant' or 'constant_with_warmup' (config/optimizer_keys.py), and lr_warmup_steps warms up with the
  library's own formula (lr x (k + 1) / W at step k < W), applied by the LR scheduler so that the logged rate is
  the real one; it gives the same numbers as the library's `warmup_steps` (tested). The optimizer starts in
  train mode (the parameters hold y); `eval_weights(run)` puts x into them for validation, CLIP evaluation,
  checkpoints and the saved adapter. `use_ema` averages y, the weights after each step (switching to x at every
  step would copy every weight each step). SimpleTuner's `adamw_schedulefree` is its own subclass with Kahan
  summation (AdamWScheduleFreeKahan) with betas (0.9, 0.999), weight_decay 1e-2 and eps 1e-8 (difftune's
  defaults for the name are the same), lr_warmup_steps as its warm-up, and no LR scheduler (any lr_scheduler is
  ignored; here a decaying one is an error). difftune uses the upstream class, without Kahan summation: on
  bf16 weights (a bf16 full fine-tune) updates below bf16's resolution round away, as with `adamw`.

SimpleTuner's names for the same implementations are accepted as aliases (`OPTIMIZER_ALIASES`):
`torch-adamw` is `adamw`, `bnb-adamw8bit` is `adamw8bit`. SimpleTuner's other names (torch-*, ao-*, optimi-*, bnb-*,
soap, muon) are in train/optimizer_catalog.py, with SimpleTuner's settings for each; OPTIMIZERS lists them after
the names above (`MAIN_OPTIMIZERS`).

`optimizer_config` (config/optimizer_keys.py) passes more constructor arguments: `build_optimizer(...,
settings=)` adds them over difftune's own (they win), and `setting_problem` says at config time why one cannot
be passed: a keyword the class does not take (`KEYWORDS` lists each class's keywords and defaults;
tests/test_optimizers.py checks them against the installed libraries), one that difftune's keys set (lr,
betas, weight_decay, eps; schedule-free's warmup_steps), a value of the wrong type, or one of the few refused.

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
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from difftune.train.optimizer_catalog import (
    KAHAN_NAMES,
    MORE_DEFAULTS,
    MORE_OPTIMIZERS,
    MORE_SPECS,
    OPTIMI_REFUSED,
    REQUIRED,
    STOCHASTIC_ROUNDING,
    Spec,
    settings_of,
)

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
    "adamw_schedulefree": "Schedule-free AdamW (schedulefree): averages its iterates instead of decaying the "
    "learning rate, so lr_scheduler must be 'constant' or 'constant_with_warmup' (lr_warmup_steps still warms "
    "up); samples, checkpoints and the saved adapter use the averaged weights. Start from 1-10x AdamW's "
    "learning_rate (the library's advice). No Kahan summation (use 'adamw_bf16' for a bf16 full fine-tune).",
}
MAIN_OPTIMIZERS = tuple(OPTIMIZERS)  # difftune's own choices; SimpleTuner's other names follow
OPTIMIZERS |= MORE_OPTIMIZERS

# Optimizers whose updates of bf16/fp16 weights keep what rounding drops (Kahan summation, torch-optimi); every
# other one loses small updates in a full fine-tune of such weights, and setup warns (with the one to use instead)
KAHAN = frozenset(("adamw_bf16", "optimi-adamw", "optimi-stableadamw", "optimi-lion")) | KAHAN_NAMES
KAHAN_INSTEAD: dict[str, str] = {  # else 'adamw_bf16'
    "lion": "optimi-lion", **dict.fromkeys(("bnb-lion", "bnb-lion8bit", "bnb-lion-paged", "bnb-lion8bit-paged"),
                                           "optimi-lion"),
    **dict.fromkeys(("torch-adam", "bnb-adam", "bnb-adam8bit", "ao-adamfp8"), "optimi-adam"),
    "torch-radam": "optimi-radam", "torch-sgd": "optimi-sgd"}



def small_update_advice(cfg: Any) -> str | None:
    """What keeps a full fine-tune's small updates of bf16/fp16 weights, when its optimizer rounds them away (None:
    it keeps them, or the weights are fp32, or only an adapter trains)."""
    name = OPTIMIZER_ALIASES.get(cfg.optimizer, cfg.optimizer)
    if cfg.model_type != "full" or cfg.weight_dtype_name() == "fp32" or name in KAHAN:
        return None
    if name in STOCHASTIC_ROUNDING:  # torchao: rounded stochastically, small updates kept on average
        return None if cfg.optimizer_settings().get("bf16_stochastic_round") else \
            "optimizer_config bf16_stochastic_round=true (torchao's stochastic rounding)"
    return f"optimizer '{KAHAN_INSTEAD.get(name, 'adamw_bf16')}' (Kahan summation)"


# SimpleTuner's names -> ours (the same library and class)
OPTIMIZER_ALIASES: dict[str, str] = {"torch-adamw": "adamw", "bnb-adamw8bit": "adamw8bit"}

# Device types each name is known to run on. Others are probed (one real step on a small tensor), and so is CUDA for
# torchao's fp8 states (SimpleTuner offers them from compute capability 9 only).
_KNOWN_DEVICE_TYPES = ("cpu", "cuda")
_PROBED_ON_CUDA = frozenset(("ao-adamfp8", "ao-adamwfp8"))

# optimizer_config keywords that difftune's own keys set, and the key to use instead
CLASHES: dict[str, str] = {"lr": "learning_rate", "betas": "adam_beta1 and adam_beta2",
                           "weight_decay": "adam_weight_decay", "eps": "adam_epsilon"}


def _adam_settings(params: list, lr: float, betas: tuple, weight_decay: float, eps: float) -> dict[str, Any]:
    return {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": eps}


def _optimi_settings(kahan_sum: bool | None) -> Callable[..., dict[str, Any]]:
    return settings_of(True, True, {"kahan_sum": kahan_sum}, optimi=True)


def _lion_settings(params: list, lr: float, betas: tuple, weight_decay: float, eps: float) -> dict[str, Any]:
    return {"lr": lr, "betas": betas, "weight_decay": weight_decay}


def _prodigy_settings(params: list, lr: float, betas: tuple, weight_decay: float, eps: float) -> dict[str, Any]:
    # a learning_rate below 0.1 is used as given; config/optimizer_keys.optimizer_notes says what it does
    return {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": eps, "decouple": True}


# The constructors' keywords after `params` and their defaults, as the pinned libraries have them.
_TORCH_ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False,
                "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None}
_OPTIMI_TAIL = {"decouple_lr": False, "max_lr": None, "kahan_sum": None, "foreach": None, "triton": None,
                "gradient_release": False}
_OPTIMI_ADAMW = {"lr": REQUIRED, "betas": (0.9, 0.99), "weight_decay": 1e-2, "eps": 1e-6, **_OPTIMI_TAIL}
_OPTIMI_LION = {"lr": REQUIRED, "betas": (0.9, 0.99), "weight_decay": 0, **_OPTIMI_TAIL}
_OPTIMI_REFUSED = OPTIMI_REFUSED
_LION = {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0, "use_triton": False, "decoupled_weight_decay": False}
_PRODIGY = {"lr": 1.0, "betas": (0.9, 0.999), "beta3": None, "eps": 1e-8, "weight_decay": 0, "decouple": True,
            "use_bias_correction": False, "safeguard_warmup": False, "d0": 1e-6, "d_coef": 1.0,
            "growth_rate": math.inf, "fsdp_in_use": False, "slice_p": 1}
_BNB_ADAMW8BIT = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False,
                  "optim_bits": 32, "args": None, "min_8bit_size": 4096, "is_paged": False}
_SCHEDULEFREE = {"lr": 0.0025, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "warmup_steps": 0, "r": 0.0,
                 "weight_lr_power": 2.0, "foreach": True}

_SPECS: dict[str, Spec] = {
    "adamw": Spec("", "torch", "optim.AdamW", _adam_settings, _TORCH_ADAMW),
    "adamw_bf16": Spec("torch-optimi", "optimi", "AdamW", _optimi_settings(True), _OPTIMI_ADAMW,
                        refused=_OPTIMI_REFUSED),
    "lion": Spec("lion-pytorch", "lion_pytorch", "Lion", _lion_settings, _LION),
    "optimi-stableadamw": Spec("torch-optimi", "optimi", "StableAdamW", _optimi_settings(None), _OPTIMI_ADAMW,
                                refused=_OPTIMI_REFUSED),
    "optimi-adamw": Spec("torch-optimi", "optimi", "AdamW", _optimi_settings(None), _OPTIMI_ADAMW,
                          refused=_OPTIMI_REFUSED),
    "optimi-lion": Spec("torch-optimi", "optimi", "Lion", _lion_settings, _OPTIMI_LION, refused=_OPTIMI_REFUSED),
    "prodigy": Spec("prodigyopt", "prodigyopt", "Prodigy", _prodigy_settings, _PRODIGY, refused={
        "fsdp_in_use": "difftune sums Prodigy's step-size estimate over the processes itself with fsdp_enable "
                       "(train/prodigy_fsdp.py); prodigyopt's fsdp_in_use, written for torch's older FSDP, fails "
                       "without CUDA or a process group and counts tensors every process holds whole once per "
                       "process"}),
    "adamw8bit": Spec("bitsandbytes", "bitsandbytes", "optim.AdamW8bit", _adam_settings, _BNB_ADAMW8BIT, refused={
        "amsgrad": "bitsandbytes' AdamW8bit has no AMSGrad; use optimizer 'adamw' with amsgrad=true",
        "optim_bits": "AdamW8bit always keeps 8-bit state (it takes only its placeholder optim_bits=32); use "
                      "optimizer 'adamw' for 32-bit state",
        "args": "args is bitsandbytes' internal settings object"}),
    # warm-up: lr_warmup_steps, through the LR scheduler (train/lr_schedule.py), with the library's own formula
    "adamw_schedulefree": Spec("schedulefree", "schedulefree", "AdamWScheduleFree", _adam_settings, _SCHEDULEFREE,
                                clashes={"warmup_steps": "lr_warmup_steps"}),
}
_SPECS |= MORE_SPECS
assert set(_SPECS) == set(OPTIMIZERS)

# Each name's (betas, weight_decay, eps) where adam_beta1, adam_beta2, adam_weight_decay or adam_epsilon is unset:
# SimpleTuner's `optimizer_choices[name]["default_settings"]` (simpletuner/helpers/training/optimizer_param.py), so a
# config copied from SimpleTuner trains with the same hyper-parameters (SimpleTuner never applies its global adam_*
# defaults outside DeepSpeed). `adamw8bit` is SimpleTuner's `bnb-adamw8bit`; `prodigy` takes SimpleTuner's `prodigy`
# entry (a different class there, ProdigyPlusScheduleFree). SimpleTuner has no `lion` (lion-pytorch): it keeps the
# values difftune always used. eps None: the optimizer has none (Lion).
DEFAULTS: dict[str, tuple[tuple[float, ...] | None, float, float | None]] = {
    "adamw": ((0.9, 0.999), 1e-2, 1e-8),
    "adamw_bf16": ((0.9, 0.999), 1e-2, 1e-6),
    "lion": ((0.9, 0.999), 1e-2, None),
    "optimi-stableadamw": ((0.9, 0.99), 1e-2, 1e-6),
    "optimi-adamw": ((0.9, 0.99), 0.0, 1e-6),
    "optimi-lion": ((0.9, 0.99), 0.0, None),
    "prodigy": ((0.9, 0.99), 0.0, 1e-8),
    "adamw8bit": ((0.9, 0.999), 1e-2, 1e-6),
    "adamw_schedulefree": ((0.9, 0.999), 1e-2, 1e-8),
} | MORE_DEFAULTS
assert set(DEFAULTS) == set(OPTIMIZERS)


def hyper_parameters(name: str, beta1: float | None = None, beta2: float | None = None,
                     weight_decay: float | None = None, eps: float | None = None,
                     ) -> tuple[tuple[float, ...] | None, float, float | None]:
    """(betas, weight_decay, eps) that optimizer `name` trains with: each value given, else the name's DEFAULTS.
    betas None: the optimizer has none (SGD); beta1 and beta2 are the first two of three (Adan, AdEMAMix)."""
    name = OPTIMIZER_ALIASES.get(name, name)
    _check_name(name)
    default_betas, decay, epsilon = DEFAULTS[name]
    betas = None if default_betas is None else (
        (default_betas[0] if beta1 is None else beta1, default_betas[1] if beta2 is None else beta2, *default_betas[2:]))
    return betas, decay if weight_decay is None else weight_decay, epsilon if eps is None else eps


KEYWORDS: dict[str, dict[str, Any]] = {name: spec.keywords for name, spec in _SPECS.items()}


def _check_name(name: str) -> Spec:
    name = OPTIMIZER_ALIASES.get(name, name)
    if name not in _SPECS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return _SPECS[name]


def class_name(name: str) -> str:
    """The class `name` builds, as written in Python ('torch.optim.AdamW')."""
    spec = _check_name(name)
    return f"{spec.module}.{spec.cls}"


def package_of(name: str) -> tuple[str, str]:
    """(the pip distribution `name` needs, "" for torch itself; the module it imports) without importing it."""
    spec = _check_name(name)
    return spec.package, spec.module


def optimizer_class(name: str) -> type:
    """The class `name` builds (imports its library)."""
    return functools.reduce(getattr, _check_name(name).cls.split("."), _import(name))


def setting_problem(name: str, key: str, value: Any) -> str | None:
    """Why optimizer_config's `key=value` cannot be passed to optimizer `name`'s constructor, or None (import-light:
    from KEYWORDS, no library is imported)."""
    spec = _check_name(name)
    settable = [k for k in spec.keywords if k not in CLASHES and k not in spec.clashes and k not in spec.refused]
    if key not in spec.keywords:
        return (f"{class_name(name)} (optimizer {name!r}) has no setting {key!r}; its settings: "
                f"{', '.join(settable)}")
    if key in CLASHES or key in spec.clashes:
        return f"{key} is set by {CLASHES.get(key) or spec.clashes[key]}: use that key instead"
    if key in spec.refused:
        return spec.refused[key]
    default = spec.keywords[key]
    if isinstance(default, bool):
        return None if isinstance(value, bool) else f"{key} takes true or false, got {value!r}"
    if isinstance(default, int | float) and (isinstance(value, bool) or not isinstance(value, int | float)):
        return f"{key} takes a number, got {value!r}"
    # torch writes 0 for float settings (momentum, dampening, lr_decay): only a non-zero whole default means a count
    if isinstance(default, int) and default != 0 and not isinstance(value, int):
        return f"{key} takes a whole number, got {value!r}"
    return None


def _import(name: str) -> Any:
    spec = _check_name(name)
    try:
        return importlib.import_module(spec.module)
    except ImportError as e:
        raise ImportError(
            f"optimizer {name!r} needs the package {spec.package!r} ({e}); install it with "
            f"`pip install {spec.package}`, or choose another optimizer"
        ) from e


def _construct(name: str, params: list, lr: float, betas: tuple, weight_decay: float, eps: float,
               settings: dict[str, Any] | None = None) -> Any:
    spec = _check_name(name)
    cls = optimizer_class(name)
    if name == "prodigy":  # FSDP2 shards: its step-size sums taken over every process (train/prodigy_fsdp.py)
        from difftune.train import prodigy_fsdp

        if prodigy_fsdp.sharded(params):
            if problem := prodigy_fsdp.uneven_problem(params):
                raise ValueError(problem)
            cls = prodigy_fsdp.sharded_class(cls)
    kwargs = spec.settings(params, lr, betas and tuple(betas), weight_decay, eps) | (settings or {})
    with contextlib.redirect_stdout(io.StringIO()):  # prodigy prints "Using decoupled weight decay"
        optimizer = cls(params, **kwargs)
    if schedule_free(optimizer):
        optimizer.train()  # schedule-free optimizers start in eval mode; training steps need train mode
        # train() left an empty state entry per parameter; torch.distributed.checkpoint takes a non-empty state for
        # an initialised one, so an FSDP resume read no tensor into it (z was lost: a 5e-4 loss difference, or with
        # FULL_STATE_DICT "Expected device to be set"). A fresh optimizer has no state.
        optimizer.state.clear()
    return optimizer


def build_optimizer(
    name: str,
    params: Iterable[torch.nn.Parameter],
    lr: float,
    betas: tuple[float | None, float | None],
    weight_decay: float | None,
    eps: float | None,
    settings: dict[str, Any] | None = None,
    prodigy_steps: int | None = None,
) -> torch.optim.Optimizer:
    """The optimizer `name` (a key of OPTIMIZERS) over `params`, with one parameter group. A beta, weight_decay or
    eps of None is the name's default (DEFAULTS: SimpleTuner's for that name). `settings` (from optimizer_config)
    are more constructor arguments; they replace difftune's own of the same name. `prodigy_steps` (prodigy only):
    the step size d stays as it is after that many steps (`freeze_after`).

    Raises ValueError for an unknown name, no parameters or a setting `setting_problem` refuses, ImportError
    when the library is missing, and RuntimeError when the parameters live on a device the optimizer cannot
    run on.
    """
    name = OPTIMIZER_ALIASES.get(name, name)
    _check_name(name)
    params = list(params)
    if not params:
        raise ValueError("build_optimizer: no parameters to optimize")
    for key, value in (settings or {}).items():
        if problem := setting_problem(name, key, value):
            raise ValueError(f"optimizer_config {key}={value}: {problem}")
    _import(name)
    if name == "muon":
        _only_matrices(params)
    for device in sorted({str(p.device) for p in params}):
        known = device.split(":")[0] in _KNOWN_DEVICE_TYPES and not (name in _PROBED_ON_CUDA and device != "cpu")
        reason = _probe(name, device) if not known else None
        if reason:
            raise RuntimeError(f"optimizer {name!r} cannot run on {device}: {reason}")
    betas, weight_decay, eps = hyper_parameters(name, *betas, weight_decay, eps)
    optimizer = _construct(name, params, lr, betas, weight_decay, eps, settings)
    if prodigy_steps:
        if name != "prodigy":
            raise ValueError(f"prodigy_steps applies to optimizer 'prodigy', not {name!r}")
        freeze_after(optimizer, prodigy_steps)
    return optimizer


def freeze_after(optimizer: Any, steps: int) -> None:
    """prodigy_steps: Prodigy adapts its step size d during the first `steps` steps, then keeps it. Before each later
    step the group's growth_rate is 1, so d = min(d_max, d) = d, and d0 (read only to tell whether d ever moved)
    no longer equals d, so d = max(d, d_hat) cannot raise it either: d is exact and constant. Both values live in
    the parameter groups, which checkpoints save: a resumed run keeps d too (the hook is registered again at
    each start). Prodigy still computes its estimate (prodigyopt keeps its state; SimpleTuner's ProdigyPlus frees
    it)."""
    def hold(opt: Any, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            if group["k"] >= steps:
                group["growth_rate"] = 1.0
                group["d0"] = -1.0  # d is positive: never equal
    optimizer.register_step_pre_hook(hold)


def _only_matrices(params: list) -> None:
    """Muon orthogonalises matrices: any other trained tensor is a ValueError naming how many and their shapes."""
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    other = [tuple(p.shape) for p in tensors if p.dim() != 2]
    if other:
        shapes = ", ".join(sorted({str(s) for s in other})[:5])
        raise ValueError(f"optimizer 'muon' steps 2-D weights only, and {len(other)} of the {len(tensors)} trained "
                         f"tensors are not (shapes {shapes}): DoRA's magnitude vectors, CREPA's projector biases, a "
                         "LyCORIS algorithm's vectors or a full fine-tune's norms and biases; train a LoRA without "
                         "them, or choose another optimizer ('adamw' if unsure)")


@functools.cache
def _probe(name: str, device: str) -> str | None:
    """None if `name` builds and takes a step on `device`, else why not (one line)."""
    try:
        import torch

        # 4096 elements: the smallest tensor bitsandbytes gives 8-bit state, so its 8-bit kernel runs.
        p = torch.nn.Parameter(torch.zeros(64, 64, device=device))
        p.grad = torch.ones_like(p)
        betas, _decay, eps = hyper_parameters(name)
        optimizer = _construct(name, [p], 1.0, betas, 0.0, eps)
        for _ in range(2):  # SOAP's first step only sets up its preconditioner
            optimizer.step()
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


# --- schedule-free optimizers: train mode (the weights are y) and eval mode (the weights are x)


def schedule_free(optimizer: Any) -> bool:
    """Whether `optimizer` (or accelerate's wrapper of it) has a train and an eval mode (schedulefree's)."""
    groups = getattr(optimizer, "param_groups", None)
    return bool(groups) and "train_mode" in groups[0]


def _local(p: Any) -> Any:
    """The tensor that holds `p`'s values on this process (an FSDP2 shard's local part)."""
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


@contextlib.contextmanager
def eval_weights(run: Any, for_checkpoint: bool = False) -> Iterator[None]:
    """With a schedule-free optimizer, the parameters hold its averaged weights x inside the block (every other
    optimizer: nothing changes). Every process enters (FSDP: each switches its own shards; x, y and z are taken
    element by element), before the weights are gathered (`unsharded`, `gathered`).

    On exit the optimizer is back in train mode, and the training weights y are the ones it left: a copy kept
    on the CPU meanwhile is put back, so a run that samples gives the same losses as one that does not. With
    `for_checkpoint` no copy is kept: y is recomputed from x and z, (1 - beta1) z + beta1 x, which is what a run
    resumed from the checkpoint (holding x and the eval-mode optimizer state) computes too (`train_mode` after
    loading), so both continue from the same weights. That recomputation rounds: a run with checkpoints differs
    from one without in the last bits (fp32) or by up to one bf16 step (bf16 weights) at each checkpoint."""
    optimizer = run.optimizer
    if not schedule_free(optimizer):
        yield
        return
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        kept = None if for_checkpoint else [_local(p).to("cpu", copy=True) for p in params]
        optimizer.eval()
    try:
        yield
    finally:
        with torch.no_grad():
            optimizer.train()
            if kept is not None:  # train() recomputes y from x and z, which rounds: the kept copy is exact
                for p, saved in zip(params, kept, strict=True):
                    _local(p).copy_(saved)


def train_mode(optimizer: Any) -> None:
    """After loading a checkpoint's state into a schedule-free optimizer (saved in eval mode, beside the averaged
    weights): train mode, the training weights recomputed from them (see `eval_weights`)."""
    if schedule_free(optimizer):
        optimizer.train()


def clip_gradients(accelerator: Any, params: list, max_grad_norm: float | None, method: str = "norm",
                   optimizer: Any = None) -> Any:
    """Apply `max_grad_norm` and return the gradients' global norm before clipping (measured in any case,
    so a non-finite gradient is seen). 'norm': scale all gradients so their global norm is at most
    max_grad_norm. 'value': clamp each element to [-max_grad_norm, max_grad_norm]. An optimizer that took the
    gradients off the device during the backward pass (optimizer_offload_gradients) clips them where they are."""
    if method not in ("norm", "value"):
        raise ValueError(f"grad_clip_method {method!r}: use 'norm' or 'value'")
    limit = max_grad_norm if max_grad_norm is not None else math.inf
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the optimizer
    if getattr(inner, "offload_gradients", False):
        return inner.clip(limit, method)
    norm = accelerator.clip_grad_norm_(params, limit if method == "norm" else math.inf)  # inf: only measures
    if method == "value" and math.isfinite(limit):
        accelerator.clip_grad_value_(params, limit)
    return norm
