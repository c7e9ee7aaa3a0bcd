"""Read `config.json` and its dataset list, apply CLI overrides, and validate everything at once.

Every problem is collected and reported together, each naming the file and key and saying the fix.
Nothing here loads a model.
"""

from __future__ import annotations

import json
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from difftune.config import conditioning_keys, dataset_entry_keys, generated_conditioning
from difftune.config.compat import (
    DATASET_DEFAULT_KEYS,
    apply_key_aliases,
    dataset_defaults,
    family_name,
    substitute_all,
    suggest,
    written_spellings,
)
from difftune.config.crepa_keys import ENCODER_ALIASES, crepa_dataset_problems, decodes
from difftune.config.cross_checks import cross_notes
from difftune.config.dataset_entry_keys import check_i2v_validation, video_rate_notes
from difftune.config.dataset_list import dataset_list_location
from difftune.config.dataset_window_keys import schedule_problems
from difftune.config.datasets import (
    DATASET_MODELS,
    REMOTE_TYPES,
    ConditioningDataset,
    DatasetPlan,
    ImageDataset,
    TextEmbedsDataset,
)
from difftune.config.eval_keys import check_eval_datasets
from difftune.config.generated_conditioning import GeneratedConditioning
from difftune.config.jsonfile import JsonFileError, read_json
from difftune.config.latent_cache_keys import ondemand_dataset_problems
from difftune.config.legacy_keys import apply_legacy
from difftune.config.mask_keys import mask_checks
from difftune.config.model_source_keys import check_model_sources
from difftune.config.pending import (
    PENDING_DATASET_KEYS,
    PENDING_TRAIN_KEYS,
    PENDING_VALUES,
    is_pending,
    pending_problem,
)
from difftune.config.regularisation_keys import (
    DATASET_KEY_ALIASES,
    NOT_ON_OTHER_ENTRIES,
    regularisation_problems,
)
from difftune.config.resume_check import batches_problem, fsdp_problem, lora_problem, newest
from difftune.config.rollout_keys import rollout_notes
from difftune.config.schema import TrainConfig
from difftune.config.small_keys import pipeline_notes
from difftune.config.source_aws_keys import AWS_KEYS
from difftune.config.values import overlong_name
from difftune.files import file_in_the_way
from difftune.models.registry import FAMILY_FACTS, family_names

COMMAND_LINE = "command line"
# Without a text_embeds entry, text embeddings are cached here (write_batch_size as before: 32).
DEFAULT_TEXT_CACHE = "cache/text/{model_family}"


class ConfigError(Exception):
    """A config that cannot run. `problems` are complete sentences naming file and key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(["the configuration cannot be used:"] + [f"  - {p}" for p in problems]))


@dataclass(frozen=True)
class RunConfig:
    train: TrainConfig
    datasets: DatasetPlan
    config_path: Path | None

    def notes(self) -> list[str]:
        """What the loader decided for the user (a snapped validation size, where the text cache goes):
        lines to print before the run starts."""
        return (self.train.validation_notes() + rollout_notes(self.train) + cross_notes(self.train)
                + pipeline_notes(self.train) + video_rate_notes(self.train, self.datasets) + list(self.datasets.notes))


def _read_json(path: Path, what: str, hint: str, problems: list[str] | None = None, config: bool = False) -> Any:
    try:
        return read_json(path, what, hint, problems, config=config)
    except JsonFileError as e:
        raise ConfigError([str(e)]) from e


def _suggest(key: str, known: list[str]) -> str:
    return suggest(key, known)


def clean_keys(raw: dict[str, Any], where: str = "", problems: list[str] | None = None) -> dict[str, Any]:
    """`--key` -> `key` (SimpleTuner allows both); the string "null" -> None."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        clean = key.lstrip("-")
        if clean in out and problems is not None:
            problems.append(f"{where}: {clean}: written twice (with and without leading dashes); keep one")
        out[clean] = None if value == "null" else value
    return out


Where = Callable[[str], str]


