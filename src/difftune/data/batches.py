"""Training items and the batches the loop consumes: cached latents plus cached text conditions."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from difftune.data.cache import TensorCache
from difftune.data.latents import CachedSample
from difftune.data.sampler import BucketSampler


@dataclass
class Batch:
    latents: torch.Tensor  # [B, C, h, w] normalized latents
    text: dict[str, torch.Tensor]  # family-specific, collated
    captions: list[str]
    conditioning: torch.Tensor | None = None  # [B, C, h, w] latents of the input images (image-to-image)


class TrainingData:
    def __init__(
        self, items: list[CachedSample], text_cache: TensorCache, sampler: BucketSampler,
        collate_text: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
    ):
        self.items = items
        self.text_cache = text_cache
        self.sampler = sampler
        self.collate_text = collate_text

    def _text(self, key: str) -> dict[str, torch.Tensor]:
        tensors = self.text_cache.get(key)
        if tensors is None:
            raise RuntimeError(
                f"text embedding of caption {key.split(chr(0))[0][:60]!r} vanished from {self.text_cache.folder}; "
                "run again and it will be recomputed"
            )
        return tensors

    def __iter__(self) -> Iterator[Batch]:
        for indices in self.sampler:
            chosen = [self.items[i] for i in indices]
            latents = torch.stack([load_file(c.latent_file)["latents"] for c in chosen])
            conditioning = None
            if chosen[0].conditioning_file is not None:
                conditioning = torch.stack([load_file(c.conditioning_file)["latents"] for c in chosen])
            text = self.collate_text([self._text(c.text_key) for c in chosen])
            yield Batch(latents, text, [c.sample.caption for c in chosen], conditioning)
