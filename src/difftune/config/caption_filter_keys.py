"""`caption_filter_list` (SimpleTuner's, on a text_embeds entry): reading the list and checking every entry
before any model loads. What the entries do is in data/caption_filter.py.

- The value is the list itself, or the path of a `.txt` file (one entry a line; only the line break is taken
  off, so `arafed ` keeps its trailing space, as in SimpleTuner) or of a `.json` file (a list of strings). A
  relative path is taken from the working folder, as SimpleTuner does and as `instance_data_dir` and every
  other path of a dataset entry is here.
- It filters the captions of every dataset whose captions that entry caches (its `text_embeds`, or the default
  entry). SimpleTuner refuses the key on other entries; here it is accepted empty there and otherwise refused
  with the fix (move it to a text_embeds entry), by `prepare_entry` (config/dataset_entry_keys.prepare).
Import-light: no torch.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from difftune.config.jsonfile import JsonFileError, read_json
from difftune.data.caption_filter import CaptionFilter, FilterError
from difftune.files import read_settings_text

KEY = "caption_filter_list"
MAX_BYTES = 4 * 1024 * 1024  # a filter list is a few kilobytes; this refuses a wrong path (a dataset, a model)
OFF = (None, "", [])


def entries(value: Any) -> list[tuple[str, str]] | None:
    """[(where the entry is, entry)], or None when the value is off. ValueError says what is wrong and the fix."""
    if any(value == off and type(value) is type(off) for off in OFF):
        return None
    if isinstance(value, list):
        return [(f"entry {n}", _text(item, f"entry {n}")) for n, item in enumerate(value, 1)]
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is neither a list of filters nor the path of a .txt or .json file of them")
    path = Path(value).expanduser()
    if path.suffix.lower() not in (".txt", ".json"):
        raise ValueError(f"{value!r}: give a .txt file (one filter a line), a .json file (a list of strings) or the "
                         "list itself, e.g. [\"arafed \", \"^there is\"] (a single filter is a list of one)")
    _check_file(path, value)
    if path.suffix.lower() == ".json":
        try:
            data = read_json(path, "caption filter list", "fix the path")
        except JsonFileError as e:
            raise ValueError(str(e)) from e
        if not isinstance(data, list):
            raise ValueError(f"{path}: a caption filter list in JSON is a list of strings, got "
                             f"{type(data).__name__}; write [\"first filter\", \"second filter\"]")
        found = [(f"{path} entry {n}", _text(item, f"{path} entry {n}")) for n, item in enumerate(data, 1)]
    else:
        try:
            text = read_settings_text(path)  # -sig: a byte-order mark is not part of the first filter
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read the caption filter list ({e}); save it as UTF-8 text") from e
        found = [(f"{path} line {n}", line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1)]
    if not any(entry for _, entry in found):
        raise ValueError(f"{path}: the caption filter list has no filters; write one a line (.txt) or a list of "
                         f"strings (.json), or remove {KEY}")
    return found


def build(value: Any) -> CaptionFilter | None:
    """The checked filter of a caption_filter_list value, or None when it is off. ValueError otherwise."""
    found = entries(value)
    if found is None:
        return None
    try:
        return CaptionFilter.parse(found)
    except FilterError as e:
        raise ValueError(str(e)) from e


def prepare_entry(entry: dict[str, Any], where: str, problems: list[str]) -> None:
    """An image, video, eval or conditioning entry's caption_filter_list: dropped when off, else refused."""
    if KEY not in entry or entry.get("dataset_type", "image") == "text_embeds":
        return
    value = entry.pop(KEY)
    if not any(value == off and type(value) is type(off) for off in OFF):
        problems.append(f"{where}: {KEY}: it filters the captions a text_embeds entry caches, so it is written on "
                        "that entry (as in SimpleTuner, which refuses it elsewhere); move it to the text_embeds entry "
                        "(to filter only this dataset's captions, give it a text_embeds entry of its own and name "
                        "that entry in its text_embeds key)")


def _text(item: Any, label: str) -> str:
    if not isinstance(item, str):
        raise ValueError(f"{label} {json.dumps(item)}: a filter is a string; quote it")
    return item


def _check_file(path: Path, value: str) -> None:
    try:
        st = path.stat()
    except OSError as e:
        raise ValueError(f"{value!r}: the caption filter list file does not exist (relative paths are taken from "
                         f"the working folder, {Path.cwd()}); fix the path ({e.strerror})") from e
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{value!r} is not a regular file (a folder, a pipe or a device); give the filter list file")
    if st.st_size > MAX_BYTES:
        raise ValueError(f"{value!r} is {st.st_size} bytes, too large for a caption filter list (at most "
                         f"{MAX_BYTES}); check the path")