def _split_known(
    where: str | Where, raw: dict[str, Any], model: type[BaseModel], pending: dict, problems: list[str]
) -> dict[str, Any]:
    """Keys the schema knows; pending keys checked for 'off' values; unknown keys reported."""
    where_of = where if callable(where) else (lambda key, w=where: w)
    known = list(model.model_fields)
    kept: dict[str, Any] = {}
    for key, value in raw.items():
        message = PENDING_VALUES.get((key, value)) if isinstance(value, str) else None
        if message:
            problems.append(f"{where_of(key)}: {key}: {message}")
        elif key in model.model_fields and (long := overlong_name(key, value)) is not None:
            problems.append(f"{where_of(key)}: {key}: {long}")  # left out: asking the file system about it fails
        elif key in model.model_fields:
            kept[key] = value
        elif is_pending(pending, key):
            problem = pending_problem(pending, key, value, raw)
            if problem:
                problems.append(f"{where_of(key)}: {key}={value!r}: {problem}")
        elif model is not TrainConfig and key in TrainConfig.model_fields:  # a config.json key in a dataset entry
            problems.append(f"{where_of(key)}: {key} is a config.json key (it applies to every dataset), not a "
                            "dataset entry's; move it to config.json")
        elif (block := _block_of(model, key)) is not None:  # SimpleTuner habit: num_frames beside the entry's keys
            problems.append(f"{where_of(key)}: {key} belongs in the {block!r} block: write "
                            f"\"{block}\": {{\"{key}\": {json.dumps(value)}}}")
        else:
            problems.append(f"{where_of(key)}: unknown key {key!r}{_suggest(key, known + list(pending))}")
    return kept


