"""Which paths a config makes the trainer use, and whether each lies inside the server's roots.

Confinement works on the config as the loader reads it, in two passes, because the loader itself
opens files that a config names (lycoris_config, user_prompt_library) and tests others for existence:

1. `raw_pass`, before loading: every path-valued key of config.json and of each dataset entry, spelled
   as the loader reads it (leading dashes stripped by the loader's own `clean_keys`), with the schema
   default where the key is absent. A refused key is taken out before the loader sees it, so that the
   loader neither opens it nor tells whether it exists, and a file the loader reads must be a regular
   file under the size limit (a FIFO would block the check forever).
2. `parsed_problems`, after loading: every path of the parsed config and dataset plan, defaults
   included: the latent cache (`ImageDataset.vae_cache_root`, the function the data layer calls), the
   default text cache (`DatasetPlan.text_cache_root`, the rule the trainer uses) and the caption table where
   train/plan.py looks for it.

Path keys are found from the schema (ui/paths.path_kind), so a new path key is confined without a list
kept here. Problems are worded like the loader's ("<file>: dataset '<id>': <key>: message") so that
the page shows them at their field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from difftune.config.compat import family_name, substitute_all
from difftune.config.dataset_entry_keys import disabled
from difftune.config.datasets import DatasetPlan, ImageDataset
from difftune.config.extra_output_keys import SCRIPT_KEYS
from difftune.config.load import clean_keys
from difftune.config.schema import TrainConfig
from difftune.config.webhook_keys import is_inline
from difftune.models.registry import FAMILY_FACTS
from difftune.ui import dataset_fields, train_fields
from difftune.ui.paths import MAX_READ_BYTES, PathRefused, Roots, local_value

DATASETS_KEY = "data_backend_config"  # confined by the server: it names the file the page writes
WEB_TYPES = ("local",)  # dataset entry types the web UI trains (form_schema offers only these)


def caption_table_path(roots: Roots, ds: ImageDataset) -> str | None:
    """Where train/plan.caption_table reads the caption table: a relative parquet.path is tried against
    instance_data_dir first, then against the working folder."""
    if ds.caption_strategy != "parquet" or ds.parquet is None:
        return None
    path = Path(ds.parquet.path)
    if not path.is_absolute() and roots.inside(ds.instance_data_dir, expand_user=False):
        beside = roots.absolute(ds.instance_data_dir, expand_user=False) / path
        if beside.is_file():
            return str(beside)
    return ds.parquet.path


def special_problem(path: Path, read_here: bool) -> str | None:
    """A path that exists but must not be opened (a FIFO, a device), or a file the loader reads that
    is too large. A missing path passes: the loader says so in its own words."""
    import stat

    try:
        st = path.stat()
    except (OSError, ValueError):
        return None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return f"{str(path)!r} is not a regular file or folder (a pipe, a device or a socket); give a file"
    if read_here and stat.S_ISREG(st.st_mode) and st.st_size > MAX_READ_BYTES:
        return f"{str(path)!r} is too large to read ({st.st_size} bytes; at most {MAX_READ_BYTES})"
    return None


def value_problem(roots: Roots, value: Any, spec: dict[str, Any], read_here: bool = False) -> str | None:
    """Why one path value cannot be used, or None. Values of the wrong type are the loader's to report."""
    if not isinstance(value, str) or not value or (spec["name"] == "webhook_config" and is_inline(value)):
        return None  # webhook_config's inline JSON is not a path (its URLs are not confined: they are not files)
    try:
        if not local_value(roots, value, spec["remote_ok"]):
            return None
        path = roots.confine_config(value)
    except PathRefused as e:
        return str(e)
    return special_problem(path, read_here)


def id_problem(value: Any) -> str | None:
    """A dataset id names a folder of the default latent cache (cache/vae/<family>/<id>): it must be a
    plain name. The loader accepts any string, so this is checked here (see the note in the report)."""
    if not isinstance(value, str):
        return None
    if any(c in value for c in "/\\\x00") or value.strip() in (".", ".."):
        return (f"{value!r} must be a plain name without '/', '\\' or '..': it names the dataset's "
                "default cache folder (cache/vae/<family>/<id>)")
    return None


def _walk(roots: Roots, values: dict[str, Any], fields: list[dict[str, Any]], where: str, prefix: str,
          problems: list[str], refused: set[str], read_here: bool) -> dict[str, Any]:
    """Problems for the path values of one object (nested objects too); returns it without them."""
    by_name = {f["name"]: f for f in fields}
    kept: dict[str, Any] = {}
    for key, value in values.items():
        spec = by_name.get(key) if isinstance(key, str) else None
        if spec is not None and spec["kind"] == "object" and isinstance(value, dict):
            kept[key] = _walk(roots, value, spec["fields"], where, f"{prefix}{key}.", problems, refused, read_here)
            continue
        problem = value_problem(roots, value, spec, read_here and spec["path"] == "file") if spec and spec["path"] else None
        if problem is None:
            kept[key] = value
        else:
            problems.append(f"{where}: {prefix}{key}: {problem}")
            refused.add(f"{where}: {prefix}{key}")
    return kept


