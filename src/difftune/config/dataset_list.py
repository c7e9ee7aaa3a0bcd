"""Where a config's dataset list is (`data_backend_config`), for the loader and the web UI alike.

A relative path is read from the folder difftune runs in, as in SimpleTuner. SimpleTuner's web UI writes config
environments (config/NAME/config.json) whose data_backend_config is relative to the folder holding them
("NAME/multidatabackend.json"), which its loader finds there when the working folder lacks it: so does this one,
for a config inside the working folder (from elsewhere, every relative path of the config would miss: the loader
says to run from the project's folder).
An environment's config that does not set data_backend_config reads the multidatabackend.json beside it when there
is one (config/config.json's default, config/multidatabackend.json, is beside it too).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DATASETS = "config/multidatabackend.json"


def dataset_list_location(value: str | None, config_path: Path | None) -> tuple[Path, str | None]:
    """(the dataset list's path, a note when it is not where `value` read from the working folder names). `value`:
    data_backend_config as the config sets it, None when it does not."""
    if value is None:
        default = Path(DEFAULT_DATASETS)
        beside = config_path.parent / "multidatabackend.json" if config_path is not None else None
        if beside is not None and beside.is_file() and beside.resolve() != default.resolve():
            return beside, (f"data_backend_config is not set: the dataset list beside the config, {beside}, is read "
                            f"(not {DEFAULT_DATASETS})")
        return default, None
    given = Path(value)
    if given.is_absolute() or given.exists() or config_path is None:
        return given, None
    if not config_path.resolve().is_relative_to(Path.cwd().resolve()):
        return given, None  # run from outside the project: its relative paths would all miss; said by the loader
    for base in (config_path.parent.parent, config_path.parent):  # the configs folder (SimpleTuner's), then beside
        found = base / given
        if found.is_file():
            return found, (f"data_backend_config {value!r} is not in the folder difftune runs in: {found} is read "
                           "(relative to the folder of the config environments, as SimpleTuner's web UI writes it)")
    return given, None