def _blocks(model: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """The model's keys whose value is a block of keys (a nested model: a dataset entry's `video`), by key."""
    out = {}
    for name, info in model.model_fields.items():
        for kind in (info.annotation, *typing.get_args(info.annotation)):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                out[name] = kind
    return out


def _block_of(model: type[BaseModel], key: str) -> str | None:
    return next((name for name, block in _blocks(model).items() if key in block.model_fields), None)


_MISSING_HINTS = {
    "model_family": "set it to one of: " + ", ".join(family_names()),
    "instance_data_dir": "set it to the folder of images or clips",
    "cache_dir": "set it to the folder for cached text embeddings",
    "id": "give the entry a unique id",
}


_RANGE_HINTS = {"probability": "disabled: true leaves a dataset out"}  # probability 0, meant as "never draw it"


def _validate(where: str | Where, model: type[BaseModel], data: dict[str, Any], problems: list[str],
              context: dict[str, Any] | None = None) -> Any:
    where_of = where if callable(where) else (lambda key, w=where: w)
    spellings = (context or {}).get("spellings") or {}
    try:
        return model.model_validate(data, context=context)
    except ValidationError as e:
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            first = str(err["loc"][0]) if err["loc"] else ""
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "missing":
                msg = "required key is missing" + (f"; {_MISSING_HINTS[loc]}" if loc in _MISSING_HINTS else "")
            elif err["type"] == "literal_error":
                msg = f"{err['input']!r} is not allowed; {msg.lower()}"
            elif err["type"] == "extra_forbidden" and len(err["loc"]) == 2 and str(err["loc"][0]) in _blocks(model):
                block = _blocks(model)[str(err["loc"][0])]  # a misspelt key inside a block (video.num_frame)
                msg = f"unknown key {err['loc'][1]!r}{_suggest(str(err['loc'][1]), list(block.model_fields))}"
            elif "input" in err and err["input"] is None and err["type"] not in ("value_error", "assertion_error"):
                msg = f"null: {msg}; {_null_fix(model, err['loc'])}"  # JSON's null, not Python's None
            elif "input" in err and err["type"] not in ("value_error", "assertion_error"):
                msg = f"{err['input']!r}: {msg}" + (f"; {_RANGE_HINTS[loc]}" if loc in _RANGE_HINTS
                                                     and err["type"] == "greater_than" and err["input"] == 0 else "")
            where = where_of(first) if first else _where_of_named(where_of, msg, data)
            if first in spellings:  # the key as the file wrote it (validation_steps), not only difftune's name
                loc = f"{spellings[first]} (difftune's {first})" + loc[len(first):]
            problems.append(f"{where}: {loc + ': ' if loc else ''}{msg}")
        return None


def _null_fix(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """What to do about a null a key cannot take: remove the key for its default, which is said when known."""
    info = model.model_fields.get(str(loc[0])) if len(loc) == 1 else None
    if info is not None and info.is_required():
        return "give it a value"
    default = info.get_default(call_default_factory=True) if info is not None else None
    return "remove the key" + (f" for its default ({default!r})" if default is not None else "") + " or give a value"


def _where_of_named(where_of: Where, message: str, data: dict[str, Any]) -> str:
    """Where a problem between keys came from (a model validator's, which names no single key): the sources of the
    keys its message names that `data` sets, the command line, the file, or both; the file when it names none."""
    named = [word for word in re.findall(r"\b[a-z][a-z0-9_]*\b", message) if word in data]
    return " and ".join(dict.fromkeys(where_of(key) for key in named)) or where_of("")


def _entry_where(path: Path, entry: dict[str, Any], index: int) -> str:
    ident = entry.get("id")
    return f"{path}: dataset {ident if isinstance(ident, str) else index!r}"


def load_datasets(
    path: Path, problems: list[str], family: str | None = None, defaults: dict[str, Any] | None = None,
    output_dir: str | None = None, given_on: Callable[[str], bool] = lambda key: False,
) -> DatasetPlan | None:
    """The dataset list at `path`. `family` fills `{model_family}` and names the default text cache, `output_dir`
    fills `{output_dir}` (SimpleTuner's web UI writes it and `{id}` in cache folders);
    `defaults`: config-level resolution, resolution_type, minimum_image_size for entries without their own
    (text_encoder_batch_size: for text_embeds entries)."""
    hint = "create it (see config/multidatabackend.json.example) or set data_backend_config"
    if not path.is_absolute():  # SimpleTuner's rule too, but a run started from another folder misses the file
        hint = (f"data_backend_config is read from the folder difftune runs in ({Path.cwd()}): run from the folder "
                f"that holds {path}, give an absolute path, or {hint.replace(' or set data_backend_config', '')}")
    raw = _read_json(path, "dataset list", hint, problems)
    if not isinstance(raw, list):
        problems.append(f"{path}: the dataset list must be a JSON list of entries, got {type(raw).__name__}")
        return None
    images: list[ImageDataset] = []
    held_out: list[ImageDataset] = []  # dataset_type 'eval': cached, never trained on (train/eval_loss.py)
    embeds: list[TextEmbedsDataset] = []
    conditioning: dict[str, ConditioningDataset] = {}
    generated: dict[str, GeneratedConditioning] = {}  # conditioning id -> what makes its images
    by_generator: set[str] = set()  # the conditioning_data values a generator set
    mirrored: dict[str, dict[str, Any]] = {}  # conditioning id -> size/crop settings (config/conditioning_keys.py)
    unused: dict[str, list[str]] = {}  # conditioning id -> caption/cache keys
    seen: set[str] = set()
    notes: list[str] = []
    defaulted: set[str] = set()  # config-level dataset keys that some entry takes (it does not set its own)
    offered: set[str] = set()  # and those offered to some entry
    for index, entry in enumerate(raw):
        if not isinstance(entry, dict):
            problems.append(f"{path}: entry {index} must be an object")
            continue
        where = _entry_where(path, entry, index)
        entry = apply_key_aliases(clean_keys(entry, where, problems), lambda key, w=where: w, problems,
                                  DATASET_KEY_ALIASES | dataset_entry_keys.ENTRY_ALIASES)
        entry = substitute_all(entry, family, lambda key, w=where: w, problems,
                               output_dir or TrainConfig.model_fields["output_dir"].default, entry=True)
        if dataset_entry_keys.disabled(entry):  # left out, as SimpleTuner leaves it: an old entry kept switched off
            continue  # (a key not implemented here, an id reused) does not block the run
        kind = entry.get("dataset_type", "image")
        if not isinstance(kind, str):
            problems.append(f"{where}: dataset_type: {kind!r} must be one of 'image', 'video', 'eval', 'conditioning' "
                            "or 'text_embeds' (a string)")
            continue
        if (message := PENDING_VALUES.get(("dataset_type", kind))) is not None:
            problems.append(f"{where}: dataset_type: {message}")
            continue
        if kind not in DATASET_MODELS:
            problems.append(f"{where}: dataset_type {kind!r} is unknown; use 'image', 'video', 'eval', 'conditioning' "
                            "or 'text_embeds'")
            continue
        model = DATASET_MODELS[kind]
        if model is not ImageDataset and entry.get("type") in REMOTE_TYPES:
            # SimpleTuner's first example keeps its text cache in S3; here caches and input images are local folders
            problems.append(f"{where}: type {entry['type']!r}: not implemented yet for a {kind} entry (only image, "
                            f"video and eval datasets are downloaded); set type 'local' with a local "
                            f"{'cache_dir' if kind == 'text_embeds' else 'instance_data_dir'}, and remove its "
                            f"{entry['type']} keys")
            continue
        entry = dataset_entry_keys.prepare(entry, where, problems, notes)  # switched-off blocks, ignore_epochs, ...
        if model is ImageDataset:
            given = {k: v for k, v in (defaults or {}).items() if k in DATASET_DEFAULT_KEYS
                     and (k not in AWS_KEYS or entry.get("type") == "aws")  # aws_*: type 'aws' only
                     # a type 'huggingface' entry reads its caption column unless it says otherwise (SimpleTuner)
                     and not (k == "caption_strategy" and entry.get("type") == "huggingface")}
            defaulted |= given.keys() - entry.keys()
            offered |= given.keys()
            entry = {**given, **entry}
        text_batch = (defaults or {}).get("text_encoder_batch_size")
        if model is TextEmbedsDataset and text_batch is not None and entry.get("text_encoder_batch_size") is None:
            # the config-level text_encoder_batch_size: the default of every text_embeds entry (config/small_keys.py)
            entry = {**entry, "text_encoder_batch_size": text_batch}
        if model is ConditioningDataset:  # SimpleTuner's image settings on it: checked against its images below
            entry, mirrored[str(entry.get("id"))], unused[str(entry.get("id"))] = conditioning_keys.split(entry)
        generators: list[Any] = []
        if model is ImageDataset:  # SimpleTuner's generated conditioning images (config/generated_conditioning.py)
            before = entry.get("conditioning_data")
            entry, generators = generated_conditioning.take(entry, where, problems)
            if entry.get("conditioning_data") != before:  # a failed generator is said as such, not as a
                by_generator.add(str(entry["conditioning_data"]))  # conditioning_data naming nothing
        kept = _split_known(where, entry, model, PENDING_DATASET_KEYS | NOT_ON_OTHER_ENTRIES, problems)
        item = _validate(where, model, kept, problems)
        if item is None:
            continue
        notes += dataset_entry_keys.notes(where, item)
        if item.id in seen:
            problems.append(f"{where}: id {item.id!r} is used twice; give each dataset its own id")
        seen.add(item.id)
        if item.disabled:
            continue
        if isinstance(item, ImageDataset | ConditioningDataset) and item.type == "local":  # others: downloaded
            folder = Path(item.instance_data_dir)
            if not folder.is_dir():
                problems.append(f"{where}: instance_data_dir {str(folder)!r} is not a folder; fix the path")
        # (an image entry's cache_dir is datasets' download cache of type 'huggingface', not a latent cache)
        cache = item.cache_dir_vae if isinstance(item, ImageDataset) else getattr(item, "cache_dir", None)
        if cache and (blocker := file_in_the_way(Path(cache))) is not None:
            key = "cache_dir_vae" if isinstance(item, ImageDataset) else "cache_dir"
            problems.append(f"{where}: {key}: {str(blocker)!r} is a file, so the cache folder {cache!r} cannot be "
                            "made; choose another folder")
        if isinstance(item, ImageDataset):
            (held_out if item.dataset_type == "eval" else images).append(item)
            if generators:
                generated_conditioning.add(item, generators[0], where, seen, generated, conditioning, problems, notes)
        elif isinstance(item, ConditioningDataset):
            conditioning[item.id] = item
        else:
            embeds.append(item)
    named_embeds = {e.id: e for e in embeds}
    for ds in images + held_out:
        if ds.text_embeds is not None and ds.text_embeds not in named_embeds:
            problems.append(f"{path}: dataset {ds.id!r}: text_embeds {ds.text_embeds!r} names no enabled "
                            "text_embeds entry; add it or fix the name")
        if ds.conditioning_data is not None and ds.conditioning_data not in {*conditioning, *by_generator}:
            problems.append(
                f"{path}: dataset {ds.id!r}: conditioning_data {ds.conditioning_data!r} names no enabled "
                "dataset of dataset_type 'conditioning'; add one with that id or fix the name"
            )
    if not images and not problems:
        problems.append(f"{path}: no enabled image or video dataset; add an entry with dataset_type 'image' or 'video'")
    conditioning_keys.check(path, {k: v for k, v in mirrored.items() if k in conditioning},
                            {k: v for k, v in unused.items() if k in conditioning}, images + held_out, problems, notes)
    dataset_entry_keys.check_sources(path, images + held_out, conditioning, problems)  # source_dataset_id
    defaults_ = [e for e in embeds if e.default]
    if len(defaults_) > 1:
        problems.append(f"{path}: several text_embeds entries have default: true; keep one")
    chosen = defaults_[0] if defaults_ else (embeds[0] if len(embeds) == 1 else None)
    if len(embeds) > 1 and not defaults_:
        problems.append(f"{path}: several text_embeds entries and none has default: true; mark one")
    text_dir = (defaults or {}).get("cache_dir_text")  # the config's cache_dir_text: the default cache's folder
    if embeds and text_dir:
        notes.append(f"cache_dir_text {text_dir!r} is not used: the text_embeds entries of {path} set the text cache "
                     "folders (cache_dir); remove cache_dir_text")
    if not embeds and family is not None:
        folder = text_dir or DEFAULT_TEXT_CACHE.replace("{model_family}", family)
        ident = next(n for n in ("text-embeds", "text-embeds-default", "difftune-text-embeds") if n not in seen)
        chosen = TextEmbedsDataset(id=ident, default=True, cache_dir=folder, write_batch_size=32,
                                   text_encoder_batch_size=(defaults or {}).get("text_encoder_batch_size"))
        named_embeds[ident] = chosen
        if not text_dir:
            notes.append(f"{path}: no text_embeds entry, so text embeddings are cached in {folder}; add an entry "
                         "with dataset_type 'text_embeds' and cache_dir (or set cache_dir_text) to choose the folder")
        if (blocker := file_in_the_way(Path(folder))) is not None:
            problems.append(f"{path}: the default text cache {folder!r} cannot be made ({str(blocker)!r} is a "
                            "file); add a text_embeds entry with another cache_dir")
    overridden = [k for k in (defaults or {}) if k in offered and k not in defaulted]  # (not aws_* nor a
    # caption_strategy that type 'huggingface' entries do not take)
    if overridden:  # SimpleTuner's meaning (the dataset's own wins), said: nothing silently unused
        one = len(overridden) == 1
        source = "the command line" if all(map(given_on, overridden)) else "config.json"  # `--resolution 96`
        notes.append(f"{source}'s {', '.join(overridden)} appl{'ies' if one else 'y'} to no dataset: every image "
                     f"or video dataset in {path} sets its own; remove {'it' if one else 'them'} from {source}, "
                     "or from the datasets that should take it")
    return DatasetPlan(images=images, evaluation=held_out, text_embeds=chosen, conditioning=conditioning,
                       all_text_embeds=named_embeds, notes=notes, generated=generated)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


def check_paths(train: TrainConfig, where_of: Where, problems: list[str]) -> None:
    """Paths that would fail only after the model loads: fail them now."""
    resume = train.resume_from_checkpoint
    if resume is not None and resume != "latest":
        folder = Path(resume).expanduser()
        if not folder.is_dir():
            problems.append(f"{where_of('resume_from_checkpoint')}: resume_from_checkpoint: {resume!r} does not exist "
                            f"(or is not a folder); use 'latest', the path or the name of a checkpoint folder under "
                            f"{Path(train.output_dir) / 'checkpoints'}, or null (or 'none') to start afresh")
        elif not any((folder / name).is_file() for name in ("trainable.safetensors", "rng.pt", "lr_scheduler.pt")):
            # none of the files only difftune writes (train/checkpoint.py): another trainer's, SimpleTuner's above all
            lora = folder / "pytorch_lora_weights.safetensors"
            instead = (f"start a new run from its weights with init_lora: {str(lora)!r} (and resume_from_checkpoint "
                       "null)" if lora.is_file() else f"use 'latest' or a checkpoint folder under "
                       f"{Path(train.output_dir) / 'checkpoints'}")
            problems.append(f"{where_of('resume_from_checkpoint')}: resume_from_checkpoint: {resume!r} is not a difftune "
                            f"checkpoint (no trainable.safetensors; SimpleTuner's checkpoints cannot be resumed); {instead}")
        elif not (folder / "training_state.json").is_file():
            problems.append(f"{where_of('resume_from_checkpoint')}: resume_from_checkpoint: {resume!r} is not a complete "
                            "checkpoint (no training_state.json); use 'latest' or another checkpoint folder")
    # a changed lora_rank (or adapter type), or an epoch-based run's batches: refused before any model loads
    target = newest(Path(train.output_dir)) if resume == "latest" else Path(resume).expanduser() if resume else None
    if target is not None and (target / "training_state.json").is_file():
        for why in filter(None, (lora_problem(train, target), batches_problem(train, target),
                                 fsdp_problem(train, target))):
            problems.append(f"{where_of('resume_from_checkpoint')}: resume_from_checkpoint: {why}")
    sources = [("pretrained_model_name_or_path", train.pretrained_model_name_or_path, "hub layout, with model_index.json")]
    if train.evaluation_type == "clip":  # the CLIP model loads at the first evaluation: fail its path now
        sources.append(("evaluation_clip_model", train.evaluation_clip_model, "with config.json"))
    if decodes(train):  # DINOv2 loads when the run is built, after caching: fail its path now
        sources.append(("crepa_encoder", ENCODER_ALIASES.get(train.crepa_encoder, train.crepa_encoder),
                        "a transformers DINOv2 model, with config.json"))
    for key, source, layout in sources:
        if source is None:
            continue
        local = Path(source).expanduser()
        if local.exists():
            if not local.is_dir():
                problems.append(f"{where_of(key)}: {key}: {source!r} is a file; give the model's folder ({layout}) "
                                "or a hub id such as owner/name")
        elif source.startswith(("/", ".", "~")) or "\\" in source or (os.sep != "/" and os.sep in source):
            problems.append(f"{where_of(key)}: {key}: the folder {source!r} does not exist; fix the path, or give "
                            "a hub id such as owner/name")
        elif not _HUB_ID.fullmatch(source):
            problems.append(f"{where_of(key)}: {key}: {source!r} is neither an existing folder nor a hub id "
                            "(owner/name, one slash); fix the path")
    check_model_sources(train, where_of, problems)  # config/model_source_keys.py
    blocker = file_in_the_way(Path(train.output_dir))
    if blocker is not None:
        problems.append(f"{where_of('output_dir')}: output_dir: {str(blocker)!r} is a file, so the output folder "
                        f"{train.output_dir!r} cannot be made; choose another folder")


def check_media(train: TrainConfig, plan: DatasetPlan, path: Path, problems: list[str]) -> None:
    """Video datasets need a video family. An image-to-video flavour trains on clips only: an image dataset
    is allowed there as the validation input (eval_dataset_id) and is then not trained on."""
    facts = FAMILY_FACTS[train.model_family]
    for ds in list(plan.images):
        if ds.dataset_type == "video" and not facts.video:
            video_families = [f.name for f in FAMILY_FACTS.values() if f.video]
            problems.append(f"{path}: dataset {ds.id!r}: {train.model_family} trains on images; video datasets "
                            f"need a video family ({', '.join(video_families)}) - set dataset_type 'image' or "
                            "change model_family")
        elif ds.video is not None and facts.first_frame(train.flavour()) and ds.video.num_frames < 5:
            problems.append(f"{path}: dataset {ds.id!r}: video.num_frames {ds.video.num_frames}: image-to-video "
                            "trains the frames after the first latent frame, so clips need at least 5 frames; "
                            "set num_frames to 5 or more")
        elif (ds.dataset_type == "image" and facts.needs_conditioning(train.flavour()) and ds.conditioning_data is None
              and train.validation_using_datasets and ds.id == train.eval_dataset_id):
            plan.images.remove(ds)  # image-to-image: a plain image folder named as the validation input images
            plan.validation_only[ds.id] = ds
        elif ds.dataset_type == "image" and facts.first_frame(train.flavour()):
            if train.validation_using_datasets and ds.id == train.eval_dataset_id:
                plan.images.remove(ds)
                plan.validation_only[ds.id] = ds
            else:
                problems.append(f"{path}: dataset {ds.id!r}: image-to-video flavour {train.flavour()!r} trains on "
                                "clips (their first frame is the input image); make it a video dataset, disable "
                                "it, or name it in eval_dataset_id with validation_using_datasets to validate with it")
    if not plan.images and not problems:
        problems.append(f"{path}: no enabled dataset to train on")


def check_conditioning(train: TrainConfig, plan: DatasetPlan, path: Path, problems: list[str]) -> None:
    """Image-to-image flavours train on pairs; the others must not be given any."""
    facts = FAMILY_FACTS[train.model_family]
    flavour = train.flavour()
    ids = {ds.id for ds in plan.images} | set(plan.conditioning) | set(plan.validation_only)
    if train.validation_using_datasets and train.eval_dataset_id not in ids:
        kinds = "image, video or conditioning" if facts.first_frame(flavour) else "image or conditioning"
        problems.append(f"{path}: eval_dataset_id {train.eval_dataset_id!r} names no enabled {kinds} dataset; "
                        f"choose one of {', '.join(sorted(ids))}")
    for ds in plan.images:
        masks = plan.mask_dir(ds) is not None  # a loss-mask dataset (train/masked_loss.py) is no input image
        if facts.needs_conditioning(flavour) and (ds.conditioning_data is None or masks):
            problems.append(
                f"{path}: dataset {ds.id!r}: flavour {flavour!r} trains on image pairs; set conditioning_data "
                "to the id of a dataset_type 'conditioning' entry holding the input images"
                + (f" ({ds.conditioning_data!r} holds loss masks, conditioning_type 'mask': a dataset names one "
                   "conditioning dataset, so masked loss cannot be combined with image-to-image training)"
                   if masks else "")
            )
        elif not facts.needs_conditioning(flavour) and ds.conditioning_data is not None and not masks:
            key = "conditioning (generated input images)" if ds.conditioning_data in plan.generated else \
                "conditioning_data"
            problems.append(
                f"{path}: dataset {ds.id!r}: {key} is only used by image-to-image flavours "
                f"({', '.join(sorted(facts.conditioning_flavours)) or 'none for ' + train.model_family}); "
                f"remove {key.split()[0]} or pick such a flavour"
            )
        entry = plan.conditioning.get(ds.conditioning_data) if ds.conditioning_data else None
        if entry is not None and Path(entry.instance_data_dir).resolve() == Path(ds.instance_data_dir).resolve():
            plan.notes.append(f"{path}: dataset {ds.id!r}: its conditioning dataset {entry.id!r} is the same folder "
                              f"({entry.instance_data_dir}): every image is its own "
                              + ("loss mask" if masks else "input image (an edit that changes nothing)")
                              + "; point the conditioning entry at the folder of the inputs")
    named = {ds.conditioning_data for ds in [*plan.images, *plan.evaluation]}
    if train.validation_using_datasets:
        named.add(train.eval_dataset_id)
    for ident in sorted(set(plan.conditioning) - named):
        what = (f"flavour {flavour!r} trains without input images" if not facts.needs_conditioning(flavour) else
                "no dataset pairs with it")
        plan.notes.append(f"{path}: conditioning dataset {ident!r} is not used: no dataset names it in "
                          f"conditioning_data ({what}); set conditioning_data on the dataset it belongs to"
                          + ("" if facts.needs_conditioning(flavour) or not facts.conditioning_flavours else
                             f", with an image-to-image flavour ({', '.join(sorted(facts.conditioning_flavours))})")
                          + ", or remove it")


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Validate config file + overrides + dataset list. Raises ConfigError listing every problem.
    A problem in an override (`--key value`) is blamed on the command line, one in the file on the file."""
    cfg_path = Path(path) if path is not None else None
    file_where = str(cfg_path) if cfg_path else COMMAND_LINE
    problems: list[str] = []
    from_file: dict[str, Any] = {}
    data: Any = {}
    if cfg_path is not None:
        data = _read_json(cfg_path, "config file", "copy config/config.json.example to it, or pass --config PATH",
                          problems, config=True)
        if not isinstance(data, dict):
            raise ConfigError([f"{cfg_path}: the config must be a JSON object of keys and values, got "
                               f"{type(data).__name__}"])
        if isinstance(data.get("config"), dict) and set(data) <= {"config", "_metadata"}:
            raise ConfigError([f"{cfg_path}: this is SimpleTuner's web UI template (its settings inside \"config\", "
                               "beside \"_metadata\"): move the keys of \"config\" to the top level of the file"])
        from_file = apply_key_aliases(clean_keys(data, file_where, problems), lambda k: file_where, problems)
    cli = apply_key_aliases(clean_keys(overrides or {}, COMMAND_LINE, problems), lambda k: COMMAND_LINE, problems)

    def where_of(key: str) -> str:
        return COMMAND_LINE if key in cli else file_where

    legacy: list[str] = []  # notes of SimpleTuner's legacy keys, which it drops too
    raw = apply_legacy({**from_file, **cli}, where_of, problems, legacy)
    family = family_name(raw.get("model_family"))
    family = family if isinstance(family, str) and family in FAMILY_FACTS else None
    raw = substitute_all(raw, family, where_of, problems)
    kept = _split_known(where_of, raw, TrainConfig, PENDING_TRAIN_KEYS, problems)
    spellings = written_spellings(data if isinstance(data, dict) else {}, overrides or {})  # framerate, ...
    train = _validate(where_of, TrainConfig, kept, problems, {"spellings": spellings})
    plan = None
    located = None
    if train is not None:
        given = train.data_backend_config if "data_backend_config" in train.model_fields_set else None
        location, located = dataset_list_location(given, cfg_path)
        train.data_backend_config = str(location)  # every later reader (checks, training, the web UI) reads it
        check_paths(train, where_of, problems)
        try:
            plan = load_datasets(Path(train.data_backend_config), problems, train.model_family,
                                 dataset_defaults(train.model_dump(include=set(DATASET_DEFAULT_KEYS)))
                                 | {"text_encoder_batch_size": train.text_encoder_batch_size,
                                    "cache_dir_text": train.cache_dir_text}, train.output_dir,
                                 given_on=lambda key: where_of(key) == COMMAND_LINE)
        except ConfigError as e:
            problems.extend(e.problems)
    if train is not None and plan is not None:
        check_media(train, plan, Path(train.data_backend_config), problems)
        dataset_entry_keys.check_video(train, plan, Path(train.data_backend_config), problems)  # video.is_i2v
        dataset_entry_keys.check_each_epoch(train, plan, Path(train.data_backend_config), problems)
        check_i2v_validation(train, plan, where_of("validation_num_video_frames"), problems)
        check_conditioning(train, plan, Path(train.data_backend_config), problems)
        mask_checks(train, plan, Path(train.data_backend_config), where_of, problems)  # config/mask_keys.py
        check_eval_datasets(train, plan, Path(train.data_backend_config), where_of, problems)  # dataset_type 'eval'
        problems += [f"{train.data_backend_config}: {p}" for p in crepa_dataset_problems(train, plan.discovered())]
        problems += [f"{train.data_backend_config}: {p}" for p in ondemand_dataset_problems(train, plan.images)]
        problems += [f"{train.data_backend_config}: {p}" for p in schedule_problems(plan.images)]
        problems += [f"{train.data_backend_config}: {p}" for p in regularisation_problems(train, plan)]
    if problems or train is None or plan is None:
        raise ConfigError(list(dict.fromkeys(problems)))
    if located is not None:
        plan.notes.append(located)
    plan.notes.extend(legacy)
    return RunConfig(train=train, datasets=plan, config_path=cfg_path)
