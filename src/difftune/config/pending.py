"""Keys of the spec format (SimpleTuner's) that difftune does not implement yet.

A user's config written for the original trainer may carry these. Each is accepted only with a value
that changes nothing (its "off" value); any other value is a config error that says the feature is
not implemented yet, so that no option is ever silently ignored. When a feature lands, its key moves
from here into the schema.

Three kinds of entries:
- `PENDING_TRAIN_KEYS` / `PENDING_DATASET_KEYS`: key -> (off values, what to do instead).
- `DEPENDS_ON`: a setting of a pending feature that only acts when its switch is on
  (`crepa_similarity_ema_decay` without `crepa_similarity_threshold`): any value is accepted while the
  switch is off, and refused with the switch's message when it is on. Whole families of keys can be
  matched by prefix (`PREFIX_DEPENDS_ON`).
- `PENDING_VALUES`: one value of a key difftune has (`optimizer: adamw_schedulefree`, `type: huggingface`).

Values typed on the command line arrive as strings: `coerce` reads "0.0", "false" or "null" as the
number, boolean or null they spell before they are compared with the off values.
"""

from __future__ import annotations

from typing import Any

# key -> (values that mean "off", what to do instead)
PENDING_TRAIN_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "compress_disk_cache": ((False,), "compressed caches are not implemented yet; set compress_disk_cache to false"),
    "crepa_similarity_threshold": (
        (None,), "the CREPA cut-off on a similarity threshold (crepa_similarity_threshold); use crepa_cutoff_step, "
        "or crepa_scheduler with crepa_lambda_end, to end CREPA, and remove crepa_similarity_threshold",
    ),
    "crepa_use_backbone_features": (
        (False, None), "CREPA against a deeper block of the transformer (crepa_use_backbone_features); difftune aligns "
        "with a DINOv2 encoder (crepa_encoder): set crepa_use_backbone_features to false",
    ),
}

PENDING_DATASET_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "vae_cache_clear_each_epoch": ((False,), "vae_cache_clear_each_epoch is not implemented yet"),
    "is_regularisation_data": ((False, None), "regularisation datasets are not implemented yet; remove the entry "
                                              "or set is_regularisation_data to false"),
    "is_regularization_data": ((False, None), "regularisation datasets are not implemented yet; remove the entry "
                                              "or set is_regularization_data to false"),
}

# A setting that only acts when its switch is on: any value while the switch is off.
DEPENDS_ON: dict[str, str] = {
    "crepa_similarity_ema_decay": "crepa_similarity_threshold",
    "crepa_threshold_mode": "crepa_similarity_threshold",
    "crepa_teacher_block_index": "crepa_use_backbone_features",
}
PREFIX_DEPENDS_ON: dict[str, str] = {
    "crepa_similarity_ema_decay": "crepa_similarity_threshold",
    "crepa_threshold_mode": "crepa_similarity_threshold",
    "crepa_teacher_block_index": "crepa_use_backbone_features",
}

# (key, value) -> message, for keys difftune has, whose other values work
PENDING_VALUES: dict[tuple[str, str], str] = {
    ("optimizer", "adamw_schedulefree"): (
        "not implemented yet: optimizer 'adamw_schedulefree' (schedule-free AdamW needs its train/eval mode "
        "switched around validation and checkpoints); use 'adamw' or 'adamw_bf16' with an lr_scheduler"),
    ("base_model_precision", "int4-torchao"): (
        "not implemented yet: base_model_precision 'int4-torchao' (torchao's int4 weight-only layout needs its "
        "CUDA kernels (tile_packed_to_4d) or the separate mslk package, and could not be tested here); use "
        "'int4-quanto' or 'nf4-bnb' for 4 bits"),
    ("quantize_via", "pipeline"): (
        "not implemented yet: quantize_via 'pipeline' (quantizing while the pipeline loads); use 'cpu' or "
        "'accelerator'"),
    ("type", "huggingface"): (
        "not implemented yet: datasets from the Hugging Face hub (type 'huggingface'); download it and use "
        "type 'local' with instance_data_dir"),
    ("type", "aws"): "not implemented yet: S3 datasets (type 'aws'); copy the files locally and use type 'local'",
    ("type", "csv"): "not implemented yet: CSV datasets (type 'csv'); use type 'local' (caption_strategy 'parquet' "
                     "reads a table of captions)",
}


# The text encoders take the precisions of base_model_precision: the same ones are not implemented yet.
PENDING_VALUES |= {
    (key, value): message.replace("base_model_precision", key)
    for (base, value), message in list(PENDING_VALUES.items()) if base == "base_model_precision"
    for key in ("text_encoder_1_precision", "text_encoder_2_precision")
}


def coerce(value: Any) -> Any:
    """A string as typed on the command line -> the bool, null or number it spells; anything else unchanged."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text in ("true", "false"):
        return text == "true"
    if text in ("null", "none", ""):
        return None if text != "" else ""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return value


def _is_off(neutral: tuple[Any, ...], value: Any) -> bool:
    for candidate in (value, coerce(value)):
        if any(type(candidate) is type(n) and candidate == n for n in neutral):
            return True
        if isinstance(candidate, int | float) and not isinstance(candidate, bool):
            if any(type(n) in (int, float) and candidate == n for n in neutral):
                return True
        if candidate is None and None in neutral:
            return True
    return False


def switch_of(key: str) -> str | None:
    """The switch a setting depends on (None: it stands alone)."""
    if key in DEPENDS_ON:
        return DEPENDS_ON[key]
    if key in PENDING_TRAIN_KEYS:  # a key with its own off values
        return None
    return next((s for p, s in PREFIX_DEPENDS_ON.items() if key.startswith(p)), None)


def is_pending(table: dict[str, tuple[tuple[Any, ...], str]], key: str) -> bool:
    return key in table or (table is PENDING_TRAIN_KEYS and switch_of(key) is not None)


def pending_problem(
    table: dict[str, tuple[tuple[Any, ...], str]], key: str, value: Any, raw: dict[str, Any] | None = None
) -> str | None:
    """The 'not implemented yet' message for `key=value`, or None when the value changes nothing.
    `raw`: the whole config, to see whether the switch of a dependent setting is on."""
    switch = switch_of(key) if table is PENDING_TRAIN_KEYS else None
    if switch is not None:
        raw = raw or {}
        if switch not in raw or pending_problem(table, switch, raw[switch]) is None:
            return None  # the feature is off: its settings change nothing
        if key not in table:
            return f"not implemented yet: {table[switch][1]}"
    if key not in table:
        return None
    neutral, message = table[key]
    if _is_off(neutral, value):
        return None
    return f"not implemented yet: {message}"
