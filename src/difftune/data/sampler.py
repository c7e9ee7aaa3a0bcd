"""The batch sampler: one bucket (and one dataset) per batch, seeded, and resumable at any batch.

Each dataset's batch order in its own epoch n is a pure function of (seed, dataset, n). Without
`probability`, an epoch is every batch of every dataset, shuffled together, so each image is seen
once per epoch (times its repeats), but for the items that fill no whole batch in their bucket: they sit that
epoch out, a different draw each epoch (`left_per_epoch`; disable_bucket_pruning keeps partial batches on one
process). With `probability`, each batch comes from a dataset drawn by
weight, and a dataset that runs out starts its next epoch on its own. A resumed run that restores
`state_dict()` sees exactly the batches an uninterrupted run would have seen.

`drawn_epoch` is the epoch of its own dataset that the last batch belongs to (the same as the sampler's epoch
without `probability`): vae_cache_clear_each_epoch draws its crops from it.

`windows` (start_epoch, start_step, end_epoch, end_step per dataset: config/dataset_window_keys.py): a dataset is
drawn only while the batch's epoch (the sampler's, from 1) and optimizer step lie in its window. The step is counted
from where the sampler started: draw k after `start_at(step)` trains in step + k // accumulation + 1 (checkpoints
fall on step boundaries, so a resumed run starts on a step's first micro-batch, whatever the batches per epoch or
the accumulation were before). A run with windows draws by weight (as with `probability`), among the datasets in
their window; an epoch is still the batches of every dataset. `last_epoch`: a run bound by num_train_epochs whose
last optimizer step spills past the last epoch's batches (the accumulation does not divide them) counts the spill
as that epoch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class SamplerState:
    epoch: int = 0
    index: int = 0  # batches of this epoch already consumed
    streams: list[list[int]] = field(default_factory=list)  # per dataset [epoch, index] (weighted mode)


class DatasetBatches:
    """The batches of one dataset: items grouped by bucket, shuffled per epoch. `passes`: the dataset's items come
    that many times (1 + repeats), pass after pass; each pass is shuffled on its own, so that a batch holds distinct
    images where its bucket has enough (shuffled together, 70% of batches of 4 held an image twice at repeats 9)."""

    def __init__(self, items: list[int], buckets: list[tuple[int, int]], batch_size: int, seed: int,
                 salt: int, keep_partial: bool, passes: int = 1):
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for item, bucket in zip(items, buckets, strict=True):
            groups[bucket].append(item)
        self.groups = dict(sorted(groups.items()))
        self.batch_size, self.seed, self.salt, self.keep_partial = batch_size, seed, salt, keep_partial
        assert all(len(g) % passes == 0 for g in self.groups.values()), "each pass holds every item once"
        self.passes = passes
        self._memo: tuple[int, list[list[int]]] | None = None

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        if self._memo is None or self._memo[0] != epoch:  # weighted mode asks every step
            self._memo = (epoch, self._shuffle(epoch))
        return self._memo[1]

    def _shuffle(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.salt, epoch])
        batches: list[list[int]] = []
        for items in self.groups.values():
            n = len(items) // self.passes  # one pass of the bucket's items (all of them without repeats)
            order = [items[k * n + i] for k in range(self.passes) for i in rng.permutation(n)]
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                if len(chunk) == self.batch_size or self.keep_partial:
                    batches.append(chunk)
        return [batches[i] for i in rng.permutation(len(batches))]


LAYOUT = 2  # the batch order's version in a checkpoint's state (2: each pass of a dataset's repeats shuffled alone)
Window = tuple[int, int, int | None, int | None]  # (start_epoch, start_step, end_epoch, end_step)
ALWAYS: Window = (1, 0, None, None)


class NoDatasetScheduled(RuntimeError):
    """No dataset's window holds this epoch and step (train/setup.py checks the whole run before it starts)."""

    def __init__(self, epoch: int, step: int, ids: list[str]):
        super().__init__(f"no dataset is sampled at step {step} (epoch {epoch}): each of {', '.join(map(repr, ids))} "
                         "is outside its start_epoch/start_step/end_epoch/end_step window there; widen a window so "
                         "that some dataset covers every step of the run")
        self.epoch, self.step = epoch, step


