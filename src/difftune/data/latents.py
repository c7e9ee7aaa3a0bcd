"""Fill the latent cache for a dataset: decode, crop, encode in batches of one bucket.

An image-to-image sample also has its input (conditioning) image encoded, with the same bucket and
the same relative crop, so the pair stays spatially aligned. A clip is decoded at its frame times and
every frame gets the same crop. A sample with a loss mask (conditioning_type 'mask') has it given its image's
exact geometry (`mask_pixels`), averaged over each latent cell (`mask_grid`) and cached beside the latents as
its own entry, keyed by the mask file, the image's size, bucket and crop.

A dataset with vae_cache_ondemand gets its items `planned`: cached items whose entries are written by
`fill_latent_cache` when each is first drawn in training (data/batches.py).

A dataset with vae_cache_clear_each_epoch is never cached: its items (`uncached(..., each_epoch=True)`) are encoded
during training, and their random crop is drawn again for each epoch of the dataset (`crop_position` with an epoch).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from difftune.data.cache import DamagedEntry, TensorCache, TextJob
from difftune.data.discovery import Sample
from difftune.data.frames import frame_times
from difftune.data.images import BadImage, fit, load_rgb, prepare
from difftune.data.video import BadVideo, decode_frames

MEDIA_ERRORS = (BadImage, BadVideo, OSError)  # a file that fails with these is reported and skipped


def sample_pixels(sample: Sample, crop_style: str, uv: tuple[float, float]) -> torch.Tensor:
    """An image as [3, H, W], a clip as [3, F, H, W], in [-1, 1], fitted to the sample's bucket."""
    if not sample.frames:
        image = load_rgb(sample.path)
        if sample.sized_by_table and image.size != (sample.width, sample.height):  # metadata_backend 'parquet'
            raise BadImage(f"decodes as {image.width}x{image.height} (as displayed, EXIF rotation applied), but its "
                           f"size was given as {sample.width}x{sample.height}, which chose its bucket; correct the "
                           "size in the caption table's width/height columns (or use metadata_backend 'discovery', "
                           "which measures the files)")
        return prepare(image, sample.bucket, crop_style, uv, sample.downsample)
    frames = decode_frames(sample.path, frame_times(sample.frames, sample.fps))
    return torch.stack([prepare(f, sample.bucket, crop_style, uv, sample.downsample) for f in frames], dim=1)


@dataclass(frozen=True)
class CachedSample:
    """A training item. `latent_file` is None when its dataset encodes on the fly (vae_cache_disable)."""

    sample: Sample
    latent_file: Path | None
    conditioning_file: Path | None
    text_keys: tuple[str, ...]  # one per caption
    empty_key: str  # the text key of the empty caption (caption dropout)
    crop_style: str = "center"
    uv: tuple[float, float] = (0.5, 0.5)
    mask_file: Path | None = None  # the cached loss-mask weights on the latent grid, {"mask": [1, h, w]}
    each_epoch: bool = False  # vae_cache_clear_each_epoch: `uv` is drawn again per epoch (`crop_position`)
    ondemand: str | None = None  # vae_cache_ondemand: its dataset's id; its entries are written when first drawn


def crop_position(sample: Sample, crop_style: str, seed: int, epoch: int | None = None) -> tuple[float, float]:
    """Where a 'random' crop sits: drawn once per file from the seed, so the cache is reproducible; with `epoch`
    (vae_cache_clear_each_epoch), once per file, seed and epoch of its dataset, so a resumed run draws the same."""
    if crop_style != "random":
        return 0.5, 0.5  # fixed positions ('center', 'corner') do not depend on the seed
    text = f"{seed}|{sample.ident}" if epoch is None else f"{seed}|{sample.ident}|epoch {epoch}"
    h = hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()  # a non-UTF-8 file name too
    return int.from_bytes(h[:4], "little") / 2**32, int.from_bytes(h[4:8], "little") / 2**32


def file_key(path: Path, ident: str, bucket: tuple[int, int], extra: object, uv: tuple[float, float]) -> str:
    """A cache key: the file's `ident` (Sample.ident, not where it lies: a moved dataset keeps its entries), its size
    and modification time (a changed file is encoded again), and what its pixels go through."""
    st = path.stat()
    return f"{ident}|{st.st_size}|{st.st_mtime_ns}|{bucket}|{extra}|{uv}"


def conditioning_key(sample: Sample, uv: tuple[float, float]) -> str:
    """The cache key of an image-to-image sample's input image (its own dataset, the same relative name)."""
    assert sample.conditioning is not None
    return file_key(sample.conditioning, f"{sample.ident}#input{sample.conditioning.suffix}", sample.bucket, None, uv)


def latent_key(sample: Sample, crop_style: str, seed: int) -> str:
    """The cache key of a sample's latents (a clip's also holds its frame count and rate, and how its frames are
    picked: "nearest" since frames are the nearest to each time; latents of the frame-hold picking before it, which
    could repeat a frame of a 23.976 fps clip, are encoded again; a resampled clip's "nearest, earlier tie" since a
    time halfway between two frames takes the earlier, where the timestamps' rounding decided before: a clip at its
    own rate has no such times, so its latents stay)."""
    picking = "nearest, earlier tie" if sample.resampled else "nearest"
    extra = (sample.downsample, sample.frames, sample.fps, picking) if sample.frames else sample.downsample
    return file_key(sample.path, sample.ident, sample.bucket, extra, crop_position(sample, crop_style, seed))


