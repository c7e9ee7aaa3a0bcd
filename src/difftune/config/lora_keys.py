"""The peft LoRA's variant and initialisation (`use_dora`, `lora_init_type`; applied in adapters/kinds.py,
`LoraAdapter`): the fields, mixed into TrainConfig, and their cross-key checks, this mixin's validator.
Import-light: no torch.

SimpleTuner's names and values. `lora_init_type` accepts SimpleTuner's 'default' and 'gaussian'; its 'pissa',
'olora' and 'loftq' are refused with the reason (they rewrite the base weights, see `REWRITES_BASE`). A setting
that would do nothing in the chosen adapter (`use_dora` with LyCORIS or a full fine-tune, `lora_target_modules` with
LyCORIS, ...) is refused, naming both keys. `lora_rank`, `lora_alpha` and `lora_dropout` with LyCORIS or a full
fine-tune get a note instead (`lora_notes`): SimpleTuner's configs carry them whatever trains.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from pydantic import BaseModel, PrivateAttr, field_validator, model_validator

from difftune.config.fields import field

# lora_init_type -> peft's LoraConfig(init_lora_weights=...): both start the update B·A at zero (B = 0), so the
# model at step 0 is the base model and the saved adapter loads onto the stock base.
LORA_INIT_WEIGHTS: dict[str, bool | str] = {"default": True, "gaussian": "gaussian"}
# SimpleTuner's other values, each refused with why: peft initialises them by moving part of W into the adapter
# and writing the rest back into the base layer, so the adapter only means something on that rewritten base.
REWRITES_BASE = {
    "pissa": "PiSSA takes the top singular vectors of each base weight into the adapter and subtracts them "
             "from the base layer",
    "olora": "OLoRA takes a QR factor of each base weight into the adapter and subtracts it from the base layer",
    "loftq": "LoftQ replaces each base weight with a quantized residual (and needs bitsandbytes)",
}
# What lora_type 'lycoris' reads when lycoris_config is unset: SimpleTuner's default, relative to the working folder.
DEFAULT_LYCORIS_CONFIG = "config/lycoris_config.json"
STORE_NOTE = ("difftune never saves the base model, and the saved LoRA is loaded onto the stock base weights "
              "(load_lora_weights, ComfyUI), where it would not reproduce the trained model")


class LoraKeys(BaseModel):
    _lycoris_config_by_default: bool = PrivateAttr(False)  # lycoris_config unset: DEFAULT_LYCORIS_CONFIG was read
    use_dora: bool = field(
        False, "With lora_type 'standard': train a DoRA (weight-decomposed LoRA, peft's use_dora). Each adapted "
        "layer also learns one magnitude per output row, and its weight becomes magnitude x (W + dW) / |W + dW| "
        "(the norm of each row). The magnitudes train in fp32 with the LoRA, are checkpointed and resumed, and are "
        "saved in the same file (lora_magnitude_vector keys, which load_lora_weights reads; dora_scale in the "
        "ComfyUI file). Costs more time and memory per step than plain LoRA: every adapted layer recomputes its "
        "weight norms at each forward. LyCORIS has its own DoRA (\"dora_wd\": true in lycoris_config).", "model",
        advanced=True,
    )
    lora_init_type: str = field(
        "default", "How a new LoRA's matrices start, with lora_type 'standard': 'default' (peft's: lora_A "
        "Kaiming-uniform, lora_B zero) or 'gaussian' (lora_A normal with std 1/lora_rank, lora_B zero). Both start "
        "the update at zero, so step 0 is the base model. SimpleTuner's 'pissa', 'olora' and 'loftq' are refused: "
        "they move part of the base weights into the adapter and train on the rewritten base, so the saved LoRA "
        "would not reproduce the trained model on the stock base model it is loaded onto.", "model",
        advanced=True, choices=list(LORA_INIT_WEIGHTS),
    )

    @field_validator("lora_init_type", mode="before")
    @classmethod
    def _lora_keys_init_type(cls, value: Any) -> Any:
        """null (SimpleTuner's configs may write it) is the default; the refused values say why."""
        if value is None:
            return "default"
        if not isinstance(value, str):
            return value  # pydantic's own type error
        if value in REWRITES_BASE:
            raise ValueError(f"lora_init_type {value!r} is not supported: {REWRITES_BASE[value]}, and {STORE_NOTE}; "
                             f"use {' or '.join(map(repr, LORA_INIT_WEIGHTS))}")
        if value not in LORA_INIT_WEIGHTS:
            raise ValueError(f"unknown lora_init_type {value!r}; choose one of {', '.join(LORA_INIT_WEIGHTS)}")
        return value

    @model_validator(mode="after")
    def _lora_keys_checks(self) -> LoraKeys:
        lora_checks(self)
        return self


def lora_checks(cfg: Any) -> None:
    """Raise ValueError for a LoRA variant setting the chosen adapter would not use, naming both keys."""
    standard = cfg.model_type == "lora" and cfg.lora_type == "standard"
    if cfg.use_dora and cfg.model_type == "full":
        raise ValueError("use_dora applies to model_type 'lora' (a peft LoRA); model_type 'full' trains every weight "
                         "itself: remove use_dora, or use model_type 'lora'")
    if cfg.use_dora and not standard:
        raise ValueError("use_dora applies to lora_type 'standard' (peft); with lora_type 'lycoris' set "
                         "\"dora_wd\": true in the lycoris_config file instead, and remove use_dora")
    if cfg.lora_target_modules and cfg.model_type == "lora" and cfg.lora_type == "lycoris":
        # the user narrowed what trains: training the lycoris_config's targets instead would silently train more
        raise ValueError(f"lora_target_modules {cfg.lora_target_modules} applies to lora_type 'standard' (peft); a "
                         "LyCORIS network wraps what its lycoris_config names: use apply_preset target_name (module "
                         f"paths) or target_module (module classes) in {cfg.lycoris_config or DEFAULT_LYCORIS_CONFIG}, "
                         "and remove "
                         "lora_target_modules")
    if cfg.lora_init_type != "default" and not standard:
        what = "model_type 'full'" if cfg.model_type == "full" else "lora_type 'lycoris'"
        raise ValueError(f"lora_init_type {cfg.lora_init_type!r} applies to lora_type 'standard' (peft); {what} "
                         "would ignore it: remove lora_init_type (or set it to 'default')")
    if cfg.lora_init_type != "default" and cfg.init_lora is not None:
        raise ValueError(f"lora_init_type {cfg.lora_init_type!r} with init_lora: the loaded LoRA replaces the initial "
                         "weights, so the initialisation would change nothing; remove lora_init_type or init_lora")
    precision, weights = cfg.base_model_precision, cfg.weight_dtype_name()
    if cfg.use_dora and precision.endswith("-quanto") and weights != "fp32":
        # peft's DoraLinearLayer.forward casts the base weight to the input's dtype (the adapter's fp32), and
        # optimum-quanto's weight tensors raise "The dtype of a weights Tensor cannot be changed" (measured).
        raise ValueError(f"use_dora with base_model_precision {precision!r} on {weights} weights: peft's DoRA casts "
                         "each base weight to the adapter's fp32, which optimum-quanto's quantized weights refuse; "
                         "use base_model_precision 'int8-torchao', 'fp8-torchao' or 'nf4-bnb' (they work with DoRA), "
                         "or base_model_default_dtype 'fp32'")
    apart = [k for k in ("fsdp_enable", "enable_group_offload", "musubi_blocks_to_swap") if getattr(cfg, k, None)]
    if cfg.use_dora and cfg.lora_format == "comfyui" and apart:
        raise ValueError(f"use_dora with lora_format 'comfyui' and {apart[0]}: ComfyUI's dora_scale is computed from "
                         f"the base weights when the LoRA is saved, and {apart[0]} keeps them out of reach then; use "
                         "lora_format 'diffusers' (load_lora_weights), or remove " + apart[0])
    if cfg.init_lora is not None and not standard:  # nothing reads it there: it trained from the plain base
        kind = "a full fine-tune" if cfg.model_type == "full" else "lora_type 'lycoris'"
        raise ValueError(f"init_lora is read by a standard LoRA only; {kind} would train from the base without it. "
                         "Remove init_lora" + (" (a LyCORIS run continues from its own checkpoint: "
                                               "resume_from_checkpoint)" if cfg.model_type != "full" else ""))
    if standard and cfg.init_lora is not None and (problem := init_lora_problem(cfg.init_lora)) is not None:
        raise ValueError(problem)
    if standard and cfg.init_lora is not None and not cfg.use_dora and is_dora_file(cfg.init_lora):
        raise ValueError(f"init_lora {cfg.init_lora} is a DoRA adapter (it has lora_magnitude_vector tensors); "
                         "set use_dora true to continue it (a plain LoRA would drop its magnitudes)")


def lora_notes(cfg: Any) -> list[str]:
    """peft LoRA settings the chosen adapter does not use. SimpleTuner's LyCORIS and full fine-tune configs carry
    them (it ignores them too), so they are accepted, with a note rather than silently."""
    if cfg.model_type == "full":
        lycoris = ("lora_type", "lycoris_config") if cfg.lora_type == "lycoris" else ("lycoris_config",)
        keys, why = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", *lycoris), (
            "model_type 'full' trains every transformer weight, with no adapter")
    elif cfg.lora_type == "lycoris":
        keys, why = ("lora_rank", "lora_alpha", "lora_dropout"), (
            "lora_type 'lycoris' takes its size and dropout from lycoris_config (linear_dim, linear_alpha, dropout)")
    else:
        return []
    notes = []
    if cfg.model_type == "lora" and cfg.lora_type == "lycoris" and getattr(cfg, "_lycoris_config_by_default", False):
        notes.append(f"lycoris_config not set: the LyCORIS network is the one {cfg.lycoris_config} describes "
                     "(SimpleTuner's default file); set lycoris_config to name another")
    unused = [k for k in keys if k in cfg.model_fields_set and getattr(cfg, k) is not None]
    if unused:
        notes.append(f"{', '.join(unused)} not used: {why}; remove {'them' if len(unused) > 1 else 'it'}")
    return notes