class BucketSampler:
    def left_per_epoch(self) -> int:
        """Items each epoch leaves out because they do not fill a batch in their bucket (a different draw each
        epoch; none with keep_partial), as SimpleTuner trains full batches only."""
        return sum(len(items) % p.batch_size for p in self.parts if not p.keep_partial for items in p.groups.values())

    def __init__(self, datasets: list[tuple[Any, ...]], batch_size: int,
                 seed: int, keep_partial: bool, uniform: bool = False, ids: list[str] | None = None,
                 windows: list[Window] | None = None, accumulation: int = 1):
        """`datasets`: per dataset (item indices, bucket of each, probability or None[, passes: the items come pass
        after pass, 1 + repeats times; see DatasetBatches]). `uniform`
        (data_backend_sampling 'uniform'): the weighted draw even when no dataset sets a probability (1 each).
        `ids`: the datasets' ids, which key their streams in `state_dict` (default: their positions). `windows`:
        per dataset, when it is drawn (see the module docstring); `accumulation`: batches per optimizer step."""
        self.seed = seed
        self.ids = list(ids) if ids is not None else [str(i) for i in range(len(datasets))]
        self.parts = [DatasetBatches(items, buckets, batch_size, seed, i, keep_partial, *passes)
                      for i, (items, buckets, _, *passes) in enumerate(datasets)]
        self.counts = [len(p.epoch_batches(0)) for p in self.parts]
        weights = [d[2] for d in datasets]
        self.windows = windows if windows and any(w != ALWAYS for w in windows) else None
        self.accumulation = accumulation
        self.origin, self.drawn = 0, 0  # the optimizer steps done when drawing started, and the draws since
        self.last_epoch: int | None = None
        self.weighted = any(w is not None for w in weights) or (uniform and len(weights) > 1) or bool(self.windows)
        # SimpleTuner's weights: 'uniform', the probability alone (1 unset); 'auto-weighting', the probability
        # (1 unset) times the dataset's share of the items, so a probability scales a dataset's own share
        sizes = [1 if uniform else len(d[0]) for d in datasets]
        raw = np.array([(w if w is not None else 1.0) * n for w, n in zip(weights, sizes, strict=True)],
                       dtype=np.float64)
        raw[np.array(self.counts) == 0] = 0.0
        self.weights = raw / raw.sum() if raw.sum() > 0 else raw
        self.state = SamplerState(streams=[[0, 0] for _ in self.parts])
        self.drawn_epoch = 0  # the last batch's epoch of its dataset (set by each draw, so never saved)

    def batches_per_epoch(self) -> int:
        return sum(self.counts)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Unweighted mode: every dataset's batches of this epoch, shuffled together."""
        batches = [b for part in self.parts for b in part.epoch_batches(epoch)]
        rng = np.random.default_rng([self.seed, 1_000_003, epoch])
        return [batches[i] for i in rng.permutation(len(batches))]

    def start_at(self, step: int) -> None:
        """Drawing starts (again) at the first micro-batch of optimizer step `step` + 1 (a resumed run's)."""
        self.origin, self.drawn = step, 0

    def drawn_at(self, epoch: int, drawn: int) -> tuple[int, int]:
        """(epoch, optimizer step), both from 1, of the batch drawn `drawn` draws after the start, in sampler epoch
        `epoch` (from 0)."""
        epoch = epoch + 1 if self.last_epoch is None else min(epoch + 1, self.last_epoch)
        return epoch, self.origin + drawn // self.accumulation + 1

    def in_window(self, epoch: int, step: int) -> np.ndarray:
        """Which datasets may be drawn in this epoch and step (all without windows)."""
        if self.windows is None:
            return np.ones(len(self.parts), dtype=bool)
        return np.array([start_e <= epoch and start_s <= step and (end_e is None or epoch <= end_e)
                         and (end_s is None or step <= end_s) for start_e, start_s, end_e, end_s in self.windows])

    def window_check(self, steps: int) -> tuple[tuple[int, int] | None, list[str]]:
        """For a run of `steps` optimizer steps, from where the sampler stands: the first (epoch, step) at which no
        dataset with batches is in its window (None when every draw has one), and the ids of the datasets never in
        their window over those steps."""
        if self.windows is None or steps <= self.origin:
            return None, []
        k = np.arange((steps - self.origin) * self.accumulation)  # the draws left
        epoch = (self.state.index + k) // max(self.batches_per_epoch(), 1) + self.state.epoch + 1
        if self.last_epoch is not None:
            epoch = np.minimum(epoch, self.last_epoch)
        step = self.origin + k // self.accumulation + 1
        inside = np.stack([(start_e <= epoch) & (start_s <= step) & (epoch <= (end_e or epoch))
                           & (step <= (end_s or step)) for start_e, start_s, end_e, end_s in self.windows])
        inside &= (self.weights > 0)[:, None]  # a dataset without a batch is never drawn
        gaps = np.flatnonzero(~inside.any(axis=0))
        gap = (int(epoch[gaps[0]]), int(step[gaps[0]])) if len(gaps) else None
        return gap, [i for i, row in zip(self.ids, inside, strict=True) if not row.any()]

    def _weighted_next(self) -> list[int]:
        rng = np.random.default_rng([self.seed, 2_000_003, self.state.epoch, self.state.index])
        weights = self.weights
        if self.windows is not None:
            epoch, step = self.drawn_at(self.state.epoch, self.drawn)
            weights = np.where(self.in_window(epoch, step), weights, 0.0)
            if weights.sum() <= 0:
                raise NoDatasetScheduled(epoch, step, self.ids)
            weights = weights / weights.sum()
        self.drawn += 1
        d = int(rng.choice(len(self.parts), p=weights))
        stream = self.state.streams[d]
        batches = self.parts[d].epoch_batches(stream[0])
        if stream[1] >= len(batches):
            stream[0], stream[1] = stream[0] + 1, 0
            batches = self.parts[d].epoch_batches(stream[0])
        stream[1] += 1
        self.drawn_epoch = stream[0]
        return batches[stream[1] - 1]

    def __iter__(self) -> Iterator[list[int]]:
        """Endless: yields batches from the saved position on, advancing the state."""
        while True:
            if self.weighted:
                while self.state.index < self.batches_per_epoch():
                    batch = self._weighted_next()
                    self.state.index += 1
                    yield batch
            else:
                batches = self.epoch_batches(self.state.epoch)
                while self.state.index < len(batches):
                    batch = batches[self.state.index]
                    self.state.index += 1
                    self.drawn_epoch = self.state.epoch
                    yield batch
            self.state.epoch, self.state.index = self.state.epoch + 1, 0

    def state_dict(self) -> dict:
        # streams by dataset id: a dataset added or removed between runs does not shift the others' places
        return {"epoch": self.state.epoch, "index": self.state.index, "layout": LAYOUT,
                "streams": {i: list(s) for i, s in zip(self.ids, self.state.streams, strict=True)}}

    def load_state_dict(self, state: dict) -> str | None:
        """Restore a position (streams by id, or the older list by position). A dataset the saved state lacks
        starts its own stream at its beginning, one it has but this run lacks is dropped. Returns a note
        when the dataset list differs from the saved one, else None."""
        saved = state["streams"]
        if isinstance(saved, list):  # written before streams were keyed by id: one per dataset, in order
            extra = [f"#{n + 1}" for n in range(len(self.ids), len(saved))]  # unnamed datasets now gone
            saved = dict(zip(self.ids + extra, saved, strict=False))
        streams = [list(saved.get(i, [0, 0])) for i in self.ids]
        self.state = SamplerState(state["epoch"], state["index"], streams)
        added, removed = [i for i in self.ids if i not in saved], [i for i in saved if i not in self.ids]
        if state.get("layout") != LAYOUT and any(p.passes > 1 for p in self.parts):
            return ("this checkpoint was written by an earlier difftune, which shuffled a dataset's repeats together; "
                    "the epoch in progress is drawn in this version's order (its repeats spread over the batches), "
                    "so some of its images may come again or not at all until the epoch ends")
        if not added and not removed:
            return None
        what = "; ".join(f"{how}: {', '.join(names)}" for how, names in (("added", added), ("removed", removed))
                         if names)
        return (f"the dataset list changed since this checkpoint ({what}); a new dataset starts at its beginning, "
                "and the epoch in progress is drawn from the new list (its order differs from the checkpoint's)")
