"""Files difftune writes get the permissions any program's files get: 0666 less the umask (0644 with the usual 022).

Two ways of writing leave them private (0600) instead: `tempfile.mkstemp`, which the atomic writes use (write a
temporary file, then rename it into place), and safetensors' `save_file` (0.8 creates its files 0600). A trained LoRA
that a ComfyUI server running as another user cannot read, or a shared cache_dir other users get PermissionError
from, is not what anyone asked for; so whatever is renamed into place gets the ordinary mode first."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path


def _umask() -> int:
    # there is no getter: set and restore, once, at import (before any thread of ours exists)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


CREATE_MODE = 0o666 & ~_umask()


def as_created(target: int | str | Path) -> None:
    """Give a file (path, or an open descriptor) the mode a plain `open(path, "w")` would have given it."""
    if isinstance(target, int):
        os.fchmod(target, CREATE_MODE)
    else:
        os.chmod(target, CREATE_MODE)


def tree_as_created(folder: Path) -> None:
    """Every file under `folder` (checkpoints and results are assembled in a temporary folder, then renamed)."""
    for root, _, names in os.walk(folder):
        for name in names:
            as_created(Path(root) / name)


def writer_prefix() -> str:
    """Temporary files name their writer (host and process), so a later run can tell a killed writer's leftover
    from a file another live process is still writing into the same folder (several processes cache at once):
    data/cache.py's clean_leftovers removes the dead ones' from a cache folder."""
    return f".part-{socket.gethostname()}-{os.getpid()}-"


_PART = re.compile(r"^\.part-(?P<host>.+)-(?P<pid>\d+)-[^-]*\.tmp$")


def clean_leftovers(folder: Path) -> None:
    """Remove the temporary files of writers on this host that are gone (a run killed mid-write)."""
    host = socket.gethostname()
    for path in [*folder.glob("*.tmp"), *folder.glob("*/*.tmp")]:
        found = _PART.match(path.name)
        if found is None or found["host"] != host:
            continue
        try:
            os.kill(int(found["pid"]), 0)
            continue  # its writer is alive (or the pid was reused: left alone, the safe side)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (PermissionError, OverflowError, OSError):
            continue


def file_in_the_way(path: Path) -> Path | None:
    """The file (not folder) at `path` or at one of its parents, which would stop mkdir; None if none."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


MAX_SETTINGS_BYTES = 64 * 2**20  # a config, dataset list, prompt library or filter list: a few kB, never this much


class NotASettingsFile(OSError):
    """A path given as a settings file that is a device or socket, or far too large to be one."""


def read_settings_text(path: str | Path, encoding: str = "utf-8-sig") -> str:
    """The text of a small file named by a config key. A device (/dev/zero) there would be read forever, so only a
    regular file or a pipe is read, at most MAX_SETTINGS_BYTES; an OSError (NotASettingsFile) says why otherwise."""
    import stat

    info = Path(path).stat()
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISFIFO(info.st_mode)):  # a FIFO: `--config <(envsubst < t.json)`
        raise NotASettingsFile(f"{path} is not a regular file (a device or socket); give a file")
    with open(path, "rb") as f:
        data = f.read(MAX_SETTINGS_BYTES + 1)
    if len(data) > MAX_SETTINGS_BYTES:
        raise NotASettingsFile(f"{path} holds more than {MAX_SETTINGS_BYTES // 2**20} MiB, far more than a settings "
                               "file holds; check the path")
    return data.decode(encoding)
