"""Checking a config from the page: the messages of `difftune check`, plus root confinement.

Runs in a worker thread (the routes that call it are plain functions), never on the event loop: the
loader touches the filesystem. It reads nothing that confinement has not passed (ui/confine.py).
"""

from __future__ import annotations

import ast
import json
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

from difftune.config.dataset_list import dataset_list_location
from difftune.config.load import (
    ConfigError,
    RunConfig,
    clean_keys,
    load_config,
    load_datasets,
)
from difftune.config.problems import split_problem
from difftune.models.registry import FAMILY_FACTS
from difftune.ui.confine import DATASETS_KEY, parsed_problems, raw_pass, special_problem
from difftune.ui.paths import PathRefused, Roots

log = logging.getLogger("difftune.ui")


def datasets_location(roots: Roots, config_path: Path, config: dict[str, Any]) -> Path:
    """Where the config's dataset list lives (confined; PathRefused otherwise): where the loader reads it
    (config/dataset_list.py), or beside the config when the value is not a path."""
    value = clean_keys(config).get(DATASETS_KEY)
    if value is not None and (not isinstance(value, str) or not value):
        value = str(config_path.parent / "multidatabackend.json")
    found = dataset_list_location(value, config_path)[0]
    parts = Path(value).parts if value is not None else ()
    if not found.exists() and not Path(value or "/").is_absolute() and parts[:1] == (config_path.parent.name,):
        # a new list of a config environment, named as SimpleTuner's web UI names it (env2/multidatabackend.json for
        # config/env2/config.json): written in the environment's folder, where the loader then finds it
        found = config_path.parent.parent / value
    return roots.confine_config(str(found))


def _unexpected(where: Path, e: Exception) -> str:
    """A loader crash (a bug there) still answers with a message, and the log has the traceback."""
    log.exception("the config loader failed")
    return f"{where}: the check stopped on an unexpected error ({type(e).__name__}: {e}); please report it"


def _load(tmp_cfg: Path, tmp_data: Path) -> tuple[RunConfig | None, Any, list[str]]:
    """(RunConfig or None, the dataset plan when the list itself is valid, problems)."""
    problems: list[str] = []
    run_cfg = plan = None
    try:
        run_cfg = load_config(tmp_cfg)
        plan = run_cfg.datasets
    except ConfigError as e:
        problems += e.problems
    except Exception as e:  # noqa: BLE001 - see _unexpected
        problems.append(_unexpected(tmp_cfg, e))
    if run_cfg is None and not any(p.startswith(f"{tmp_data}: ") for p in problems):
        try:  # check stops at a bad config.json; the form shows the dataset problems too
            plan = load_datasets(tmp_data, problems)
        except ConfigError as e:
            problems += e.problems
        except Exception as e:  # noqa: BLE001
            problems.append(_unexpected(tmp_data, e))
    return run_cfg, plan, problems


REPORT_LINES = 30  # of the data report, shown at an empty dataset's folder
_EMPTY = re.compile(r"dataset\(s\) ((?:'(?:[^'\\]|\\.)*'(?:, )?)+) have no usable")


def scan_problems(run_cfg: RunConfig, data_where: str) -> list[str]:
    """What `difftune check` says of the datasets' files (train/plan.discover_all: each dataset has a usable
    file and training has a bucket), without writing metadata or downloading. A dataset without usable files
    is named at its folder, so that the page shows it in that dataset's card."""
    from difftune.train.plan import DataError, discover_all

    try:
        discover_all(run_cfg, write_metadata=False, fetch=False)
    except DataError as e:
        text = str(e)
        first, _, report = text.partition("\n")
        if (m := _EMPTY.match(first)) is not None:
            ids = [ast.literal_eval(i) for i in re.findall(r"'(?:[^'\\]|\\.)*'", m.group(1))]
            # the data report after it holds each left-out file's reason ("see each file's reason below")
            lines = report.split("\n")
            if len(lines) > REPORT_LINES:
                lines = lines[:REPORT_LINES] + [f"... and {len(lines) - REPORT_LINES} more lines (`difftune check` "
                                                "prints them all)"]
            below = "\n".join(["", *lines]) if report else ""
            return [f"{data_where}: dataset {i!r}: instance_data_dir: {first}{below}" for i in ids]
        return [f"{data_where}: {text}"]
    except Exception as e:  # noqa: BLE001 - see _unexpected
        return [_unexpected(Path(data_where), e)]
    return []


