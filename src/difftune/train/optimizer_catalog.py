"""SimpleTuner's other optimizer names (its optimizer_param.py), each built from the library SimpleTuner builds it from,
with SimpleTuner's settings for that name (its `default_settings`), so a config copied from SimpleTuner trains the
same way here. train/optimizers.py merges them into OPTIMIZERS; this module also holds what every name is described
by (`Spec`). Import-light like optimizers.py: no torch, no optimizer library at import time.

- `torch-*`: torch.optim's classes. Adam (L2 weight decay, not AdamW's decoupled one), RAdam, NAdam and Adamax take
  betas, weight decay and epsilon; SGD, RMSprop, Adagrad, Adadelta and ASGD take no betas (SGD's and RMSprop's
  momentum is 0, as in SimpleTuner: set it with optimizer_config momentum=0.9); Adafactor (torch's, factored second
  moments: about (rows + columns) values per matrix) takes neither betas nor epsilon (its eps is a pair).
- `ao-*`: torchao's low-bit Adam(W): 8-bit and 4-bit block-quantised state (tensors under 4096 elements keep the
  weights' dtype), and fp8 state (ao-adamfp8 is Adam with L2 weight decay, the others AdamW).
- `optimi-*`: torch-optimi's RAdam, Ranger (RAdam with Lookahead: one more copy of the weights), Adan (three betas,
  four state tensors) and Adam, and SGD, with SimpleTuner's settings: Kahan summation on (a buffer on bf16/fp16
  weights, nothing on fp32), decoupled weight decay for RAdam and Ranger.
- `bnb-*`: bitsandbytes' 32-bit, 8-bit and paged Adam, AdamW, Lion, Adagrad and AdEMAMix (three betas: the third
  is the slow average's, 0.9999). Paging (unified
  memory that spills to the CPU when the GPU is short) matters on CUDA; on the CPU the paged classes are the plain
  ones. bitsandbytes is the optional extra `bnb` (`pip install difftune[bnb]`).
- `soap`: pytorch-optimizer's SOAP (Adam in Shampoo's eigenbasis, Vyas et al. 2024). Besides Adam's two moments it
  keeps, for each side of a matrix up to 10000 long, that side's Gram matrix and eigenbasis (2 x side^2 values):
  for a LoRA down-projection of width 3072 that is 19M values on top of the adapter's own 49K, so it suits full
  fine-tunes more than adapters. `difftune plan` counts it.
- `muon`: torch.optim.Muon (momentum orthogonalised by Newton-Schulz iterations), with SimpleTuner's MuonClip
  settings: momentum 0.95 without Nesterov, weight decay 0.1, and the update scaled to AdamW's size
  (adjust_lr_fn 'match_rms_adamw': 0.2 x sqrt(max(rows, columns)), SimpleTuner's rms_scale_factor 0.2). It
  orthogonalises matrices only: every trained tensor must be 2-D, so LoRA without DoRA and without CREPA
  (whose projector has biases); a full fine-tune (norms and biases) is refused. SimpleTuner's MuonClip steps the
  other tensors with plain momentum, and clips attention logits (QK-clip); torch's Muon does neither.

adam_beta1 and adam_beta2 set the first two betas (Adan's and AdEMAMix's third keeps its default); a name that has no
betas or no epsilon notes adam_beta1/2 or adam_epsilon as unused (config/optimizer_keys.optimizer_notes).
optimizer_config cannot give a tuple, so Adan's and AdEMAMix's third beta and Adafactor's eps pair keep their
defaults.

`torch-sparseadam` is refused (config/pending.py): it takes sparse gradients only, which no weight here has.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REQUIRED = "<required>"  # a constructor argument without a default (in KEYWORDS)


@dataclass(frozen=True)
class Spec:
    package: str  # the pip distribution that provides it ("" for torch itself)
    module: str
    cls: str  # the class: an attribute path inside `module`
    # difftune's constructor arguments from (params, lr, betas, weight_decay, eps)
    settings: Callable[..., dict[str, Any]]
    keywords: dict[str, Any]  # the constructor's arguments after `params`, with their defaults
    clashes: dict[str, str] = field(default_factory=dict)  # more keywords that a difftune key sets
    refused: dict[str, str] = field(default_factory=dict)  # keywords optimizer_config may not set, and why


def no_triton_off_cuda(params: list) -> dict[str, bool]:
    """optimi's StableAdamW (0.3) decides on Triton before it has looked at any parameter, so with a
    CUDA build of torch (which ships Triton) it takes the Triton kernel for CPU tensors and fails ("0
    active drivers"). Off CUDA the for-loop is the only path anyway: say so."""
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return {} if tensors and all(t.is_cuda for t in tensors) else {"triton": False}


def settings_of(betas: bool, eps: bool, fixed: dict[str, Any] | None = None,
                optimi: bool = False) -> Callable[..., dict[str, Any]]:
    """Constructor arguments: lr and weight_decay, betas and eps where the class has them, then `fixed` (SimpleTuner's
    other settings for the name)."""
    def settings(params: list, lr: float, given_betas: tuple, weight_decay: float, epsilon: float) -> dict[str, Any]:
        out: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay, **(fixed or {})}
        if betas:
            out["betas"] = tuple(given_betas)
        if eps:
            out["eps"] = epsilon
        return out | (no_triton_off_cuda(params) if optimi else {})
    return settings


