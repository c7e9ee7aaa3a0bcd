"""Datasets that live elsewhere (type 'huggingface', 'csv', 'aws'): each is downloaded into its instance_data_dir
before discovery, an image (or clip) with a caption file beside it, and from then on it is a local folder, so
buckets, crops, caches, resume and the data report work the same for every type.

Each type's module has `fetch(ds, folder, say)`: it fills `folder`, skips what an earlier run already wrote
(a killed download goes on where it stopped), writes every file atomically (a temporary name, then a rename),
reports and skips an item it cannot use (a broken image, a missing URL), and raises SourceError, naming the
dataset and the key to fix, when the source itself cannot be read. Only process 0 fetches
(train/setup.prepare_data); the others wait at a barrier and then read the folder.

The folder rules all types share live here: `open_folder` (whose download the folder holds, by its manifest),
`save_manifest`, `write_atomic` / `partial` (one temporary-name scheme) and `clean_partial`.
"""

from __future__ import annotations

import importlib
import json
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from difftune.config.datasets import REMOTE_TYPES, ConditioningDataset, ImageDataset
from difftune.data.discovery import SOURCE_LEFT_OUT as LEFT_OUT  # noqa: F401 (the names the sources use)
from difftune.data.discovery import SOURCE_MANIFEST as MANIFEST  # noqa: F401

MODULES = {"huggingface": "huggingface", "csv": "csv_table", "aws": "s3"}
assert set(MODULES) == set(REMOTE_TYPES)
PARTIAL = ".part"  # a file being written is `.<its name>.<random>.part`: hidden, so discovery passes over it
LEFTOVERS = (PARTIAL, ".tmp")  # what clean_partial removes (a hidden *.tmp is a temporary file by any convention)


class SourceError(Exception):
    """A dataset's source cannot be read (no such dataset, bucket or table, a missing column, no credentials)."""


def fetch_all(datasets: Iterable[ImageDataset], say: Callable[[str], None] = print) -> None:
    """Download every dataset of a remote type into its folder (a no-op for local folders)."""
    for ds in datasets:
        if ds.type == "local" or ds.disabled:
            continue
        folder = Path(ds.instance_data_dir).expanduser()
        module = importlib.import_module(f"difftune.data.sources.{MODULES[ds.type]}")
        module.fetch(ds, folder, say)


# --- the download folder --------------------------------------------------------------------------------------

def open_folder(ds: ImageDataset | ConditioningDataset, folder: Path, identity: dict[str, Any], fix: str, *,
                other: Callable[[dict[str, Any]], str], strangers: str) -> dict[str, Any] | None:
    """The folder's manifest when it holds this source's download (every key of `identity` matches), after removing
    what a killed run left half written; None for a new or empty folder (hidden files aside). Refused, never
    emptied: a path that is a file, an unreadable manifest, another source's download ("<where> holds
    {other(manifest)}") and files without a manifest ("<where> already holds files that {strangers}")."""
    found = read_folder(ds, folder, identity, fix, other=other, strangers=strangers)
    if found is not None:
        clean_partial(folder)
    return found


def read_folder(ds: ImageDataset | ConditioningDataset, folder: Path, identity: dict[str, Any], fix: str, *,
                other: Callable[[dict[str, Any]], str], strangers: str) -> dict[str, Any] | None:
    """open_folder without writing anything (for a scan that only looks: the web UI's)."""
    where = _where(ds, folder)
    if folder.exists() and not folder.is_dir():
        raise SourceError(f"{where} is a file, not a folder; {fix}")
    path = folder / MANIFEST
    if path.is_file():
        try:
            found = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(found, dict):
                raise ValueError(f"a JSON {type(found).__name__}, not an object")
        except (OSError, ValueError) as e:
            raise SourceError(f"{where}: its {MANIFEST} cannot be read ({e}); {fix}") from e
        if any(found.get(key) != value for key, value in identity.items()):
            raise SourceError(f"{where} holds {other(found)}; {fix}")
        return found
    first = first_visible(folder)
    if first is not None:
        raise SourceError(f"{where} already holds files that {strangers} ({first}, ...; it has no {MANIFEST}); {fix}")
    return None


def first_visible(folder: Path) -> str | None:
    """The name of a file or folder in `folder` that is not hidden, or None (also for no folder at all)."""
    if not folder.is_dir():
        return None
    return next((p.name for p in folder.iterdir() if not p.name.startswith(".")), None)


def save_manifest(ds: ImageDataset | ConditioningDataset, folder: Path, manifest: dict[str, Any]) -> None:
    """Write the folder's manifest (atomically, and only when it changed: a reused download rewrites nothing),
    making the folder first."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SourceError(f"{_where(ds, folder)} cannot be made ({e}); choose another folder") from e
    write_if_changed(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


@contextmanager
def partial(path: Path) -> Iterator[Path]:
    """A temporary name beside `path` for a file on its way there: the writer fills it, checks it and os.replace()s
    it onto `path`; whatever is still under it at the end (a failed check, an error, Ctrl-C) is removed."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}{PARTIAL}")
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> None:
    with partial(path) as tmp:
        tmp.write_bytes(data)
        os.replace(tmp, path)


def write_if_changed(path: Path, text: str) -> bool:
    """Write `text` to `path` unless it holds that already (a second run rewrites nothing); whether it wrote."""
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except (OSError, UnicodeDecodeError):
        pass
    write_atomic(path, text.encode("utf-8"))
    return True


def clean_partial(folder: Path) -> None:
    """Remove the temporary files a killed run left (hidden, named as `partial` names them), in sub-folders too."""
    for path in folder.rglob(".*"):
        if path.name.endswith(LEFTOVERS) and path.is_file():
            path.unlink(missing_ok=True)


def _where(ds: ImageDataset | ConditioningDataset, folder: Path) -> str:
    return f"dataset {ds.id!r}: instance_data_dir {str(folder)!r}"
