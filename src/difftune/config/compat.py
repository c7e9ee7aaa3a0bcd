"""SimpleTuner spellings that difftune accepts as they are, turned into difftune's before validation.

- family names with underscores (`kandinsky5_image`) -> `kandinsky5-image`;
- key aliases (`validation_steps` -> `validation_step_interval`, `checkpointing_steps` ->
  `checkpoint_step_interval`); both spellings with different values is a problem;
- the `{model_family}` placeholder in any string value (cache folders, output_dir, ...), replaced by the
  family's name at load time, and in dataset entries `{output_dir}` (the config's) and `{id}` (the entry's), which
  SimpleTuner's web UI writes into every cache folder. Another `{word}` in a path is a problem (it would name a
  folder `{word}`);
- config-level dataset settings (`resolution`, `crop`, `caption_strategy`, ...: config/dataset_default_keys.py)
  are defaults for every image or video dataset that does not set its own;
- "did you mean" suggests a known key only when it is the same words, misspelt.

Nothing here imports torch; every function takes plain JSON values (any type: a wrong type is left for
the schema to report).
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from difftune.config.dataset_default_keys import DATASET_DEFAULT_KEYS
from difftune.config.pending import coerce
from difftune.models.registry import FAMILY_FACTS

KEY_ALIASES: dict[str, str] = {
    "validation_steps": "validation_step_interval",
    "checkpointing_steps": "checkpoint_step_interval",
    "save_total_limit": "checkpoints_total_limit",  # SimpleTuner's older name, which its loader still reads
    "crepa_model": "crepa_encoder",  # SimpleTuner's older name of the CREPA encoder
    # SimpleTuner draws flow noise levels as sigmoid(flow_sigmoid_scale * randn): the logit-normal sampling
    # (timestep_sampling's default) with mean 0 and this standard deviation
    "flow_sigmoid_scale": "logit_std",
    # the CLIP model (hub id or folder) that scores validation samples for evaluation_type 'clip'
    "pretrained_evaluation_model_name_or_path": "evaluation_clip_model",
    "model_card_private": "hub_private",  # create the hub repository as private
    # The optimizer's betas. SimpleTuner passes them only when both are set (a lone one is dropped, silently);
    # here each sets its own beta of every optimizer, and both spellings with different values is a problem.
    "optimizer_beta1": "adam_beta1",
    "optimizer_beta2": "adam_beta2",
    # A list of module names for peft's LoraConfig(target_modules=...), standard LoRA only, as lora_target_modules
    "peft_lora_target_modules": "lora_target_modules",
    # Video models: the frames per second of the clips trained on and of the validation videos written
    "framerate": "frame_rate",
}
PLACEHOLDERS = ("model_family",)
ENTRY_PLACEHOLDERS = ("output_dir", "id")  # in dataset entries only, as SimpleTuner fills them


def written_spellings(*raws: dict[str, Any]) -> dict[str, str]:
    """difftune key -> the alias (KEY_ALIASES) the config wrote it as, when difftune's own name is not written too:
    the schema's messages name the key the user wrote."""
    keys = {key.lstrip("-") for raw in raws for key in raw}
    return {key: alias for alias, key in KEY_ALIASES.items() if alias in keys and key not in keys}


# Values that are text, not paths: a `{...}` in them is left alone.
TEXT_KEYS = frozenset({"validation_prompt", "validation_negative_prompt", "instance_prompt", "tracker_project_name",
                       "tracker_run_name", "captions",  # a generated conditioning dataset's captions

                       # commands whose {placeholders} train/scripts.py fills when it runs them
                       "post_checkpoint_script", "post_upload_script"})
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def family_name(value: Any) -> Any:
    """`kandinsky5_image` -> `kandinsky5-image` (SimpleTuner's spelling); other values unchanged."""
    if isinstance(value, str) and value not in FAMILY_FACTS and value.replace("_", "-") in FAMILY_FACTS:
        return value.replace("_", "-")
    return value


def apply_key_aliases(raw: dict[str, Any], where_of: Any, problems: list[str],
                      aliases: dict[str, str] = KEY_ALIASES) -> dict[str, Any]:
    """Rename alias keys to difftune's; `where_of(key)` says where a key was written. `aliases`: the config's
    (KEY_ALIASES), or a dataset entry's (config/regularisation_keys.DATASET_KEY_ALIASES)."""
    out = dict(raw)
    for alias, key in aliases.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if coerce(value) is None:  # SimpleTuner writes null for "not set": the same as leaving the alias out
            continue
        if key in out and coerce(out[key]) is None:  # null under difftune's name is "not set" too
            del out[key]
        if key in out and coerce(out[key]) != coerce(value):
            problems.append(f"{where_of(alias)}: {alias}: {value!r} disagrees with {key} {out[key]!r} (the same "
                            f"setting, SimpleTuner's name and difftune's); keep one")
            continue
        out.setdefault(key, value)
    return out


