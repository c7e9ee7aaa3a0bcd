"""The optimizer's settings beyond `optimizer` and the adam_* keys: `optimizer_config` (SimpleTuner's string of
extra constructor arguments), and the rules of `optimizer: adamw_schedulefree` with the LR schedule. The fields are
mixed into TrainConfig; the checks are this mixin's validator. Import-light: no torch, no optimizer library
(train/optimizers.py's `KEYWORDS` lists every constructor's keywords).

`optimizer_config` is SimpleTuner's format, "key=value,key2=value2": the string is split at commas, each part at
its first '='. A value reads as true/false, none/null, an integer, a float (0.1, 1e-3, inf), else as text.
SimpleTuner reads some values differently (it keeps "1e5" and "-1" as text) and drops keywords the class does not
take with a warning; here a keyword the chosen optimizer's class does not take, a value of the wrong type, or a
keyword that a difftune key sets (lr, betas, weight_decay, eps; warmup_steps for adamw_schedulefree) is a config
error naming optimizer_config, the keyword and what to do. SimpleTuner also drops optimizer_beta1/2 when
optimizer_config is set; here adam_beta1/2 (and their aliases) always set the betas.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

from pydantic import BaseModel, field_validator, model_validator

from difftune.config.fields import field
from difftune.config.pending import coerce
from difftune.train.optimizer_catalog import FSDP_REFUSED
from difftune.train.optimizers import (
    KEYWORDS,
    OPTIMIZER_ALIASES,
    hyper_parameters,
    package_of,
    setting_problem,
)

SCHEDULE_FREE = "adamw_schedulefree"
CONSTANT_SCHEDULES = ("constant", "constant_with_warmup")  # the lr_scheduler values schedule-free takes


class OptimizerKeys(BaseModel):
    adam_beta1: float | None = field(
        None, "The optimizer's beta1 (first-moment decay; schedule-free: its interpolation). Unset: the optimizer's "
        "default as in SimpleTuner (0.9; 0.98 for optimi-adan, 0.95 for soap). An optimizer without betas (SGD, "
        "RMSprop, Adagrad, Adadelta, ASGD, Adafactor, muon) notes it as unused.", "training", advanced=True)
    adam_beta2: float | None = field(
        None, "The optimizer's beta2. Unset: the optimizer's default as in SimpleTuner: 0.99 for the optimi-* ones, "
        "prodigy and bnb-lion*, 0.92 for optimi-adan, 0.95 for soap, 0.999 for the others.", "training", advanced=True)
    adam_weight_decay: float | None = field(
        None, "Weight decay (decoupled for the AdamW kinds, added to the gradient for the Adam kinds). Unset: the "
        "optimizer's default as in SimpleTuner: 0 for optimi-adamw, optimi-lion, prodigy and the torch-*, Adam, "
        "Lion and Adagrad kinds of SimpleTuner's other names, 0.1 for muon, 2e-2 for optimi-adan, 1e-2 for the "
        "others.", "training", advanced=True)
    adam_epsilon: float | None = field(
        None, "The optimizer's epsilon (the Lion kinds, SGD, ASGD and Adafactor have none). Unset: the optimizer's "
        "default as in SimpleTuner: 1e-6 for adamw_bf16, the optimi-* ones, adamw8bit, the ao-* ones, bnb-adamw* "
        "and torch-adadelta, 1e-10 for the Adagrad kinds, 1e-7 for muon, 1e-8 for the others.",
        "training", advanced=True)
    optimizer_config: str | None = field(
        None, "More settings of the optimizer's constructor, SimpleTuner's format: 'key=value,key2=value2' (for "
        "example 'amsgrad=true' for adamw, 'd_coef=2' for prodigy). Values read as true/false, none, numbers or "
        "text; they replace difftune's own of the same name. A keyword the optimizer does not take is an error "
        "(SimpleTuner drops it with a warning), and so is one a difftune key sets: learning_rate (lr), adam_beta1/"
        "adam_beta2 (betas), adam_weight_decay (weight_decay), adam_epsilon (eps), lr_warmup_steps (schedule-free's "
        "warmup_steps). A JSON object ({\"amsgrad\": true}) is taken too and means the same (a difftune "
        "convenience; SimpleTuner documents the string).", "training", advanced=True,
    )

    prodigy_steps: int | None = field(
        None, "With optimizer 'prodigy': adapt the step size during the first N optimizer steps, then keep it "
        "(SimpleTuner's key; its ProdigyPlus also frees the estimate's memory, prodigyopt keeps it). Unset or 0: "
        "adapt throughout.", "training", ge=0, advanced=True,
    )

    @field_validator("optimizer_config", mode="before")
    @classmethod
    def _optimizer_config_object(cls, value: Any) -> Any:
        # a JSON object is what a user writing config.json by hand reaches for first; it becomes the same string
        if isinstance(value, str) and value.strip().startswith("{"):  # the same object typed on the command line
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"{value!r} starts like a JSON object but is not one ({e}); write it as "
                                 "'{\"amsgrad\": true}' or as key=value,key2=value2") from None
        if not isinstance(value, dict):
            return value
        parts = []
        for key, item in value.items():
            if isinstance(item, list | tuple | dict):
                raise ValueError(f"optimizer_config {key}: {item!r} is not a single value; optimizer_config takes "
                                 "true/false, none, numbers or text (betas are adam_beta1 and adam_beta2)")
            text = "none" if item is None else str(item).lower() if isinstance(item, bool) else str(item)
            parts.append(f"{key}={text}")
        return ",".join(parts)

    @field_validator("optimizer_config")
    @classmethod
    def _optimizer_config_syntax(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        parse_optimizer_config(value)  # raises on bad syntax; the keywords are checked with the optimizer below
        return value

    @model_validator(mode="after")
    def _optimizer_checks(self) -> OptimizerKeys:
        optimizer_checks(self)
        return self

    def optimizer_settings(self) -> dict[str, Any]:
        """optimizer_config as constructor arguments (empty when unset)."""
        return parse_optimizer_config(self.optimizer_config or "")


def parse_optimizer_config(text: str) -> dict[str, Any]:
    """'key=value,key2=value2' -> {key: value}, each value read as true/false, none/null, a number, else text."""
    settings: dict[str, Any] = {}
    for part in text.split(","):
        if not part.strip():
            continue  # a trailing comma
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"optimizer_config: {part.strip()!r} is not key=value; write the settings as "
                             "'key=value,key2=value2' (for example 'amsgrad=true')")
        if key in settings:
            raise ValueError(f"optimizer_config sets {key} twice; keep one")
        settings[key] = coerce(value)
    return settings


def optimizer_notes(cfg: Any) -> list[str]:
    """Settings the chosen optimizer has no use for (accepted: SimpleTuner's configs set adam_epsilon whatever the
    optimizer)."""
    notes = []
    if cfg.adam_epsilon is not None and hyper_parameters(cfg.optimizer)[2] is None:
        notes.append(f"adam_epsilon {cfg.adam_epsilon:g} not used: optimizer {cfg.optimizer!r} has no epsilon; "
                     "remove it")
    if hyper_parameters(cfg.optimizer)[0] is None:
        for key in ("adam_beta1", "adam_beta2"):
            if getattr(cfg, key) is not None:
                momentum = (" (its momentum is optimizer_config momentum=...)"
                            if "momentum" in KEYWORDS[OPTIMIZER_ALIASES.get(cfg.optimizer, cfg.optimizer)] else "")
                notes.append(f"{key} {getattr(cfg, key):g} not used: optimizer {cfg.optimizer!r} has no betas"
                             f"{momentum}; remove it")
    if cfg.optimizer == "prodigy" and cfg.learning_rate < 0.1:
        notes.append(f"learning_rate {cfg.learning_rate:g} with optimizer prodigy: Prodigy estimates the step size "
                     "itself and learning_rate multiplies it, so 1.0 is usual; this trains about "
                     f"{1 / cfg.learning_rate:.0f}x slower (used as given)")
    name = OPTIMIZER_ALIASES.get(cfg.optimizer, cfg.optimizer)
    if cfg.optimizer_cpu_offload_method == "cpu" and (name == "adamw8bit" or name.startswith("bnb-") and "8bit" in name):
        # bitsandbytes' CPU path: 82 M weights/s on 2 cores against 694 for adamw_bf16 (BENCHMARKS.md)
        notes.append(f"optimizer {cfg.optimizer} with optimizer_cpu_offload_method cpu: bitsandbytes steps about 8x slower "
                     "on the CPU than adamw_bf16 (make bench-host-optimizer), and CPU memory is rarely short; "
                     "adamw_bf16 or adamw with optimizer_config fused=true step much faster there")
    return notes


def optimizer_checks(cfg: Any) -> None:
    """Raise ValueError for an optimizer_config keyword the optimizer cannot take, a decaying lr_scheduler with
    adamw_schedulefree, an optimizer whose package is not installed, one that cannot step FSDP2's shards with fsdp_enable, or muon with tensors that are
    not matrices (a full fine-tune, DoRA, CREPA)."""
    for key, value in cfg.optimizer_settings().items():
        if problem := setting_problem(cfg.optimizer, key, value):
            raise ValueError(f"optimizer_config {key}={value}: {problem}")
    name = OPTIMIZER_ALIASES.get(cfg.optimizer, cfg.optimizer)
    if cfg.prodigy_steps and name != "prodigy":
        raise ValueError(f"prodigy_steps applies to optimizer 'prodigy', and optimizer is {cfg.optimizer!r}: remove "
                         "prodigy_steps, or use optimizer 'prodigy'")
    package, module = package_of(name)
    if package and importlib.util.find_spec(module.split(".")[0]) is None:
        extra = " (or `pip install 'difftune[bnb]'`)" if package == "bitsandbytes" else ""
        raise ValueError(f"optimizer {cfg.optimizer!r} needs the package {package!r}, which is not installed: "
                         f"`pip install {package}`{extra}, or choose another optimizer ('adamw' if unsure)")
    if getattr(cfg, "fsdp_enable", False) and name in FSDP_REFUSED:
        raise ValueError(f"optimizer {cfg.optimizer!r} with fsdp_enable: {FSDP_REFUSED[name]}; choose 'adamw', "
                         "'adamw_bf16' or 'ao-adamw8bit' (8-bit state), or set fsdp_enable to false")
    if name == "muon":
        other = [why for why, on in (("model_type 'full' (norms and biases)", cfg.model_type == "full"),
                                     ("use_dora (magnitude vectors)", getattr(cfg, "use_dora", False)),
                                     ("crepa_enabled (the projector's biases)", getattr(cfg, "crepa_enabled", False)))
                 if on]
        if other:
            raise ValueError(f"optimizer 'muon' steps 2-D weights only, and {' and '.join(other)} trains other "
                             "tensors too; train a LoRA without them, or choose another optimizer ('adamw' if unsure)")
    if cfg.optimizer == SCHEDULE_FREE and cfg.lr_scheduler not in CONSTANT_SCHEDULES:
        raise ValueError(
            f"optimizer 'adamw_schedulefree' takes the place of a decaying learning rate (it averages its weights "
            f"instead), so lr_scheduler {cfg.lr_scheduler!r} does not combine with it: set lr_scheduler to "
            "'constant' (lr_warmup_steps still warms up), or choose another optimizer (SimpleTuner ignores "
            "lr_scheduler with it)")
