"""The metadata file of a dataset folder (data/discovery.py): each image's displayed size (and whether it is an
animation), each clip's probe, or why the file cannot be used, by its size and mtime, so that a later scan opens only
the files that were added or changed, and forgets removed ones."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from difftune.data.images import BadImage, probe_image
from difftune.files import as_created, clean_leftovers, writer_prefix

# Raised when the probe learns to see more (2: files cut off at their end, a PNG's EXIF after its pixels): entries
# of an earlier probe are read again once, instead of passing such files while their size and time are unchanged
# (An image's entry gained its animated flag as a sixth field: five-field entries are probed again by their length,
# while the clips' entries, whose probe is dear, stay valid.)
PROBE_VERSION = 4  # 3: TIFF, BMP and GIF checked for truncation (data/images.py); 4: GIF clips timed as played


class MetadataCache:
    """{"version": PROBE_VERSION, "entries": {relative path: [size, mtime_ns, width, height, problem, animated]}} for
    one dataset folder (a clip's: [size, mtime_ns, VideoInfo's fields, problem])."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, list] = {}
        self.seen: set[str] = set()
        self.changed = False  # probed a file, or found the file damaged: worth writing
        if path is not None and path.is_file():
            try:
                stored = json.loads(path.read_text())
            except (OSError, ValueError):
                stored = None  # a damaged metadata file only costs a rescan
            # valid JSON but not ours (null, a list), or an earlier probe's (a flat dict): read every file again
            if isinstance(stored, dict) and stored.get("version") == PROBE_VERSION and isinstance(
                    stored.get("entries"), dict):
                self.entries = stored["entries"]
            self.changed = not self.entries

    def size(self, file: Path, rel: str) -> tuple[tuple[int, int] | None, str | None, bool]:
        """((width, height) or None, problem or None, whether the file was probed now)."""
        st = file.stat()
        self.seen.add(rel)
        entry = self.entries.get(rel)
        if entry and len(entry) == 6 and entry[0] == st.st_size and entry[1] == st.st_mtime_ns:
            return (None if entry[2] is None else (entry[2], entry[3])), entry[4], False
        self.changed = True
        try:
            width, height, animated = probe_image(file)
            self.entries[rel] = [st.st_size, st.st_mtime_ns, width, height, None, animated]
            return (width, height), None, True
        except (BadImage, OSError) as e:
            self.entries[rel] = [st.st_size, st.st_mtime_ns, None, None, str(e), False]
            return None, str(e), True

    def animated(self, rel: str) -> bool:
        """Whether the image `size` read last is an animation (after `size`)."""
        return bool(self.entries[rel][5])

    def video(self, file: Path, rel: str):
        """(VideoInfo or None, problem or None, whether the file was probed now)."""
        from difftune.data.video import BadVideo, VideoInfo, probe_video

        st = file.stat()
        self.seen.add(rel)
        entry = self.entries.get(rel)
        if entry and len(entry) == 4 and entry[0] == st.st_size and entry[1] == st.st_mtime_ns:
            return (None if entry[2] is None else VideoInfo(*entry[2])), entry[3], False
        self.changed = True
        try:
            info = probe_video(file)
            self.entries[rel] = [st.st_size, st.st_mtime_ns, list(info.__dict__.values()), None]
            return info, None, True
        except (BadVideo, OSError) as e:
            self.entries[rel] = [st.st_size, st.st_mtime_ns, None, str(e)]
            return None, str(e), True

    def save(self) -> str | None:
        """Write the entries if anything changed; the reason it could not (a read-only cache folder: a shared
        cache whose entries are all made still trains), or None. Losing it only costs a rescan next time."""
        kept = {k: v for k, v in self.entries.items() if k in self.seen}  # removed files go
        if self.path is None or not self.changed and len(kept) == len(self.entries):
            return None
        self.entries = kept
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            clean_leftovers(self.path.parent)  # a save killed midway left its writer-named copy (files.py)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=writer_prefix(), suffix=".tmp")
            as_created(fd)
            with os.fdopen(fd, "w") as f:
                json.dump({"version": PROBE_VERSION, "entries": self.entries}, f)
            os.replace(tmp, self.path)
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return f"the file sizes found could not be kept in {self.path} ({e.strerror or e}): the next scan " \
                   "reads every file again"
        return None