# The constructors' keywords after `params` and their defaults, as the pinned libraries have them
# (tests/test_optimizers.py checks them against the installed libraries).
_TORCH_TAIL = {"foreach": None, "maximize": False, "capturable": False, "differentiable": False}
_TORCH_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "amsgrad": False, "foreach": None,
               "maximize": False, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": False}
_TORCH = {
    "torch-adam": ("Adam", _TORCH_ADAM),
    "torch-sgd": ("SGD", {"lr": 1e-3, "momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False,
                          "maximize": False, "foreach": None, "differentiable": False, "fused": None}),
    "torch-radam": ("RAdam", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0,
                              "decoupled_weight_decay": False, **_TORCH_TAIL}),
    "torch-nadam": ("NAdam", {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "momentum_decay": 4e-3,
                              "decoupled_weight_decay": False, **_TORCH_TAIL}),
    "torch-rmsprop": ("RMSprop", {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0, "momentum": 0,
                                  "centered": False, "capturable": False, "foreach": None, "maximize": False,
                                  "differentiable": False}),
    "torch-adagrad": ("Adagrad", {"lr": 1e-2, "lr_decay": 0, "weight_decay": 0, "initial_accumulator_value": 0,
                                  "eps": 1e-10, "foreach": None, "maximize": False, "differentiable": False,
                                  "fused": None}),
    "torch-adadelta": ("Adadelta", {"lr": 1.0, "rho": 0.9, "eps": 1e-6, "weight_decay": 0, "foreach": None,
                                    "capturable": False, "maximize": False, "differentiable": False}),
    "torch-adafactor": ("Adafactor", {"lr": 1e-2, "beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0,
                                      "weight_decay": 0.0, "foreach": None, "maximize": False}),
    "torch-adamax": ("Adamax", {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "foreach": None,
                                "maximize": False, "differentiable": False, "capturable": False}),
    "torch-asgd": ("ASGD", {"lr": 1e-2, "lambd": 1e-4, "alpha": 0.75, "t0": 1e6, "weight_decay": 0, "foreach": None,
                            "maximize": False, "differentiable": False, "capturable": False}),
    "muon": ("Muon", {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                      "ns_coefficients": (3.4445, -4.775, 2.0315), "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None}),
}
_AO = {"ao-adamw8bit": ("AdamW8bit", 256, 0.01), "ao-adamw4bit": ("AdamW4bit", 128, 0.01),
       "ao-adamfp8": ("AdamFp8", 256, 0), "ao-adamwfp8": ("AdamWFp8", 256, 0.01)}
_OPTIMI_TAIL = {"decouple_lr": False, "max_lr": None, "kahan_sum": None, "foreach": None, "triton": None,
                "gradient_release": False}
_OPTIMI_RADAM = {"lr": REQUIRED, "betas": (0.9, 0.99), "weight_decay": 0, "eps": 1e-6, "decouple_wd": False,
                 **_OPTIMI_TAIL}
_OPTIMI = {
    "optimi-radam": ("RAdam", _OPTIMI_RADAM),
    "optimi-ranger": ("Ranger", {"lr": REQUIRED, "betas": (0.9, 0.99), "weight_decay": 0, "eps": 1e-6, "k": 6,
                                 "alpha": 0.5, "decouple_wd": True, **_OPTIMI_TAIL}),
    "optimi-adan": ("Adan", {"lr": REQUIRED, "betas": (0.98, 0.92, 0.99), "weight_decay": 0.02, "eps": 1e-6,
                             "decouple_lr": False, "max_lr": None, "adam_wd": False, "kahan_sum": False,
                             "foreach": None, "triton": None, "gradient_release": False}),
    "optimi-adam": ("Adam", _OPTIMI_RADAM),
    "optimi-sgd": ("SGD", {"lr": REQUIRED, "momentum": 0, "weight_decay": 0, "dampening": False, "decouple_wd": False,
                           "decouple_lr": False, "max_lr": None, "torch_init": False, "kahan_sum": None,
                           "foreach": None, "triton": None, "gradient_release": False}),
}
OPTIMI_REFUSED = {"gradient_release": "releasing gradients during the backward pass needs the training loop's "
                  "hooks (SimpleTuner's optimizer_release_gradients), which difftune does not have"}
_BNB_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "amsgrad": False, "optim_bits": 32,
             "args": None, "min_8bit_size": 4096, "is_paged": False}