def substitute(value: Any, family: str | None, key: str, where: str, problems: list[str],
               entry: dict[str, str | None] | None = None) -> Any:
    """`{model_family}` -> the family, in strings (and lists of strings); unknown placeholders in paths reported.
    `entry`: a dataset entry's `{output_dir}` and `{id}` (None: the entry has none, and using it is a problem). In a
    dataset entry the blocks inside it are filled too (a generator's instance_data_dir, parquet.path), with the
    entry's own values: they name folders of that entry."""
    if isinstance(value, list):
        return [substitute(v, family, key, where, problems, entry) for v in value]
    if isinstance(value, dict) and entry is not None:
        return {k: substitute(v, family, f"{key}.{k}", where, problems, entry) for k, v in value.items()}
    if not isinstance(value, str) or key.rpartition(".")[2] in TEXT_KEYS or "{" not in value:
        return value
    known = PLACEHOLDERS + (ENTRY_PLACEHOLDERS if entry is not None else ())
    unknown = [name for name in _PLACEHOLDER.findall(value) if name not in known]
    if unknown:
        problems.append(f"{where}: {key}: {value!r} has the placeholder {{{unknown[0]}}}, which difftune does not "
                        f"fill (it would become a folder literally named so); known: "
                        + ", ".join("{" + p + "}" for p in known))
        return value
    blank = [name for name, filled in (entry or {}).items() if filled is None and "{" + name + "}" in value]
    if blank:  # an entry without a (text) id
        problems.append(f"{where}: {key}: {value!r} has the placeholder {{{blank[0]}}}, but the entry has no {blank[0]} "
                        "to fill it with; give the entry an id, or write the folder out")
        return value
    for name, filled in [("model_family", family), *(entry or {}).items()]:
        if filled is not None:
            value = value.replace("{" + name + "}", filled)
    return value


def substitute_all(raw: dict[str, Any], family: str | None, where_of: Any, problems: list[str],
                   output_dir: str | None = None, entry: bool = False) -> dict[str, Any]:
    """substitute in each value; `entry`: a dataset entry, whose `{output_dir}` and `{id}` are filled too."""
    ident = raw.get("id") if isinstance(raw.get("id"), str) else None
    values = {"output_dir": output_dir, "id": ident} if entry else None
    return {k: substitute(v, family, k, where_of(k), problems, values) for k, v in raw.items()}


def dataset_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """The config-level dataset defaults that are set (None values are not defaults)."""
    return {k: raw[k] for k in DATASET_DEFAULT_KEYS if raw.get(k) is not None}


def _words(key: str) -> list[str]:
    return [w for w in key.lower().split("_") if w]


def _close(a: str, b: str, cutoff: float) -> bool:
    return difflib.SequenceMatcher(None, a, b).ratio() >= cutoff


def suggest(key: str, known: list[str]) -> str:
    """'; did you mean X?' when X is `key` misspelt: the whole key is close (ignoring underscores) and about
    as long, or it has as many words and each is close to a word of X. Otherwise the advice to remove it:
    an unrelated key that merely shares a word (gradient_checkpointing_steps) is not suggested."""
    def plausible(candidate: str) -> bool:
        joined, theirs_joined = key.lower().replace("_", ""), candidate.replace("_", "")
        if abs(len(joined) - len(theirs_joined)) <= 2 and _close(joined, theirs_joined, 0.85):
            return True
        words, theirs = _words(key), _words(candidate)
        if len(theirs) == len(words) + 1 and candidate.endswith("_" + key.lower()):  # frames for num_frames: the
            # only key that ends so, or the count among several (min_frames, max_frames); type: loss_type? not said
            return sum(k.endswith("_" + key.lower()) for k in known) == 1 or candidate == f"num_{key.lower()}"
        return bool(words) and len(words) == len(theirs) and all(
            any(_close(w, t, 0.75) for t in theirs) for w in words)

    for candidate in difflib.get_close_matches(key, known, n=5, cutoff=0.6):
        if plausible(candidate):
            return f"; did you mean {candidate!r}?"
    return "; remove it or check the spelling"