def check(roots: Roots, config_path: Path, config: dict[str, Any], datasets: Any,
          scan: bool = False, found: list[str] = ()) -> tuple[dict[str, Any], RunConfig | None]:
    """Validate with `load_config` (the same messages as `difftune check`, files in a temp folder), and
    confine every path the run would use. `datasets`: the dataset list as read (anything but a list gets the
    loader's own problem). `scan`: also scan the datasets' files as `difftune check` does, once everything
    else passes (Check, Save and Start; the check while typing leaves it out). Returns the answer for the page
    and the parsed config. `found`: problems found in reading the files (a key written twice)."""
    problems: list[str] = list(found)
    try:
        data_path = datasets_location(roots, config_path, config)
        if (problem := special_problem(data_path, read_here=True)) is not None:
            problems.append(f"{config_path}: {DATASETS_KEY}: {problem}")
    except PathRefused as e:  # shown at the field; saving there is refused
        problems.append(f"{config_path}: {DATASETS_KEY}: {e}")
        data_path = config_path.parent / "(outside the roots)"
    cfg_where, data_where = str(config_path), str(data_path)
    listed = datasets if isinstance(datasets, list) else []
    raw, refused, cfg, entries = raw_pass(roots, config, listed, cfg_where, data_where)
    with tempfile.TemporaryDirectory(prefix="difftune-ui-") as tmp:
        tmp_cfg, tmp_data = Path(tmp) / "config.json", Path(tmp) / "datasets.json"
        tmp_data.write_text(json.dumps(entries if isinstance(datasets, list) else datasets))
        if isinstance(cfg.get(DATASETS_KEY, ""), str):
            cfg[DATASETS_KEY] = str(tmp_data)
        tmp_cfg.write_text(json.dumps(cfg))
        run_cfg, plan, loaded = _load(tmp_cfg, tmp_data)
        loaded = [p.replace(str(tmp_cfg), cfg_where).replace(str(tmp_data), data_where) for p in loaded]
    family = run_cfg.train.model_family if run_cfg else cfg.get("model_family")
    family = family if isinstance(family, str) and family in FAMILY_FACTS else None
    ids = {e.get("id") for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)}
    parsed = parsed_problems(roots, run_cfg.train if run_cfg else None, plan, family, cfg_where, data_where, ids)
    # a refused key was taken out before loading: what the loader or the defaults say about it is noise
    later = [p for p in loaded + parsed if not any(p.startswith(r) for r in refused)]
    problems = list(dict.fromkeys(problems + raw + later))
    scanned = scan and not problems and run_cfg is not None
    if scanned:  # every path the scan reads has passed confinement above
        problems = scan_problems(run_cfg, data_where)
    answer = {"ok": not problems, "scanned": scanned, "config_path": cfg_where, "datasets_path": data_where,
              "problems": [structured(p, config_path, data_path, listed) for p in problems]}
    return answer, (run_cfg if not problems else None)


def structured(text: str, config_path: Path, data_path: Path, datasets: list[Any]) -> dict[str, Any]:
    p = split_problem(text, (str(config_path), str(data_path)))
    scope = "config" if p.file == str(config_path) else "datasets" if p.file == str(data_path) else "other"
    index = None
    if isinstance(p.dataset, int) and not isinstance(p.dataset, bool):
        index = p.dataset
    elif p.dataset is not None:
        index = next((i for i, d in enumerate(datasets) if isinstance(d, dict) and d.get("id") == p.dataset), None)
    if scope == "datasets" and index is None and p.dataset is None:
        scope = "datasets-list"
    return {"text": p.text, "scope": scope, "dataset_index": index, "key": p.key, "message": p.message,
            "mentions": list(p.mentions)}
