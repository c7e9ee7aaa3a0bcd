"""Fill the latent cache for a dataset: decode, crop, encode in batches of one bucket.

An image-to-image sample also has its input (conditioning) image encoded, with the same bucket and
the same relative crop, so the pair stays spatially aligned.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from difftune.data.cache import TensorCache, TextJob
from difftune.data.discovery import Sample
from difftune.data.images import BadImage, fit, load_rgb, prepare


@dataclass(frozen=True)
class CachedSample:
    sample: Sample
    latent_file: Path
    conditioning_file: Path | None
    text_key: str


def crop_position(sample: Sample, crop_style: str, seed: int) -> tuple[float, float]:
    """Where a 'random' crop sits: drawn once per file from the seed, so the cache is reproducible."""
    if crop_style == "center":
        return 0.5, 0.5
    h = hashlib.sha256(f"{seed}|{sample.path}".encode()).digest()
    return int.from_bytes(h[:4], "little") / 2**32, int.from_bytes(h[4:8], "little") / 2**32


def file_key(path: Path, bucket: tuple[int, int], extra: object, uv: tuple[float, float]) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{bucket}|{extra}|{uv}"


def text_key(sample: Sample, crop_style: str, seed: int) -> str:
    """Captions alone key the text cache, except with an input image, which the encoder also sees."""
    if sample.conditioning is None:
        return sample.caption
    uv = crop_position(sample, crop_style, seed)
    return f"{sample.caption}\x00{file_key(sample.conditioning, sample.bucket, None, uv)}"


def conditioning_image(sample: Sample, crop_style: str, seed: int) -> Image.Image:
    """The input image as the model sees it: fitted to the target's bucket with the target's crop."""
    assert sample.conditioning is not None
    return fit(load_rgb(sample.conditioning), sample.bucket, crop_style, crop_position(sample, crop_style, seed))


def text_jobs(samples: list[Sample], crop_style: str, seed: int) -> list[TextJob]:
    return [
        TextJob(text_key(s, crop_style, seed), s.caption,
                None if s.conditioning is None else (lambda s=s: conditioning_image(s, crop_style, seed)))
        for s in samples
    ]


def fill_latent_cache(
    samples: list[Sample], cache: TensorCache, crop_style: str, seed: int,
    encode: Callable[[torch.Tensor], torch.Tensor], batch_size: int,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[list[CachedSample], list[tuple[Path, str]]]:
    """Returns the samples with valid cache entries, and the files that failed with their reason."""
    done: list[CachedSample] = []
    failed: list[tuple[Path, str]] = []
    pending: dict[tuple[int, int], list[tuple[Sample, list[tuple[Path, str]]]]] = defaultdict(list)

    for sample in samples:
        uv = crop_position(sample, crop_style, seed)
        keys = [(sample.path, file_key(sample.path, sample.bucket, sample.downsample, uv))]
        if sample.conditioning is not None:
            keys.append((sample.conditioning, file_key(sample.conditioning, sample.bucket, None, uv)))
        if all(cache.get(key) is not None for _, key in keys):
            done.append(_cached(sample, cache, keys, crop_style, seed))
            if on_progress:
                on_progress(1)
        else:
            pending[sample.bucket].append((sample, keys))

    for bucket in sorted(pending):
        group = pending[bucket]
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            ready, pixels = [], []
            for sample, keys in chunk:
                uv = crop_position(sample, crop_style, seed)
                try:
                    tensors = [prepare(load_rgb(sample.path), bucket, crop_style, uv, sample.downsample)]
                except (BadImage, OSError) as e:
                    failed.append((sample.path, str(e)))
                    continue
                if sample.conditioning is not None:
                    try:
                        tensors.append(prepare(load_rgb(sample.conditioning), bucket, crop_style, uv))
                    except (BadImage, OSError) as e:
                        failed.append((sample.path, f"its conditioning image {sample.conditioning}: {e}"))
                        continue
                ready.append((sample, keys))
                pixels.extend(tensors)
            if pixels:
                with torch.no_grad():
                    latents = encode(torch.stack(pixels)).float().cpu()
                flat = [key for _, keys in ready for _, key in keys]
                for key, latent in zip(flat, latents, strict=True):
                    cache.put(key, {"latents": latent})
                done.extend(_cached(sample, cache, keys, crop_style, seed) for sample, keys in ready)
            if on_progress:
                on_progress(len(chunk))
    done.sort(key=lambda c: (c.sample.dataset_id, str(c.sample.path)))
    return done, failed


def _cached(sample: Sample, cache: TensorCache, keys: list[tuple[Path, str]], crop_style: str, seed: int):
    conditioning = cache.path(keys[1][1]) if len(keys) > 1 else None
    return CachedSample(sample, cache.path(keys[0][1]), conditioning, text_key(sample, crop_style, seed))