_BNB_LION = {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0, "optim_bits": 32, "args": None,
             "min_8bit_size": 4096, "is_paged": False}
_BNB_ADAGRAD = {"lr": 1e-2, "lr_decay": 0, "weight_decay": 0, "initial_accumulator_value": 0, "eps": 1e-10,
                "optim_bits": 32, "args": None, "min_8bit_size": 4096}
_BNB_ADEMAMIX = {"lr": 1e-3, "betas": (0.9, 0.999, 0.9999), "alpha": 5.0, "t_alpha": None, "t_beta3": None,
                 "eps": 1e-8, "weight_decay": 0.01, "optim_bits": 32, "min_8bit_size": 4096, "is_paged": False}


def _without(keywords: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in keywords.items() if k not in names}


# name -> (class in bitsandbytes.optim, keywords)
_BNB = {
    "bnb-adam": ("Adam", _BNB_ADAM), "bnb-adam8bit": ("Adam8bit", _BNB_ADAM),
    "bnb-adamw": ("AdamW", _BNB_ADAM | {"weight_decay": 0.01}),
    "bnb-adamw-paged": ("PagedAdamW", _without(_BNB_ADAM | {"weight_decay": 0.01}, "is_paged")),
    "bnb-adamw8bit-paged": ("PagedAdamW8bit", _without(_BNB_ADAM | {"weight_decay": 0.01}, "is_paged")),
    "bnb-lion": ("Lion", _BNB_LION), "bnb-lion8bit": ("Lion8bit", _without(_BNB_LION, "optim_bits")),
    "bnb-lion-paged": ("PagedLion", _without(_BNB_LION, "is_paged")),
    "bnb-lion8bit-paged": ("PagedLion8bit", _without(_BNB_LION, "optim_bits", "is_paged")),
    "bnb-adagrad": ("Adagrad", _BNB_ADAGRAD), "bnb-adagrad8bit": ("Adagrad8bit", _BNB_ADAGRAD | {"optim_bits": 8}),
    "bnb-ademamix": ("AdEMAMix", _BNB_ADEMAMIX),
    "bnb-ademamix-paged": ("PagedAdEMAMix", _without(_BNB_ADEMAMIX, "is_paged")),
    "bnb-ademamix8bit": ("AdEMAMix8bit", _without(_BNB_ADEMAMIX, "optim_bits")),
    "bnb-ademamix8bit-paged": ("PagedAdEMAMix8bit", _without(_BNB_ADEMAMIX, "optim_bits", "is_paged")),
}
_BNB_REFUSED = {"optim_bits": "the name chooses the state's bits (the *8bit names keep 8-bit state); choose the "
                              "name instead", "args": "args is bitsandbytes' internal settings object",
                "amsgrad": "bitsandbytes' Adam and AdamW have no AMSGrad (the 32-bit ones ignore amsgrad, the 8-bit "
                           "ones fail on it); use optimizer 'adamw' or 'torch-adam' with amsgrad=true"}
