"""Root confinement: every path the UI reads or writes stays inside the roots the server started with.

A path is refused when it has a `..` part, a NUL byte, or when it resolves (symlinks followed) to a
place outside every root. Relative paths are taken against the server's working directory, the
same directory `difftune train` and `difftune check` resolve them against.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class PathRefused(Exception):
    """A path outside the roots, or not a path at all. The message says which and why."""


class Roots:
    def __init__(self, roots: Iterable[str | Path], base: str | Path | None = None):
        self.base = Path(base or os.getcwd()).resolve()
        resolved = []
        for root in roots:
            path = Path(root).expanduser()
            if not path.is_absolute():
                path = self.base / path
            if not path.is_dir():
                raise ValueError(f"root {str(path)!r} is not a folder")
            resolved.append(path.resolve())
        if not resolved:
            raise ValueError("give at least one root folder")
        self.roots: list[Path] = resolved

    def __iter__(self):
        return iter(self.roots)

    def absolute(self, raw: str | Path) -> Path:
        """The path as the trainer would see it (relative to base), without resolving symlinks."""
        text = str(raw)
        if "\x00" in text:
            raise PathRefused("the path contains a NUL character")
        if not text.strip():
            raise PathRefused("the path is empty")
        if len(text) > 4096:
            raise PathRefused("the path is too long")
        path = Path(text).expanduser() if text.startswith("~") else Path(text)
        if ".." in path.parts:
            raise PathRefused(f"{text!r}: '..' is not allowed in paths; give the path inside a root")
        return path if path.is_absolute() else self.base / path

    def confine(self, raw: str | Path) -> Path:
        """The resolved path, if it lies inside a root; PathRefused otherwise (also for symlink escapes)."""
        path = self.absolute(raw)
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError) as e:  # symlink loops
            raise PathRefused(f"{str(raw)!r}: cannot resolve the path: {e}") from e
        if not any(resolved == root or resolved.is_relative_to(root) for root in self.roots):
            where = " (a symlink leads outside)" if resolved != path and _lexically_inside(path, self.roots) else ""
            raise PathRefused(f"{str(raw)!r} is outside the folders this server may use{where}; "
                              f"allowed: {', '.join(str(r) for r in self.roots)}")
        return resolved

    def inside(self, raw: str | Path) -> bool:
        try:
            self.confine(raw)
            return True
        except PathRefused:
            return False

    def display(self, path: Path) -> str:
        return str(path)


def _lexically_inside(path: Path, roots: list[Path]) -> bool:
    normal = Path(os.path.normpath(path))
    return any(normal.is_relative_to(root) for root in roots)


# --- which schema fields hold paths ------------------------------------------------------------------

_PATHY = re.compile(r"\b(path|folder|directory)\b|\bfile\b(?! name)", re.IGNORECASE)


def path_kind(name: str, prop: dict[str, Any]) -> str | None:
    """'folder' or 'file' for a string field that names something on disk, else None.

    Read from the schema (field name and the first sentence of its description), so that a new
    path field gets a picker and is confined without a list kept by hand.
    """
    if not _is_string(prop):
        return None
    first = (prop.get("description") or "").split(". ")[0]
    if name.endswith("_dir") or re.search(r"\bfolder\b", first, re.IGNORECASE):
        return "folder"
    if name.endswith("_path") or _PATHY.search(first):
        return "file"
    return None


def _is_string(prop: dict[str, Any]) -> bool:
    """A free string (a fixed list of choices is never a path)."""
    options = [prop, *prop.get("anyOf", [])]
    if any("enum" in o or "const" in o for o in options):
        return False
    return any(o.get("type") == "string" for o in options)


def may_be_remote(prop: dict[str, Any]) -> bool:
    """A field whose value may also be a non-path word (a hub id, 'latest'): see `local_value`."""
    text = (prop.get("description") or "").lower()
    return "hub id" in text or "'latest'" in text


def local_value(roots: Roots, value: str, remote_ok: bool) -> bool:
    """Whether a value of a path field is to be treated as a local path (and so confined)."""
    if not remote_ok:
        return True
    path = Path(value)
    return path.is_absolute() or value.startswith(("~", ".")) or ".." in path.parts or roots.absolute(value).exists()

