"""Fill the latent cache for a dataset: decode, crop, encode in batches of one bucket."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from difftune.data.cache import TensorCache
from difftune.data.discovery import Sample
from difftune.data.images import BadImage, load_rgb, prepare


@dataclass(frozen=True)
class CachedSample:
    sample: Sample
    latent_file: Path


def crop_position(sample: Sample, crop_style: str, seed: int) -> tuple[float, float]:
    """Where a 'random' crop sits: drawn once per file from the seed, so the cache is reproducible."""
    if crop_style == "center":
        return 0.5, 0.5
    h = hashlib.sha256(f"{seed}|{sample.path}".encode()).digest()
    return int.from_bytes(h[:4], "little") / 2**32, int.from_bytes(h[4:8], "little") / 2**32


def entry_key(sample: Sample, uv: tuple[float, float]) -> str:
    st = sample.path.stat()
    return f"{sample.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{sample.bucket}|{sample.downsample}|{uv}"


def fill_latent_cache(
    samples: list[Sample], cache: TensorCache, crop_style: str, seed: int,
    encode: Callable[[torch.Tensor], torch.Tensor], batch_size: int,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[list[CachedSample], list[tuple[Path, str]]]:
    """Returns the samples with a valid cache entry, and the files that failed with their reason."""
    done: list[CachedSample] = []
    failed: list[tuple[Path, str]] = []
    pending: dict[tuple[int, int], list[tuple[Sample, str, tuple[float, float]]]] = defaultdict(list)
    for sample in samples:
        uv = crop_position(sample, crop_style, seed)
        key = entry_key(sample, uv)
        if cache.get(key) is not None:
            done.append(CachedSample(sample, cache.path(key)))
            if on_progress:
                on_progress(1)
        else:
            pending[sample.bucket].append((sample, key, uv))
    for bucket in sorted(pending):
        group = pending[bucket]
        for start in range(0, len(group), batch_size):
            pixels, ready = [], []
            for sample, key, uv in group[start : start + batch_size]:
                try:
                    pixels.append(prepare(load_rgb(sample.path), bucket, crop_style, uv, sample.downsample))
                    ready.append((sample, key))
                except (BadImage, OSError) as e:
                    failed.append((sample.path, str(e)))
            if pixels:
                with torch.no_grad():
                    latents = encode(torch.stack(pixels)).float().cpu()
                for (sample, key), latent in zip(ready, latents, strict=True):
                    done.append(CachedSample(sample, cache.put(key, {"latents": latent})))
            if on_progress:
                on_progress(len(group[start : start + batch_size]))
    done.sort(key=lambda c: (c.sample.dataset_id, str(c.sample.path)))
    return done, failed
