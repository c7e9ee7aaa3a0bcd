"""Training items and the batches the loop consumes: latents (cached, or encoded on the fly) plus
cached text conditions.

Which caption a sample trains with (it may have several) and whether caption dropout empties it are
drawn from (seed, epoch, batch index), so a resumed run makes the same choices. So is the random crop of an item
of a vae_cache_clear_each_epoch dataset: from (seed, file, its dataset's epoch: `BucketSampler.drawn_epoch`).

Every cache entry is verified where it is read here (checksum, layout, finite values: `cache.read`). A
damaged entry is deleted, its item is left out of this batch and of the rest of the run, and the
message says so; the next start encodes the file again (the encoders are gone by now). On-the-fly
latents that are not finite are left out the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from difftune.data.cache import DamagedEntry, TensorCache, nonfinite, read_or_drop
from difftune.data.discovery import Sample
from difftune.data.images import load_rgb, prepare
from difftune.data.latents import (
    MEDIA_ERRORS,
    CachedSample,
    crop_position,
    mask_grid,
    mask_pixels,
    sample_pixels,
)
from difftune.data.sampler import BucketSampler

# pixels [B, 3, H, W] (clips: [B, 3, F, H, W]) in [-1, 1] -> latents [B, C, h, w] ([B, C, T, h, w])
Encoder = Callable[[torch.Tensor], torch.Tensor]
Fill = Callable[[list[Sample]], list[tuple[Path, str]]]  # writes samples' cache entries; returns the failures


@dataclass
class Batch:
    latents: torch.Tensor  # [B, C, h, w] normalized latents; clips [B, C, T, h, w]
    text: dict[str, torch.Tensor]  # family-specific, collated
    captions: list[str]
    # [B, C, h, w] latents of the input images (image-to-image), or of each clip's first frame encoded on its
    # own, [B, C, 1, h, w] (image-to-video)
    conditioning: torch.Tensor | None = None
    offset: int = 0  # where this process's slice starts in the global batch (several processes)
    global_size: int = 0  # samples in the global batch (all processes); noise is drawn for all of them
    paths: list = field(default_factory=list)  # the source files, to name them in messages
    # The sampler's state just after this batch was drawn: where a resume continues once it is consumed
    # (batches are read ahead, so the sampler itself may be further on: train/prefetch.py).
    position: dict | None = None
    # [B] bool: which samples are regularisation data (is_regularisation_data, train/regularisation.py); None
    # when none is. A batch holds one dataset, so today it is all or nothing.
    regularisation: torch.Tensor | None = None
    # [B, 1, h, w] loss weights in [0, 1] on the latent grid from the dataset's loss masks (conditioning_type 'mask',
    # train/masked_loss.py); None when its dataset has none (a batch holds one dataset)
    mask: torch.Tensor | None = None

    def _map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        text = {k: move(v) if isinstance(v, torch.Tensor) else v for k, v in self.text.items()}
        cond = None if self.conditioning is None else move(self.conditioning)
        regularisation = None if self.regularisation is None else move(self.regularisation)
        mask = None if self.mask is None else move(self.mask)
        return replace(self, latents=move(self.latents), text=text, conditioning=cond, regularisation=regularisation,
                       mask=mask)

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        """The batch on `device` (the same object when it is there already)."""
        if self.latents.device == torch.device(device):
            return self
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pinned(self) -> Batch:
        """The batch in pinned (page-locked) CPU memory, so a copy to CUDA can run without blocking."""
        return self._map(lambda t: t.pin_memory())


def _afterwards(e: Exception, subject: str) -> str:
    """What becomes of a damaged cache entry: deleted and encoded again, or, in a read-only cache, kept."""
    kept = getattr(e, "kept", None)
    if kept is not None:
        return (f"the cache is read-only, so it stays and the item is left out of every run until the cache's owner "
                f"deletes {kept}")
    return f"{subject} deleted and is encoded again at the next start"


class NoUsableItem(RuntimeError):
    """Every training item was left out while training (damaged cache entries)."""


class TrainingData:
    def __init__(
        self, items: list[CachedSample], text_caches: dict[str, TensorCache], sampler: BucketSampler,
        collate_text: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
        caption_dropout: float = 0.0, seed: int = 0, encode: Encoder | None = None,
        on_skip: Callable[[str], None] | None = None, rank: int = 0, ranks: int = 1, first_frame: bool = False,
        regularisation: frozenset[str] = frozenset(), ondemand: dict[str, Fill] | None = None,
    ):
        """`text_caches`: dataset id -> its text cache. `encode`: the VAE, for on-the-fly items.
        With `ranks` processes the sampler yields global batches and this process takes slice `rank`.
        `regularisation`: ids of the datasets marked is_regularisation_data (their samples are flagged).
        `ondemand`: dataset id -> what writes the cache entries of its samples (vae_cache_ondemand)."""
        self.items = items
        self.samples_digest: str | None = None  # what names the items, once computed (train/resume_settings.py)
        self.text_caches = text_caches
        self.sampler = sampler
        self.collate_text = collate_text
        self.caption_dropout = caption_dropout
        self.seed = seed
        self.encode = encode
        self.on_skip = on_skip
        self.rank, self.ranks = rank, ranks
        self.first_frame = first_frame  # image-to-video: the first frame encoded alone is the conditioning
        self.regularisation = regularisation
        self.ondemand = ondemand or {}
        self.written: set[int] = set()  # on-demand items written (or found whole) since the start
        self.dropped: set[int] = set()  # items left out for the rest of the run (damaged cache entries)

    def _skip(self, index: int, message: str) -> None:
        """Leave an item out for the rest of the run, with its repeats (the same file), and say why."""
        path = self.items[index].sample.path
        self.dropped.update(i for i, c in enumerate(self.items) if c.sample.path == path)
        if self.on_skip:
            self.on_skip(message)
        if len(self.dropped) >= len(self.items):
            raise NoUsableItem("every training item was left out (damaged cache entries, see the warnings); "
                               "run again: the deleted entries are encoded anew at start-up")

    def _text(self, item: CachedSample, key: str) -> dict[str, torch.Tensor]:
        """The verified text embedding; DamagedEntry (file deleted) or FileNotFoundError when unusable."""
        return self.text_caches[item.sample.dataset_id].read(key)

    def _cached_latents(self, chosen: list[tuple[int, CachedSample]]):
        """Verified latents of cached items: (kept positions, latents, conditioning, loss-mask weights)."""
        kept, latents, cond, masks = [], [], [], []
        failed = self._write_ondemand(chosen)
        for position, (index, c) in enumerate(chosen):
            if index in failed:
                continue
            expect = ("latents", "first_frame") if self.first_frame else ("latents",)
            try:
                entry = read_or_drop(c.latent_file, expect)
                extra = read_or_drop(c.conditioning_file, ("latents",)) if c.conditioning_file is not None else None
                weights = read_or_drop(c.mask_file, ("mask",)) if c.mask_file is not None else None
            except (DamagedEntry, FileNotFoundError) as e:
                reason = "missing: deleted earlier as damaged" if isinstance(e, FileNotFoundError) else str(e)
                self._skip(index, f"left out {c.sample.path}: its cached latents are damaged ({reason}); "
                                  + _afterwards(e, "the entry was"))
                continue
            if latents and entry["latents"].shape != latents[0].shape:
                # One bucket, one shape, by construction: an entry that disagrees is not this run's
                c.latent_file.unlink(missing_ok=True)
                self._skip(index, f"left out {c.sample.path}: its cached latents have shape "
                                  f"{tuple(entry['latents'].shape)}, not {tuple(latents[0].shape)} like the rest "
                                  "of its bucket; the entry was deleted")
                continue
            kept.append(position)
            latents.append(entry["latents"])
            if extra is not None:
                cond.append(extra["latents"])
            elif self.first_frame:
                cond.append(entry["first_frame"])
            if weights is not None:
                masks.append(weights["mask"])
        if not kept:
            return [], torch.empty(0), None, None
        return kept, torch.stack(latents), (torch.stack(cond) if cond else None), (torch.stack(masks) if masks else None)

    def _write_ondemand(self, chosen: list[tuple[int, CachedSample]]) -> set[int]:
        """vae_cache_ondemand: the items whose cache entries were not written at the start are encoded and written
        when first drawn (the writer checks each entry as caching does, so another process's or a repeat's entry is
        not encoded twice), then read back like every cached item (so a resumed run, reading them from the cache,
        trains on the same latents). Returns the items that failed: left out for the rest of the run, with the
        reason."""
        missing: dict[str, list[tuple[int, CachedSample]]] = {}
        for index, c in chosen:
            if c.ondemand is not None and index not in self.written:
                missing.setdefault(c.ondemand, []).append((index, c))
        failed: set[int] = set()
        for dataset_id, items in missing.items():
            reasons = dict(self.ondemand[dataset_id]([c.sample for _, c in items]))
            for index, c in items:
                if c.sample.path in reasons:
                    self._skip(index, f"left out {c.sample.path}: {reasons[c.sample.path]}")
                    failed.add(index)
                else:
                    self.written.add(index)
        return failed

    def _latents(self, chosen: list[tuple[int, CachedSample]], epoch: int = 0):
        """(positions in `chosen` that loaded, their latents, their input-image latents, their loss-mask weights).
        `epoch`: of the items' dataset, for those that draw their crop per epoch (vae_cache_clear_each_epoch)."""
        if chosen[0][1].latent_file is not None:
            return self._cached_latents(chosen)
        assert self.encode is not None, "items without cached latents need an encoder"
        kept, pixels, cond_pixels, mask_px = [], [], [], []
        for position, (_, c) in enumerate(chosen):  # on the fly: a file that fails now is skipped and reported
            s = c.sample
            uv = crop_position(s, c.crop_style, self.seed, epoch) if c.each_epoch else c.uv
            try:
                pixels.append(sample_pixels(s, c.crop_style, uv))
                if s.conditioning is not None:
                    cond_pixels.append(prepare(load_rgb(s.conditioning), s.bucket, c.crop_style, uv))
                if s.mask is not None:
                    mask_px.append(mask_pixels(s, c.crop_style, uv))
            except MEDIA_ERRORS as e:
                pixels, cond_pixels, mask_px = pixels[: len(kept)], cond_pixels[: len(kept)], mask_px[: len(kept)]
                if self.on_skip:
                    self.on_skip(f"skipped {s.path}: {e}")
                continue
            kept.append(position)
        if not kept:
            return [], torch.empty(0), None, None
        with torch.no_grad():
            latents = self.encode(torch.stack(pixels)).float().cpu()
            cond = self.encode(torch.stack(cond_pixels)).float().cpu() if cond_pixels else None
            if self.first_frame:
                cond = self.encode(torch.stack([p[:, :1] for p in pixels])).float().cpu()
        finite = [r for r in range(len(kept))
                  if nonfinite({"latents": latents[r]} | ({} if cond is None else {"cond": cond[r]})) is None]
        for r in sorted(set(range(len(kept))) - set(finite)):  # the VAE overflowed on this file (e.g. fp16)
            if self.on_skip:
                self.on_skip(f"skipped {chosen[kept[r]][1].sample.path}: the VAE returned NaN or inf for it")
        masks = mask_grid(torch.stack(mask_px), tuple(latents.shape[-2:])) if mask_px else None
        if len(finite) < len(kept):
            latents, cond = latents[finite], (None if cond is None else cond[finite])
            masks = None if masks is None else masks[finite]
            kept = [kept[r] for r in finite]
        return kept, latents, cond, masks

    def __iter__(self) -> Iterator[Batch]:
        for indices in self.sampler:
            state = self.sampler.state
            rng = np.random.default_rng([self.seed, 3_000_017, state.epoch, state.index])
            draws = {}  # drawn for the whole global batch, in order, so every process agrees
            for i in indices:
                pick = int(rng.integers(len(self.items[i].text_keys)))
                draws[i] = (pick, self.caption_dropout > 0 and rng.random() < self.caption_dropout)
            share = len(indices) // self.ranks
            offset = self.rank * share
            mine = [i for i in indices[offset : offset + share] if i not in self.dropped]
            if not mine:
                continue
            epoch = getattr(self.sampler, "drawn_epoch", state.epoch)  # an evaluation's OnePass has one epoch
            kept, latents, cond, masks = self._latents([(i, self.items[i]) for i in mine], epoch)
            rows, texts, captions, paths, marks = [], [], [], [], []
            for row, i in enumerate(mine[k] for k in kept):
                c = self.items[i]
                pick, dropped = draws[i]
                key = c.empty_key if dropped else c.text_keys[pick]
                try:
                    texts.append(self._text(c, key))
                except (DamagedEntry, FileNotFoundError) as e:
                    reason = "missing: deleted earlier as damaged" if isinstance(e, FileNotFoundError) else str(e)
                    self._skip(i, f"left out {c.sample.path}: the cached text embedding of caption "
                                  f"{key.split(chr(0))[0][:60]!r} is damaged ({reason}); " + _afterwards(e, "it was"))
                    continue
                rows.append(row)
                captions.append("" if dropped else c.sample.captions[pick])
                paths.append(c.sample.path)
                marks.append(c.sample.dataset_id in self.regularisation)
            if not rows:
                continue
            if len(rows) < len(kept):
                latents, cond = latents[rows], (None if cond is None else cond[rows])
                masks = None if masks is None else masks[rows]
            yield Batch(latents, self.collate_text(texts), captions, cond, offset, len(indices), paths,
                        self.sampler.state_dict(), torch.tensor(marks) if any(marks) else None, masks)