def mask_key(sample: Sample, crop_style: str, seed: int) -> str:
    """The cache key of a sample's loss-mask weights: the mask file, and what its geometry follows (the image's
    size, downsample, bucket and crop). The latent grid follows the bucket and the VAE (the cache's identity)."""
    assert sample.mask is not None
    extra = ("mask", sample.width, sample.height, sample.downsample)
    return file_key(sample.mask, f"{sample.ident}#mask{sample.mask.suffix}", sample.bucket, extra,
                    crop_position(sample, crop_style, seed))


def mask_pixels(sample: Sample, crop_style: str, uv: tuple[float, float]) -> torch.Tensor:
    """The loss mask as [1, H, W] in [0, 1] (its red channel; transparency reads as white, as load_rgb composites
    it), with its image's exact geometry: stretched to the image's size when it has another, then the image's
    downsample, resize and crop (`fit`, the same path as the image and an i2i input image)."""
    assert sample.mask is not None
    red = load_rgb(sample.mask).getchannel("R")
    if red.size != (sample.width, sample.height):
        red = red.resize((sample.width, sample.height), Image.Resampling.LANCZOS)
    fitted = fit(red, sample.bucket, crop_style, uv, sample.downsample)
    return torch.from_numpy(np.asarray(fitted, dtype=np.float32) / 255.0)[None]


