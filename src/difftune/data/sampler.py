"""The batch sampler: one bucket per batch, seeded, and resumable at any batch.

An epoch's order is a pure function of (seed, epoch), so a resumed run that skips to (epoch, index)
sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass
class SamplerState:
    epoch: int = 0
    index: int = 0  # batches of this epoch already consumed


class BucketSampler:
    def __init__(self, buckets: list[tuple[int, int]], batch_size: int, seed: int, keep_partial: bool):
        """`buckets[i]` is the bucket of item i (items repeated for `repeats` already)."""
        self.batch_size = batch_size
        self.seed = seed
        self.keep_partial = keep_partial
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, bucket in enumerate(buckets):
            groups[bucket].append(i)
        self.groups = dict(sorted(groups.items()))
        self.state = SamplerState()

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        batches: list[list[int]] = []
        for items in self.groups.values():
            order = [items[i] for i in rng.permutation(len(items))]
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                if len(chunk) == self.batch_size or self.keep_partial:
                    batches.append(chunk)
        return [batches[i] for i in rng.permutation(len(batches))]

    def batches_per_epoch(self) -> int:
        return len(self.epoch_batches(0))

    def __iter__(self) -> Iterator[list[int]]:
        """Endless: yields batches from the saved position on, advancing the state."""
        while True:
            batches = self.epoch_batches(self.state.epoch)
            while self.state.index < len(batches):
                batch = batches[self.state.index]
                self.state.index += 1
                yield batch
            self.state = SamplerState(self.state.epoch + 1, 0)
