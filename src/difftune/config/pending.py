"""Keys of the spec format that difftune does not implement yet.

A user's config written for the original trainer may carry these. Each is accepted only with a value
that changes nothing (its "off" value); any other value is a config error that says the feature is
not implemented yet, so that no option is ever silently ignored. When a feature lands, its key moves
from here into the schema.
"""

from __future__ import annotations

from typing import Any

# key -> (values that mean "off", what to do instead)
PENDING_TRAIN_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "base_model_precision": (
        ("no_change",),
        "quantized training (int8-quanto, int8-torchao, ...) is not implemented yet; use 'no_change'",
    ),
    "text_encoder_1_precision": (("no_change",), "text-encoder quantization is not implemented yet; use 'no_change'"),
    "text_encoder_2_precision": (("no_change",), "text-encoder quantization is not implemented yet; use 'no_change'"),
    "quantize_via": (("cpu", "accelerator"), "quantize_via only applies to quantized training, not implemented yet"),
    "evaluation_type": ((None, "none", "None"), "CLIP evaluation is not implemented yet; remove evaluation_type"),
    "eval_steps_interval": ((None, 0), "evaluation is not implemented yet; remove eval_steps_interval"),
    "push_to_hub": ((False,), "uploading to the Hugging Face hub is not implemented yet; set push_to_hub to false"),
    "push_checkpoints_to_hub": ((False,), "hub uploads are not implemented yet; set push_checkpoints_to_hub to false"),
    "hub_model_id": ((None, ""), "hub uploads are not implemented yet; remove hub_model_id"),
    "validation_prompt_library": (
        (False,), "the built-in prompt library is not implemented yet; use user_prompt_library",
    ),
    "validation_guidance_rescale": ((0, 0.0), "guidance rescale is not supported by this pipeline; use 0.0"),
    "enable_group_offload": ((False,), "group offload is not implemented yet; set it to false"),
    "group_offload_type": ((None,), "group offload is not implemented yet; remove group_offload_type"),
    "group_offload_blocks_per_group": ((None,), "group offload is not implemented yet"),
    "group_offload_use_stream": ((False,), "group offload is not implemented yet"),
    "enable_model_cpu_offload": ((False,), "model CPU offload is not implemented yet; set it to false"),
    "tread_config": ((None,), "TREAD token routing is not implemented yet; remove tread_config"),
    "crepa_enabled": ((False,), "CREPA temporal regularization is not implemented yet; set crepa_enabled to false"),
    **{key: ((None,), f"CREPA is not implemented yet; remove {key}") for key in (
        "crepa_block_index", "crepa_lambda", "crepa_adjacent_distance", "crepa_adjacent_tau", "crepa_encoder",
        "crepa_encoder_image_size")},
}

PENDING_DATASET_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "vae_cache_clear_each_epoch": ((False,), "vae_cache_clear_each_epoch is not implemented yet"),
}


def pending_problem(table: dict[str, tuple[tuple[Any, ...], str]], key: str, value: Any) -> str | None:
    """The 'not implemented yet' message for `key=value`, or None when the value changes nothing."""
    if key not in table:
        return None
    neutral, message = table[key]
    if isinstance(value, str) and value.lower() in ("false", "null"):
        value = False if value.lower() == "false" else None
    if any(type(value) is type(n) and value == n for n in neutral):
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        if any(type(n) in (int, float) and value == n for n in neutral):
            return None
    return f"not implemented yet: {message}"