def mask_grid(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Mask pixels [..., 1, H, W] averaged over each latent cell (the VAE's factor in each direction, as
    SimpleTuner's 'area' interpolation) -> [..., 1, h, w]: a cell half covered weighs 0.5."""
    flat = pixels.reshape(-1, 1, *pixels.shape[-2:]).float()
    grid = torch.nn.functional.interpolate(flat, size=tuple(size), mode="area")
    return grid.reshape(*pixels.shape[:-2], *size)


def text_key(sample: Sample, caption: str, crop_style: str, seed: int) -> str:
    """Captions alone key the text cache, except with an input image, which the encoder also sees."""
    if sample.conditioning is None:
        return caption
    uv = crop_position(sample, crop_style, seed)
    return f"{caption}\x00{conditioning_key(sample, uv)}"


def conditioning_image(sample: Sample, crop_style: str, seed: int) -> Image.Image:
    """The input image as the model sees it: fitted to the target's bucket with the target's crop."""
    assert sample.conditioning is not None
    return fit(load_rgb(sample.conditioning), sample.bucket, crop_style, crop_position(sample, crop_style, seed))


def text_jobs(samples: list[Sample], crop_style: str, seed: int, with_empty: bool) -> list[TextJob]:
    """Every caption of every sample, plus the empty caption when caption dropout may pick it."""
    jobs = []
    for s in samples:
        image = None if s.conditioning is None else (lambda s=s: conditioning_image(s, crop_style, seed))
        captions = s.captions + (("",) if with_empty else ())
        jobs.extend(TextJob(text_key(s, c, crop_style, seed), c, image) for c in captions)
    return jobs


def uncached(sample: Sample, crop_style: str, seed: int, each_epoch: bool = False) -> CachedSample:
    """An item encoded on the fly (vae_cache_disable): it carries what is needed to prepare it. `each_epoch`
    (vae_cache_clear_each_epoch): its crop is drawn per epoch; `uv` is then only the seed's draw, unused."""
    keys = tuple(text_key(sample, c, crop_style, seed) for c in sample.captions)
    return CachedSample(sample, None, None, keys, text_key(sample, "", crop_style, seed), crop_style,
                        crop_position(sample, crop_style, seed), each_epoch=each_epoch)


def fill_latent_cache(
    samples: list[Sample], cache: TensorCache, crop_style: str, seed: int,
    encode: Callable[[torch.Tensor], torch.Tensor], batch_size: int,
    on_progress: Callable[[int], None] | None = None, first_frame: bool = False,
    stats: dict[str, Any] | None = None,
) -> tuple[list[CachedSample], list[tuple[Path, str]]]:
    """Returns the samples with valid cache entries, and the files that failed with their reason;
    `stats["encoded"]` is set to how many of them were encoded now (the rest were in the cache), and
    `stats["black_masks"]` lists the loss masks encoded now that are black over their whole crop.
    `first_frame` (image-to-video): each clip's first frame is also encoded on its own, as the pipeline
    encodes its input image; with the VAE's GroupNorm over all frames it differs from the clip's first
    latent frame."""
    done: list[CachedSample] = []
    failed: list[tuple[Path, str]] = []
    pending: dict[tuple[int, ...], list[tuple[Sample, list[tuple[Path, str]]]]] = defaultdict(list)
    encoded = 0

    for sample in samples:
        try:  # the key stats the file: one that vanished or broke since discovery is reported, not fatal
            keys, masked = entry_keys(sample, crop_style, seed)
        except (OSError, RuntimeError) as e:  # RuntimeError: Path.resolve on a symlink loop (Python < 3.13)
            failed.append((sample.path, f"filesystem error: {e}"))
            continue
        if all(cache.has(key) for _, key in keys) and (masked is None or cache.has(masked)):
            done.append(_cached(sample, cache, keys, crop_style, seed, masked))
            if on_progress:
                on_progress(1)
        else:
            pending[sample.group].append((sample, keys))

    for bucket_group in sorted(pending):
        group = pending[bucket_group]
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            ready, pixels, masks = [], [], {}
            for sample, keys in chunk:
                uv = crop_position(sample, crop_style, seed)
                try:
                    tensors = [sample_pixels(sample, crop_style, uv)]
                except MEDIA_ERRORS as e:
                    failed.append((sample.path, str(e)))
                    continue
                if sample.conditioning is not None:
                    try:
                        tensors.append(prepare(load_rgb(sample.conditioning), sample.bucket, crop_style, uv))
                    except MEDIA_ERRORS as e:
                        failed.append((sample.path, f"its conditioning image {sample.conditioning}: {e}"))
                        continue
                if sample.mask is not None:
                    try:
                        masks[sample.path] = mask_pixels(sample, crop_style, uv)
                    except MEDIA_ERRORS as e:
                        failed.append((sample.path, f"its loss mask {sample.mask}: {e}"))
                        continue
                    if stats is not None and float(masks[sample.path].max()) < 1.5 / 255:  # 0, or a 0/1 mask
                        stats.setdefault("black_masks", []).append(sample.mask)
                ready.append((sample, keys))
                pixels.extend(tensors)
            if pixels:
                with torch.no_grad():
                    latents = encode(torch.stack(pixels)).float().cpu()
                    firsts = encode(torch.stack([p[:, :1] for p in pixels])).float().cpu() if first_frame else None
                offset = 0
                for sample, keys in ready:
                    rows = range(offset, offset + len(keys))  # this sample's rows in the encoded batch
                    offset += len(keys)
                    try:  # an encoder that returns NaN or inf for a file: reported, nothing cached
                        for row, (_, key) in zip(rows, keys, strict=True):
                            first = {"first_frame": firsts[row]} if firsts is not None else {}
                            cache.put(key, {"latents": latents[row]} | first)
                        masked = mask_key(sample, crop_style, seed) if sample.mask is not None else None
                        if masked is not None:  # on the latent grid of this sample's own latents
                            cache.put(masked, {"mask": mask_grid(masks[sample.path], latents[rows[0]].shape[-2:])})
                    except DamagedEntry as e:
                        failed.append((sample.path, str(e)))
                        continue
                    done.append(_cached(sample, cache, keys, crop_style, seed, masked))
                    encoded += 1
            if on_progress:
                on_progress(len(chunk))
    if stats is not None:
        stats["encoded"] = encoded
    done.sort(key=lambda c: (c.sample.dataset_id, str(c.sample.path)))
    return done, failed


def entry_keys(sample: Sample, crop_style: str, seed: int) -> tuple[list[tuple[Path, str]], str | None]:
    """The cache keys of a sample's entries: [(its file, the latents' key)] (+ its input image's), and its loss
    mask's key (None without one). Stats the files: OSError when one vanished."""
    keys = [(sample.path, latent_key(sample, crop_style, seed))]
    if sample.conditioning is not None:
        keys.append((sample.conditioning, conditioning_key(sample, crop_position(sample, crop_style, seed))))
    return keys, (mask_key(sample, crop_style, seed) if sample.mask is not None else None)


def planned(samples: list[Sample], cache: TensorCache, crop_style: str, seed: int,
            dataset_id: str) -> tuple[list[CachedSample], list[tuple[Path, str]]]:
    """vae_cache_ondemand: each sample as a cached item, and the files that failed. An item whose entries are not all
    in the cache, whole (`TensorCache.has`, the check caching makes: a damaged or outdated entry is encoded again),
    gets `ondemand`, its dataset's id: the dataset's writer writes them when the item is first drawn
    (data/batches.py)."""
    items, failed = [], []
    for sample in samples:
        try:
            keys, masked = entry_keys(sample, crop_style, seed)
        except (OSError, RuntimeError) as e:
            failed.append((sample.path, f"filesystem error: {e}"))
            continue
        item = _cached(sample, cache, keys, crop_style, seed, masked)
        written = all(cache.has(key) for _, key in keys) and (masked is None or cache.has(masked))
        items.append(item if written else replace(item, ondemand=dataset_id))
    return items, failed


def _cached(sample: Sample, cache: TensorCache, keys: list[tuple[Path, str]], crop_style: str, seed: int,
            masked: str | None = None):
    conditioning = cache.path(keys[1][1]) if len(keys) > 1 else None
    item = uncached(sample, crop_style, seed)
    return CachedSample(sample, cache.path(keys[0][1]), conditioning, item.text_keys, item.empty_key,
                        crop_style, item.uv, None if masked is None else cache.path(masked))