_SOAP = {"lr": 3e-3, "betas": (0.95, 0.95), "shampoo_beta": None, "weight_decay": 0.01, "precondition_frequency": 10,
         "max_precondition_dim": 10000, "merge_dims": False, "precondition_1d": False, "correct_bias": True,
         "normalize_gradient": False, "data_format": "channels_first", "eps": 1e-8, "maximize": False}

# Each name's (betas, weight_decay, eps) where the adam_* keys are unset: SimpleTuner's default_settings. betas or eps
# None: the class has none (the adam_* key is noted as unused).
MORE_DEFAULTS: dict[str, tuple[tuple[float, ...] | None, float, float | None]] = {
    "torch-adam": ((0.9, 0.999), 0.0, 1e-8), "torch-sgd": (None, 0.0, None), "torch-radam": ((0.9, 0.999), 0.0, 1e-8),
    "torch-nadam": ((0.9, 0.999), 0.0, 1e-8), "torch-rmsprop": (None, 0.0, 1e-8), "torch-adagrad": (None, 0.0, 1e-10),
    "torch-adadelta": (None, 0.0, 1e-6), "torch-adafactor": (None, 0.0, None), "torch-adamax": ((0.9, 0.999), 0.0, 1e-8),
    "torch-asgd": (None, 0.0, None), "muon": (None, 0.1, 1e-7),
    **dict.fromkeys(_AO, ((0.9, 0.999), 1e-2, 1e-6)),
    "optimi-radam": ((0.9, 0.99), 0.0, 1e-6), "optimi-ranger": ((0.9, 0.99), 0.0, 1e-6),
    "optimi-adan": ((0.98, 0.92, 0.999), 2e-2, 1e-6), "optimi-adam": ((0.9, 0.99), 0.0, 1e-6),
    "optimi-sgd": (None, 0.0, None),
    **dict.fromkeys(("bnb-adam", "bnb-adam8bit"), ((0.9, 0.999), 0.0, 1e-8)),
    **dict.fromkeys(("bnb-adamw", "bnb-adamw-paged", "bnb-adamw8bit-paged"), ((0.9, 0.999), 1e-2, 1e-6)),
    **dict.fromkeys(("bnb-lion", "bnb-lion8bit", "bnb-lion-paged", "bnb-lion8bit-paged"), ((0.9, 0.99), 0.0, None)),
    **dict.fromkeys(("bnb-adagrad", "bnb-adagrad8bit"), (None, 0.0, 1e-10)),
    **dict.fromkeys(("bnb-ademamix", "bnb-ademamix-paged", "bnb-ademamix8bit", "bnb-ademamix8bit-paged"),
                    ((0.9, 0.999, 0.9999), 1e-2, 1e-8)),
    "soap": ((0.95, 0.95), 1e-2, 1e-8),
}

