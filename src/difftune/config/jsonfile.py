"""Reading the config's JSON files with messages a user can act on.

- an empty file is called empty;
- a trailing comma (`{"a": 1,}`, legal in JavaScript, not in JSON) is named as such at its line;
- a key written twice in one object is a problem (JSON parsers keep the last one silently);
- other syntax errors give line, column and the parser's reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonFileError(Exception):
    """The file cannot be used at all; the message names it."""


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _syntax_message(path: Path, text: str, e: json.JSONDecodeError) -> str:
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
        return (f"{path}: trailing comma at line {line}, column {col} (a comma after the last item of a {closer} "
                "is not allowed in JSON); remove it")
    return f"{path}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}"


def read_json(path: Path, what: str, hint: str, duplicates: list[str] | None = None) -> Any:
    """Parse `path`. Raises JsonFileError when it is missing, unreadable, empty or not JSON. A key that
    appears twice in one object is appended to `duplicates` as a problem (the file is still returned)."""
    if not path.exists():
        raise JsonFileError(f"{path}: {what} not found; {hint}")
    if path.is_dir():
        raise JsonFileError(f"{path}: is a folder, not a {what} file; give the path of the JSON file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not JSON
    except (OSError, UnicodeDecodeError) as e:
        raise JsonFileError(f"{path}: cannot read {what}: {e}") from e
    if not text.strip():
        raise JsonFileError(f"{path}: the {what} file is empty; write a JSON "
                            f"{'list' if what == 'dataset list' else 'object'} in it ({hint})")

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

    try:
        return json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        raise JsonFileError(_syntax_message(path, text, e)) from e
    except RecursionError as e:
        raise JsonFileError(f"{path}: nested too deeply to read") from e
