"""SimpleTuner's legacy config.json keys, which its loader still reads (renamed, or dropped): a working SimpleTuner
config that holds one was refused here as a misspelt key. Each is read as SimpleTuner reads it:

- `save_total_limit` is `checkpoints_total_limit` (config/compat.KEY_ALIASES);
- `vae_cache_preprocess` and `allow_tf32` are the opposites of `vae_cache_ondemand` and `disable_tf32`;
- a config-level `repeats` and the `aspect_ratio_bucket*` keys are dropped, as SimpleTuner drops them, with a note
  (repeats belong to dataset entries; buckets are always by aspect ratio);
- `enable_xformers_memory_efficient_attention`: off is what difftune does; on is refused with what replaces it
  (`attention_mechanism`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from difftune.config.pending import coerce

OPPOSITES = {"vae_cache_preprocess": "vae_cache_ondemand", "allow_tf32": "disable_tf32"}
DROPPED = {
    "repeats": "a config-level repeats is not read (SimpleTuner drops it too): set repeats on the dataset entries",
    "aspect_ratio_bucketing": "buckets are always by aspect ratio here (SimpleTuner drops the key too)",
    "aspect_ratio_bucket_min": "buckets follow each dataset's resolution here (SimpleTuner drops the key too)",
    "aspect_ratio_bucket_max": "buckets follow each dataset's resolution here (SimpleTuner drops the key too)",
}
XFORMERS = "enable_xformers_memory_efficient_attention"


def apply_legacy(raw: dict[str, Any], where_of: Callable[[str], str], problems: list[str],
                 notes: list[str]) -> dict[str, Any]:
    """`raw` (the config's keys, undashed) with the legacy keys read as SimpleTuner reads them."""
    out = dict(raw)
    for old, new in OPPOSITES.items():
        if old not in out:
            continue
        value = coerce(out.pop(old))
        value = bool(value) if value in (0, 1) else value  # "0" and "1", as SimpleTuner's boolean parser reads them
        if not isinstance(value, bool):
            if value is not None:  # null: not set
                problems.append(f"{where_of(old)}: {old}: {value!r} is not true or false")
            continue
        if new in out and coerce(out[new]) not in (None, not value):
            problems.append(f"{where_of(old)}: {old} {str(value).lower()} disagrees with {new} "
                            f"{str(coerce(out[new])).lower()} (opposites: SimpleTuner's older key and this one); keep "
                            f"{new}")
            continue
        out[new] = not value
    for old, why in DROPPED.items():
        if old in out:
            notes.append(f"{where_of(old)}: {old} {out.pop(old)!r}: {why}; remove it")
    if XFORMERS in out:
        value = coerce(out.pop(XFORMERS))
        if value not in (False, None):
            problems.append(f"{where_of(XFORMERS)}: {XFORMERS}: xformers is not used by difftune; attention_mechanism "
                            "'auto' (the default) picks the fastest kernel this GPU has (flash attention, SDPA): remove "
                            "the key")
    return out