def _header_keys(path: str) -> list[str]:
    """The tensor names of a .safetensors file (or of the pytorch_lora_weights.safetensors in a folder), from its
    header only (8-byte length, then JSON); [] for anything that is not safetensors (the adapter's loader reports
    that, with the file's own error)."""
    file = Path(path)
    if file.is_dir():
        file = file / "pytorch_lora_weights.safetensors"
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size)) if 0 < size < 100_000_000 else {}
    except (OSError, struct.error, ValueError):
        return []
    return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else []


def is_dora_file(path: str) -> bool:
    """Whether a LoRA file holds DoRA magnitudes."""
    return any("lora_magnitude_vector" in key for key in _header_keys(path))


def init_lora_problem(path: str) -> str | None:
    """init_lora continues a LoRA in the diffusers layout (what a standard LoRA run saves); a LyCORIS or ComfyUI
    file (difftune writes both too) failed after the caches filled, asking about targets."""
    keys = _header_keys(path)
    if any(".lora_A." in k for k in keys):
        return None
    if any(k.startswith("lycoris_") for k in keys):
        kind = "a LyCORIS network"
    elif any(".lora_down." in k or k.startswith(("lora_unet_", "diffusion_model.")) for k in keys):
        kind = "a LoRA in ComfyUI's or kohya's layout"
    else:
        return None  # anything else: the loader's own message
    return (f"init_lora {path} is {kind}; init_lora takes the diffusers-layout LoRA a standard LoRA run saves "
            "(its pytorch_lora_weights.safetensors, not comfyui_lora.safetensors)")
