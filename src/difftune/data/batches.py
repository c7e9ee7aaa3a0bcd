"""Training items and the batches the loop consumes: latents (cached, or encoded on the fly) plus
cached text conditions.

Which caption a sample trains with (it may have several) and whether caption dropout empties it are
drawn from (seed, epoch, batch index), so a resumed run makes the same choices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load_file

from difftune.data.cache import TensorCache
from difftune.data.images import load_rgb, prepare
from difftune.data.latents import MEDIA_ERRORS, CachedSample, sample_pixels
from difftune.data.sampler import BucketSampler

# pixels [B, 3, H, W] (clips: [B, 3, F, H, W]) in [-1, 1] -> latents [B, C, h, w] ([B, C, T, h, w])
Encoder = Callable[[torch.Tensor], torch.Tensor]


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


class TrainingData:
    def __init__(
        self, items: list[CachedSample], text_caches: dict[str, TensorCache], sampler: BucketSampler,
        collate_text: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
        caption_dropout: float = 0.0, seed: int = 0, encode: Encoder | None = None,
        on_skip: Callable[[str], None] | None = None, rank: int = 0, ranks: int = 1, first_frame: bool = False,
    ):
        """`text_caches`: dataset id -> its text cache. `encode`: the VAE, for on-the-fly items.
        With `ranks` processes the sampler yields global batches and this process takes slice `rank`."""
        self.items = items
        self.text_caches = text_caches
        self.sampler = sampler
        self.collate_text = collate_text
        self.caption_dropout = caption_dropout
        self.seed = seed
        self.encode = encode
        self.on_skip = on_skip
        self.rank, self.ranks = rank, ranks
        self.first_frame = first_frame  # image-to-video: the first frame encoded alone is the conditioning

    def _text(self, item: CachedSample, key: str) -> dict[str, torch.Tensor]:
        cache = self.text_caches[item.sample.dataset_id]
        tensors = cache.get(key)
        if tensors is None:
            raise RuntimeError(
                f"text embedding of caption {key.split(chr(0))[0][:60]!r} vanished from {cache.folder}; "
                "run again and it will be recomputed"
            )
        return tensors

    def _latents(self, chosen: list[CachedSample]) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """(positions in `chosen` that loaded, their latents, their input-image latents)."""
        if chosen[0].latent_file is not None:
            files = [load_file(c.latent_file) for c in chosen]
            latents = torch.stack([f["latents"] for f in files])
            cond = None
            if chosen[0].conditioning_file is not None:
                cond = torch.stack([load_file(c.conditioning_file)["latents"] for c in chosen])
            elif self.first_frame:
                cond = torch.stack([f["first_frame"] for f in files])
            return list(range(len(chosen))), latents, cond
        assert self.encode is not None, "items without cached latents need an encoder"
        kept, pixels, cond_pixels = [], [], []
        for position, c in enumerate(chosen):  # on the fly: a file that fails now is skipped and reported
            s = c.sample
            try:
                pixels.append(sample_pixels(s, c.crop_style, c.uv))
                if s.conditioning is not None:
                    cond_pixels.append(prepare(load_rgb(s.conditioning), s.bucket, c.crop_style, c.uv))
            except MEDIA_ERRORS as e:
                pixels = pixels[: len(kept)]
                if self.on_skip:
                    self.on_skip(f"skipped {s.path}: {e}")
                continue
            kept.append(position)
        if not kept:
            return [], torch.empty(0), None
        with torch.no_grad():
            latents = self.encode(torch.stack(pixels)).float().cpu()
            cond = self.encode(torch.stack(cond_pixels)).float().cpu() if cond_pixels else None
            if self.first_frame:
                cond = self.encode(torch.stack([p[:, :1] for p in pixels])).float().cpu()
        return kept, latents, cond

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
            mine = indices[offset : offset + share]
            kept, latents, cond = self._latents([self.items[i] for i in mine])
            if not kept:
                continue
            chosen = [self.items[mine[k]] for k in kept]
            keys, captions = [], []
            for i, c in zip((mine[k] for k in kept), chosen, strict=True):
                pick, dropped = draws[i]
                keys.append(c.empty_key if dropped else c.text_keys[pick])
                captions.append("" if dropped else c.sample.captions[pick])
            text = self.collate_text([self._text(c, k) for c, k in zip(chosen, keys, strict=True)])
            yield Batch(latents, text, captions, cond, offset, len(indices))