# SimpleTuner's other settings for a name (beyond betas, weight_decay and eps)
_FIXED: dict[str, dict[str, Any]] = {
    "muon": {"momentum": 0.95, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
    "optimi-radam": {"decouple_wd": True, "kahan_sum": True, "foreach": True},
    "optimi-ranger": {"decouple_wd": True, "kahan_sum": True, "foreach": True},
    "optimi-adan": {"adam_wd": False, "kahan_sum": True, "foreach": True},
    "optimi-adam": {"decouple_wd": False, "kahan_sum": True},
    "optimi-sgd": {"kahan_sum": True, "foreach": True},
}


def _spec(package: str, module: str, cls: str, name: str, keywords: dict[str, Any],
          refused: dict[str, str] | None = None) -> Spec:
    betas, _decay, eps = MORE_DEFAULTS[name]
    return Spec(package, module, cls, settings_of(betas is not None, eps is not None, _FIXED.get(name),
                                                  optimi=module == "optimi"), keywords, refused=refused or {})


MORE_SPECS: dict[str, Spec] = {
    **{name: _spec("", "torch", f"optim.{cls}", name, kw) for name, (cls, kw) in _TORCH.items()},
    **{name: _spec("torchao", "torchao.optim", cls, name, {
        "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": decay, "amsgrad": False, "block_size": block,
        "bf16_stochastic_round": False}) for name, (cls, block, decay) in _AO.items()},
    **{name: _spec("torch-optimi", "optimi", cls, name, kw, OPTIMI_REFUSED) for name, (cls, kw) in _OPTIMI.items()},
    **{name: _spec("bitsandbytes", "bitsandbytes", f"optim.{cls}", name, kw, _BNB_REFUSED)
       for name, (cls, kw) in _BNB.items()},
    "soap": _spec("pytorch-optimizer", "pytorch_optimizer", "SOAP", "soap", _SOAP),
}
assert set(MORE_SPECS) == set(MORE_DEFAULTS)

MORE_OPTIMIZERS: dict[str, str] = {
    "torch-adam": "PyTorch Adam (weight decay added to the gradient, not decoupled as in AdamW).",
    "torch-sgd": "PyTorch SGD (no momentum unless optimizer_config momentum=0.9; no state).",
    "torch-radam": "PyTorch RAdam (Adam with a rectified warm-up of the adaptive rate).",
    "torch-nadam": "PyTorch NAdam (Adam with Nesterov momentum).",
    "torch-rmsprop": "PyTorch RMSprop.",
    "torch-adagrad": "PyTorch Adagrad.",
    "torch-adadelta": "PyTorch Adadelta (learning_rate scales its own step; 1.0 is its usual value).",
    "torch-adafactor": "PyTorch Adafactor: factored second moments, tiny state on matrices.",
    "torch-adamax": "PyTorch Adamax (Adam with the infinity norm).",
    "torch-asgd": "PyTorch averaged SGD.",
    "muon": "Muon (torch.optim.Muon): orthogonalised momentum on 2-D weights only (LoRA without DoRA or CREPA).",
    "ao-adamw8bit": "torchao's 8-bit AdamW (block-quantised state, about 75% less state memory).",
    "ao-adamw4bit": "torchao's 4-bit AdamW (about 87% less state memory).",
    "ao-adamfp8": "torchao's Adam with fp8 state.",
    "ao-adamwfp8": "torchao's AdamW with fp8 state.",
    "optimi-radam": "RAdam from torch-optimi (Kahan summation on bf16 weights, decoupled weight decay).",
    "optimi-ranger": "Ranger from torch-optimi: RAdam with Lookahead (one more copy of the weights).",
    "optimi-adan": "Adan from torch-optimi (three betas, four state tensors).",
    "optimi-adam": "Adam from torch-optimi (Kahan summation on bf16 weights).",
    "optimi-sgd": "SGD from torch-optimi (Kahan summation on bf16 weights).",
    "bnb-adam": "bitsandbytes' 32-bit Adam.",
    "bnb-adam8bit": "bitsandbytes' 8-bit Adam.",
    "bnb-adamw": "bitsandbytes' 32-bit AdamW.",
    "bnb-adamw-paged": "bitsandbytes' paged 32-bit AdamW (state spills to CPU memory when the GPU is short).",
    "bnb-adamw8bit-paged": "bitsandbytes' paged 8-bit AdamW.",
    "bnb-lion": "bitsandbytes' 32-bit Lion (use a 3-10x smaller learning rate than AdamW).",
    "bnb-lion8bit": "bitsandbytes' 8-bit Lion.",
    "bnb-lion-paged": "bitsandbytes' paged 32-bit Lion.",
    "bnb-lion8bit-paged": "bitsandbytes' paged 8-bit Lion.",
    "bnb-adagrad": "bitsandbytes' 32-bit Adagrad.",
    "bnb-adagrad8bit": "bitsandbytes' 8-bit Adagrad.",
    "bnb-ademamix": "bitsandbytes' AdEMAMix (Adam with a second, slow momentum; three betas).",
    "bnb-ademamix-paged": "bitsandbytes' paged AdEMAMix.",
    "bnb-ademamix8bit": "bitsandbytes' 8-bit AdEMAMix.",
    "bnb-ademamix8bit-paged": "bitsandbytes' paged 8-bit AdEMAMix.",
    "soap": "SOAP (pytorch-optimizer): Adam in Shampoo's eigenbasis; large state on wide matrices.",
}
assert set(MORE_OPTIMIZERS) == set(MORE_SPECS)

KAHAN_NAMES = frozenset(("optimi-radam", "optimi-ranger", "optimi-adan", "optimi-adam", "optimi-sgd"))
# torchao's low-bit optimizers keep small updates of bf16 weights on average with optimizer_config
# bf16_stochastic_round=true (stochastic rounding) instead
STOCHASTIC_ROUNDING = frozenset(("ao-adamw8bit", "ao-adamw4bit", "ao-adamfp8", "ao-adamwfp8"))

# Optimizers that cannot step FSDP2's sharded weights (DTensors), and why. Element-wise ones (torch's, optimi's,
# torchao's 8-bit AdamW) step each shard on its own process as they would the whole tensor.
_WHOLE = "it needs whole matrices, and FSDP2 gives each process a slice of each"
FSDP_REFUSED: dict[str, str] = {
    **dict.fromkeys(["adamw8bit", *_BNB], "bitsandbytes' kernels take no sharded tensors (DTensors)"),
    **dict.fromkeys(("ao-adamw4bit", "ao-adamfp8", "ao-adamwfp8"),
                    "torchao's 4-bit and fp8 states fail on sharded tensors (torchao 0.18); 'ao-adamw8bit' works"),
    "muon": "Muon orthogonalises each weight matrix: " + _WHOLE,
    "soap": "SOAP preconditions each weight matrix with its Gram matrices: " + _WHOLE,
    "torch-adafactor": "Adafactor factors each matrix's second moment into row and column sums: " + _WHOLE,
}


def state_bytes(name: str, shape: tuple[int, ...], itemsize: int, settings: dict[str, Any] | None = None) -> int:
    """Bytes of optimizer state the SimpleTuner-named optimizer `name` keeps for one tensor of `shape` in a dtype of
    `itemsize` bytes (measured: tests/test_optimizer_catalog.py steps each one and counts its state). `settings`:
    optimizer_config (momentum adds a buffer to SGD and RMSprop, centered one more to RMSprop)."""
    settings = settings or {}
    n = math.prod(shape)
    kahan = n * itemsize if itemsize < 4 and settings.get("kahan_sum", True) else 0
    momentum = n * itemsize if settings.get("momentum") else 0
    if name.startswith("bnb-"):
        states = 3 if "ademamix" in name else 2 if "adam" in name else 1
        if "8bit" in name and n >= settings.get("min_8bit_size", 4096):  # one byte, one fp32 absmax per 256, qmaps
            return states * (n + 4 * math.ceil(n / 256)) + (2 if states > 1 else 1) * 256 * 4
        return states * n * 4  # 32-bit state whatever the weights' dtype
    if name.startswith("ao-"):
        if n < 4096:
            return 2 * n * itemsize  # small tensors keep the weights' dtype
        block = 128 if name == "ao-adamw4bit" else 256
        per = 0.5 if name == "ao-adamw4bit" else 1
        qmap = {"ao-adamw4bit": 16, "ao-adamw8bit": 256}.get(name, 0) * 4
        return int(2 * (per * n + 4 * math.ceil(n / block) + qmap))
    if name == "torch-adafactor":
        return (shape[-2] + shape[-1]) * itemsize if len(shape) >= 2 else n * itemsize
    if name == "soap":
        sides = [d for d in shape if d <= settings.get("max_precondition_dim", 10000)] if len(shape) >= 2 else []
        return 2 * n * itemsize + sum(2 * d * d * itemsize for d in sides)
    per_element = {"torch-adam": 2, "torch-radam": 2, "torch-nadam": 2, "torch-adamax": 2, "torch-adadelta": 2,
                   "torch-adagrad": 1, "torch-asgd": 1, "muon": 1, "torch-sgd": 0, "torch-rmsprop": 1,
                   "optimi-radam": 2, "optimi-adam": 2, "optimi-ranger": 3, "optimi-adan": 4, "optimi-sgd": 0}[name]
    extra = momentum if name in ("torch-sgd", "torch-rmsprop", "optimi-sgd") else 0
    if name == "torch-rmsprop" and settings.get("centered"):
        extra += n * itemsize
    return per_element * n * itemsize + extra + (kahan if name in KAHAN_NAMES else 0)
