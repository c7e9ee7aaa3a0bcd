"""Root confinement: every path the UI reads or writes stays inside the roots the server started with.

A path is refused when it has a `..` part, a NUL byte, or when it resolves (symlinks followed) to a
place outside every root. Relative paths are taken against the server's working directory, the
same directory `difftune train` and `difftune check` resolve them against.
"""

from __future__ import annotations

import os
import re
import stat
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

    def absolute(self, raw: str | Path, expand_user: bool = True) -> Path:
        """The path as the trainer would see it (relative to base), without resolving symlinks.

        `expand_user`: take a leading `~` as the home folder (paths typed into the page). False: take it
        literally. A path from a config or dataset list goes through `confine_config`, which checks both.
        """
        text = str(raw)
        if "\x00" in text:
            raise PathRefused("the path contains a NUL character")
        if not text.strip():
            raise PathRefused("the path is empty")
        if len(text) > 4096:
            raise PathRefused("the path is too long")
        path = Path(text)
        if expand_user and text.startswith("~"):
            try:
                path = path.expanduser()
            except RuntimeError:  # `~nosuchuser`: answered like any other path outside the roots
                raise PathRefused(self._outside(text)) from None
        if ".." in path.parts:
            raise PathRefused(f"{text!r}: '..' is not allowed in paths; give the path inside a root")
        return path if path.is_absolute() else self.base / path

    def confine(self, raw: str | Path, expand_user: bool = True) -> Path:
        """The resolved path, if it lies inside a root; PathRefused otherwise (also for symlink escapes).

        Whether a path outside the roots exists is not told: a missing path, a symlink loop and an
        existing file out there all get the same message.
        """
        path = self.absolute(raw, expand_user)
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError) as e:  # symlink loops
            if not _lexically_inside(path, self.roots):
                raise PathRefused(self._outside(raw)) from None
            raise PathRefused(f"{str(raw)!r}: cannot resolve the path: {e}") from e
        if not any(resolved == root or resolved.is_relative_to(root) for root in self.roots):
            where = " (a symlink leads outside)" if resolved != path and _lexically_inside(path, self.roots) else ""
            raise PathRefused(self._outside(raw, where))
        return resolved

    def confine_config(self, raw: str | Path) -> Path:
        """`confine` for a path a config or dataset list gives, as the trainer reads it: its path keys expand
        a leading `~` as the shell does (config/fields.expand_home), a few keys take it literally (a folder
        `~` under the working folder). Both readings must lie inside the roots, so neither the trainer nor
        the loader is ever given a path outside them, and the answer for one outside is the same whether it
        exists or not. Returns the expanded reading, the one the trainer uses for the dataset list."""
        from difftune.config.fields import expand_home

        literal = self.confine(raw, expand_user=False)
        expanded = expand_home(str(raw))
        if expanded == str(raw):
            return literal
        return self.confine(expanded, expand_user=False)  # refused in the words of the expanded path

    def _outside(self, raw: str | Path, where: str = "") -> str:
        return (f"{str(raw)!r} is outside the folders this server may use{where}; "
                f"allowed: {', '.join(str(r) for r in self.roots)}")

    def inside(self, raw: str | Path, expand_user: bool = True) -> bool:
        try:
            self.confine(raw, expand_user)
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
    if not _is_string(prop) or name.endswith("_column"):  # a column of a caption table, not a file
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


def may_be_remote(prop: dict[str, Any]) -> str | None:
    """'hub' for a field whose value may be a hub id, 'latest' for one that takes the word 'latest'
    (resume_from_checkpoint), None for a field that only holds paths: see `local_value`."""
    text = (prop.get("description") or "").lower()
    return "hub" if "hub id" in text else "latest" if "'latest'" in text else None


def local_value(roots: Roots, value: str, remote: str | bool | None) -> bool:
    """Whether a value of a path field is to be treated as a local path (and so confined).

    A hub id ('org/name') is local when it looks like a path or names something that exists, which is
    what from_pretrained does; for 'latest' fields every other value is a path.
    """
    if not remote:
        return True
    if remote == "latest":
        return value != "latest"
    path = Path(value)
    return (path.is_absolute() or value.startswith(("~", ".")) or ".." in path.parts
            or roots.absolute(value, expand_user=False).exists())


# --- reading files without blocking ------------------------------------------------------------------

MAX_READ_BYTES = 4 * 1024 * 1024  # configs, dataset lists, prompt libraries: far below this


class NotReadable(ValueError):
    """A file the server will not read: not a regular file (a FIFO, a device), or too large."""


def special_file(path: Path) -> bool:
    """Something that exists and is neither a regular file nor a folder (a FIFO, a device, a socket).
    Opening one can block the reader forever or have effects of its own, so nothing here opens it."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_regular(path: Path, limit: int = MAX_READ_BYTES) -> None:
    """NotReadable unless `path` is a regular file of at most `limit` bytes (a missing one passes: the
    reader says so in its own words)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return
    _check_stat(path, st, limit)


def _check_stat(path: Path, st: os.stat_result, limit: int) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise NotReadable(f"{path} is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise NotReadable(f"{path} is not a regular file (a pipe, a device or a socket); give a file")
    if st.st_size > limit:
        raise NotReadable(f"{path} is too large to read here ({st.st_size} bytes; at most {limit})")


def read_regular(path: Path, limit: int = MAX_READ_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. Checked before opening (a device is never
    opened), then opened non-blocking and checked again on the descriptor (a FIFO swapped in between
    is not waited on); reading stops at `limit` even if the file grows."""
    check_regular(path, limit)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _check_stat(path, os.fstat(fd), limit)
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise NotReadable(f"{path} is too large to read here (more than {limit} bytes)")
    return b"".join(chunks)