def raw_pass(roots: Roots, config: dict[str, Any], datasets: list[Any], config_where: str,
             data_where: str) -> tuple[list[str], set[str], dict[str, Any], list[Any]]:
    """(problems, refused "<where>: <key>" prefixes, config and datasets for the loader without them)."""
    problems: list[str] = []
    refused: set[str] = set()
    # spelled and filled as the loader does: leading dashes stripped, `{model_family}` replaced
    cfg = clean_keys(config, config_where, problems)  # a key written with and without dashes: refused, as check does
    family = family_name(cfg.get("model_family"))
    family = family if isinstance(family, str) and family in FAMILY_FACTS else None
    cfg = substitute_all(cfg, family, lambda key: config_where, [])
    output_dir = cfg.get("output_dir")  # {output_dir} in entries, filled as the loader fills it
    output_dir = output_dir if isinstance(output_dir, str) and output_dir else TrainConfig.model_fields["output_dir"].default
    specs = [f for f in train_fields() if f["path"] and f["name"] != DATASETS_KEY]
    with_defaults = {f["name"]: cfg.get(f["name"], f["default"]) for f in specs}
    kept = _walk(roots, with_defaults, specs, config_where, "", problems, refused, read_here=True)
    cfg = {k: v for k, v in cfg.items() if k in kept or k not in with_defaults}
    kinds = dataset_fields()
    entries: list[Any] = []
    for index, entry in enumerate(datasets):
        if not isinstance(entry, dict):
            entries.append(entry)
            continue
        ident = entry.get("id")  # named as the loader names it (config/load.py:_entry_where)
        named = f"{data_where}: dataset {ident if isinstance(ident, str) else index!r}"
        entry = substitute_all(clean_keys(entry, named, problems), family, lambda key: data_where, [], output_dir,
                               entry=True)
        kind = entry.get("dataset_type", "image")
        if not isinstance(kind, str):  # named as the loader names an unknown type (a list would crash it)
            entry["dataset_type"] = kind = json.dumps(kind)
        where = f"{data_where}: dataset {entry.get('id', index)!r}"
        if (problem := id_problem(entry.get("id"))) is not None:
            problems.append(f"{where}: id: {problem}")
        if kind in kinds and not disabled(entry):
            entry = _walk(roots, entry, kinds[kind]["fields"], where, "", problems, refused, read_here=False)
        entries.append(entry)
    return problems, refused, cfg, entries


def parsed_problems(roots: Roots, train: TrainConfig | None, plan: DatasetPlan | None, family: str | None,
                    config_where: str, data_where: str, listed_ids: set[str]) -> list[str]:
    """Problems for every path the parsed config and plan make the trainer use, defaults included.
    `listed_ids`: the ids in the dataset list; an entry of the plan that is not there is one the loader
    made up (the default text cache), and its problem is shown at the datasets that use it."""
    problems: list[str] = []
    refused: set[str] = set()
    if train is not None:
        specs = [f for f in train_fields() if f["path"] and f["name"] != DATASETS_KEY]
        values = {f["name"]: getattr(train, f["name"]) for f in specs}
        _walk(roots, values, specs, config_where, "", problems, refused, read_here=False)
        family = train.model_family
        # a user command could touch anything: the page never starts a run that runs one
        problems += [f"{config_where}: {key}: the web UI does not start runs that run commands (they could act "
                     "outside the roots); remove it, or start this run with `difftune train`"
                     for key in SCRIPT_KEYS if getattr(train, key)]
    if plan is None:
        return problems
    kinds = dataset_fields()
    entries = {id(e): e for e in [*plan.discovered(), *plan.validation_only.values(), *plan.conditioning.values(),
                                  *plan.all_text_embeds.values(), *([plan.text_embeds] if plan.text_embeds else [])]}
    for ds in entries.values():
        where = f"{data_where}: dataset {ds.id!r}"
        if ds.id in listed_ids:
            _walk(roots, ds.model_dump(), kinds[ds.dataset_type]["fields"], where, "", problems, refused, False)
        if not isinstance(ds, ImageDataset):
            continue
        if ds.type not in WEB_TYPES:  # a download (credentials, a folder filled from outside) is the command line's job
            problems.append(f"{where}: type {ds.type!r}: the web UI trains local folders only; download the dataset "
                            "with `difftune check` and use type 'local' with its folder, or start this run with "
                            "`difftune train`")
        if (table := caption_table_path(roots, ds)) is not None:
            problems += _default(roots, table, f"{where}: parquet.path", "")
        if family is None:
            continue
        problems += _default(roots, ds.vae_cache_root(family), f"{where}: cache_dir_vae",
                             " - that is the default latent cache; set cache_dir_vae to a folder inside the roots")
        entry = plan.text_embeds_for(ds)
        if entry is None or entry.id not in listed_ids or not entry.cache_dir:  # "": the default folder
            problems += _default(roots, plan.text_cache_root(ds, family), f"{where}: text_embeds",
                                 " - that is the default text cache; add a text_embeds entry whose cache_dir "
                                 "is inside the roots")
    for gen in plan.generated.values():  # generated input images are written before training (plan.py)
        hint = (" - that is the default folder of generated input images; set the generator's instance_data_dir to a "
                "folder inside the roots") if gen.default else ""
        problems += _default(roots, gen.folder, f"{data_where}: dataset {gen.source_id!r}: conditioning[0]: "
                             "instance_data_dir", hint)
    return list(dict.fromkeys(problems))


def _default(roots: Roots, value: str, where: str, hint: str) -> list[str]:
    try:
        roots.confine_config(value)
    except PathRefused as e:
        return [f"{where}: {e}{hint}"]
    return []
