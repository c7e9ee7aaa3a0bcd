"""Reading the config's JSON files with messages a user can act on.

- an empty file is called empty;
- a trailing comma (`{"a": 1,}`, legal in JavaScript, not in JSON) is named as such at its line;
- a key written twice in one object is a problem (JSON parsers keep the last one silently);
- other syntax errors give line, column and the parser's reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from difftune.files import read_settings_text


class JsonFileError(Exception):
    """The file cannot be used at all; the message names it."""


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _syntax_message(path: Path | str, text: str, e: json.JSONDecodeError) -> str:
    return f"{path}: {syntax_problem(text, e)}"


def syntax_problem(text: str, e: json.JSONDecodeError) -> str:
    """What is wrong at the error's place, without the file's name: a trailing comma said as such."""
    pos = e.pos
    if pos < len(text) and text[pos] == ",":  # Python 3.13 points at the comma itself, 3.12 at the closer
        pos += 1
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
    before = pos - 1
    while before >= 0 and text[before] in " \t\r\n":
        before -= 1
    if pos < len(text) and text[pos] in "}]" and before >= 0 and text[before] == ",":
        line, col = _line_col(text, before)
        closer = "object" if text[pos] == "}" else "list"
        return (f"trailing comma at line {line}, column {col} (a comma after the last item of "
                f"{'an' if closer == 'object' else 'a'} {closer} is not allowed in JSON); remove it")
    return f"not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}"


def duplicates_hook(path: Path | str, what: str, duplicates: list[str] | None) -> Callable[[list], dict]:
    """json's object_pairs_hook that appends a problem to `duplicates` for a key written twice in one object (JSON
    keeps only the last value, silently)."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out and duplicates is not None:
                entry = out.get("id", dict(items).get("id"))
                where = f"dataset {entry!r}: " if isinstance(entry, str) and what == "dataset list" else ""
                duplicates.append(f"{path}: {where}{key}: the key appears twice in one object (JSON keeps only "
                                  "the last value); keep one")
            out[key] = value
        return out
    return pairs


CONVERT = "difftune reads only JSON configs, not SimpleTuner's TOML or ENV ones: write its keys as a JSON object in"


def _other_format(path: Path, text: str) -> str | None:
    """'TOML' or 'ENV' when a config that is not JSON is one of SimpleTuner's other formats: by its name, else by its
    content (a config.json holding TOML). Called only once the text failed as JSON, so JSON is read whatever the
    name."""
    if (kind := {".toml": "TOML", ".env": "ENV"}.get(path.suffix.lower())) is not None:
        return kind
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if lines and all(re.match(r"(export\s+)?[A-Za-z_]\w*=", line) for line in lines):
        return "ENV"  # NAME=value lines, no spaces around '=' (TOML would read some of them too)
    # a TOML table header or `key = value` first (its content is not parsed: tomllib needs Python 3.11)
    if lines and re.match(r"""\[[^\]]+\]$|("[^"]*"|'[^']*'|[\w.-]+)\s*=\s*\S""", lines[0]):
        return "TOML"
    return None


def sibling_config(path: Path) -> Path | None:
    """SimpleTuner's config.toml or config.env beside a missing config.json."""
    if path.suffix.lower() != ".json":
        return None
    return next((other for other in (path.with_suffix(".toml"), path.with_suffix(".env")) if other.is_file()), None)


def _a_file(what: str) -> str:
    """'a config file', 'a dataset list file' ('config file' names the file already)."""
    return f"a {what}" if what.endswith("file") else f"a {what} file"


def read_json(path: Path, what: str, hint: str, duplicates: list[str] | None = None, *, config: bool = False) -> Any:
    """Parse `path`. Raises JsonFileError when it is missing, unreadable, empty or not JSON. A key that
    appears twice in one object is appended to `duplicates` as a problem (the file is still returned).
    `config`: the training config, where SimpleTuner's TOML and ENV configs get the advice to convert them."""
    if not path.exists():
        if config and (other := sibling_config(path)) is not None:
            raise JsonFileError(f"{path}: {what} not found, but {other} is there; {CONVERT} {path}")
        raise JsonFileError(f"{path}: {what} not found; {hint}")
    if path.is_dir():
        raise JsonFileError(f"{path}: is a folder, not {_a_file(what)}; give the path of the JSON file")
    try:
        text = read_settings_text(path)  # a BOM (Windows editors) is not JSON; a device is not read
    except (OSError, UnicodeDecodeError) as e:
        raise JsonFileError(f"{path}: cannot read {what}: {e}") from e
    if not text.strip():
        raise JsonFileError(f"{path}: the {_a_file(what)[2:]} is empty; write a JSON "
                            f"{'list' if what == 'dataset list' else 'object'} in it ({hint})")

    try:
        return json.loads(text, object_pairs_hook=duplicates_hook(path, what, duplicates))
    except json.JSONDecodeError as e:
        if config and (kind := _other_format(path, text)) is not None:
            target = path if path.suffix.lower() == ".json" else path.with_suffix(".json")
            use = "" if target == path else f" and pass --config {target}"
            raise JsonFileError(f"{path}: this is {'an' if kind == 'ENV' else 'a'} {kind} config, not JSON; {CONVERT} "
                                f"{target}{use}") from e
        raise JsonFileError(_syntax_message(path, text, e)) from e
    except RecursionError as e:
        raise JsonFileError(f"{path}: nested too deeply to read") from e
