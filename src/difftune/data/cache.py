"""Disk caches of VAE latents and text embeddings (safetensors), keyed by a fingerprint.

A cache folder is named by a hash of everything that changes its content (model identity, sizes,
crop settings); an entry inside by a hash of its own inputs (file path, size, mtime, bucket, crop
position; or caption text). Writes go to a temporary file renamed into place, so a killed run never
leaves a half-written entry; a file that fails to load is deleted and recomputed, never trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from safetensors.torch import load_file, save_file


def fingerprint(data: Any) -> str:
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


class TensorCache:
    """A folder of safetensors files, one per key, under `root/<fingerprint>/`."""

    def __init__(self, root: Path, identity: dict[str, Any]):
        self.folder = Path(root) / fingerprint(identity)
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = self.folder / "fingerprint.json"
        if not meta.exists():
            _atomic_write(meta, json.dumps(identity, indent=2, sort_keys=True, default=str).encode())

    def path(self, key: str) -> Path:
        digest = _digest(key)
        return self.folder / digest[:2] / f"{digest}.safetensors"

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        path = self.path(key)
        if not path.exists():
            return None
        try:
            return load_file(path)
        except Exception:  # noqa: BLE001 - truncated or corrupt: recompute
            path.unlink(missing_ok=True)
            return None

    def has(self, key: str) -> bool:
        """Present and whole (header and size checked, data not read); a damaged file is removed."""
        path = self.path(key)
        if not path.exists():
            return False
        if intact(path):
            return True
        path.unlink(missing_ok=True)
        return False

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> Path:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path


def intact(path: Path) -> bool:
    """A safetensors file whose header parses and whose size matches it: truncation is caught
    without reading the tensors (startup checks every entry; reading them all would take long)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                return False
            header = json.loads(f.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        return size == 8 + n + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


@dataclass(frozen=True)
class TextJob:
    """One text embedding to cache. `image` loads the input image for image-to-image prompts."""

    key: str
    prompt: str
    image: Callable[[], Image.Image] | None = None


TextEncoder = Callable[[list[str], list[Image.Image] | None], list[dict[str, torch.Tensor]]]


def fill_text_cache(
    cache: TensorCache, jobs: Iterable[TextJob], encode: TextEncoder, batch_size: int,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[int, list[tuple[str, str]]]:
    """Encode every job not yet cached. Returns (how many were encoded, [(key, reason) that failed]).

    Prompts with an image go one at a time: their token counts differ with the image size.
    """
    todo = {job.key: job for job in jobs if not cache.has(job.key)}  # has() also drops damaged files
    plain = [j for j in todo.values() if j.image is None]
    for start in range(0, len(plain), batch_size):
        chunk = plain[start : start + batch_size]
        for job, tensors in zip(chunk, encode([job.prompt for job in chunk], None), strict=True):
            cache.put(job.key, tensors)
        if on_progress:
            on_progress(len(chunk))
    failed: list[tuple[str, str]] = []
    for job in (j for j in todo.values() if j.image is not None):
        try:
            image = job.image()
        except Exception as e:  # noqa: BLE001 - a bad input image: report it, keep going
            failed.append((job.key, str(e)))
            continue
        cache.put(job.key, encode([job.prompt], [image])[0])
        if on_progress:
            on_progress(1)
    return len(todo) - len(failed), failed
