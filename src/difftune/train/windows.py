"""The batch sampler of a run and its length, built alike by training (train/setup.py) and `difftune check`
(train/plan.py), and the datasets' sampling windows (start_epoch/start_step/end_epoch/end_step) checked over the
run's steps: at the start, at a resume (from the resumed step), and by `check` before any model loads."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from difftune.config import RunConfig, TrainConfig
from difftune.data.repeats import RepeatsPlan, StepSize
from difftune.data.sampler import BucketSampler


class WindowError(ValueError):
    """A step of the run that no dataset's window covers (train/plan.py's DataError wraps it for the command line)."""


def bucket_sampler(run_cfg: RunConfig, samples: Iterable[Any], plan: RepeatsPlan, processes: int,
                   ) -> tuple[BucketSampler, list[Any]]:
    """The run's sampler over `samples` (anything with `.sample` or itself a discovered Sample) with the plan's
    repeats and pruning, and the items it indexes. With several processes it draws global batches (each process
    takes a slice), and only full ones: partial batches cannot be split evenly between processes."""
    cfg, datasets = run_cfg.train, run_cfg.datasets.images
    found = [(c, getattr(c, "sample", c)) for c in samples]  # (item, its discovered Sample)
    items: list[Any] = []
    parts = []
    for ds in datasets:
        mine = [(c, s) for c, s in found if s.dataset_id == ds.id and (ds.id, s.group) not in plan.pruned]
        start = len(items)
        passes = 1 + plan.repeats[ds.id]  # pass after pass: each is shuffled on its own (data/sampler.py)
        items += [c for _ in range(passes) for c, _ in mine]
        groups = [s.group for _ in range(passes) for _, s in mine]
        parts.append((list(range(start, len(items))), groups, ds.probability, passes))
    global_batch = StepSize(cfg.train_batch_size, processes, cfg.gradient_accumulation_steps).global_batch
    sampler = BucketSampler(parts, global_batch, cfg.seed, keep_partial=cfg.disable_bucket_pruning and processes == 1,
                            uniform=cfg.data_backend_sampling == "uniform", ids=[ds.id for ds in datasets],
                            windows=[ds.window() for ds in datasets], accumulation=cfg.gradient_accumulation_steps)
    sampler.last_epoch = epochs_bound(cfg, sampler.batches_per_epoch())
    return sampler, items


def total_steps(cfg: TrainConfig, batches_per_epoch: int) -> int:
    by_steps = cfg.max_train_steps or math.inf
    by_epochs = math.ceil(cfg.num_train_epochs * batches_per_epoch / cfg.gradient_accumulation_steps) or math.inf
    if cfg.ignore_final_epochs:  # max_train_steps alone ends the run (the config makes sure it is set)
        by_epochs = math.inf
    return int(min(by_steps, by_epochs))


def epochs_bound(cfg: TrainConfig, batches_per_epoch: int) -> int | None:
    """num_train_epochs when it ends the run (the last epoch, for the dataset windows), else None."""
    if not cfg.num_train_epochs or cfg.ignore_final_epochs:
        return None
    by_epochs = math.ceil(cfg.num_train_epochs * batches_per_epoch / cfg.gradient_accumulation_steps)
    return math.ceil(cfg.num_train_epochs) if not cfg.max_train_steps or by_epochs <= cfg.max_train_steps else None


def check_windows(sampler: BucketSampler, steps: int, emit: Callable[..., None]) -> None:
    """The datasets' sampling windows over the run's steps left, from where the sampler stands (the start, or a
    resumed step): a step that no dataset covers fails now (not when the run reaches it), and a dataset never in its
    window is a warning."""
    gap, never = sampler.window_check(steps)
    if gap is not None:
        where = f"no dataset is sampled at step {gap[1]} (epoch {gap[0]}) of this {steps}-step run"
        # a dataset in its window there whose buckets all hold less than one batch (pruned) is no help either
        emptied = [i for i, n, inside in zip(sampler.ids, sampler.counts, sampler.in_window(*gap), strict=True)
                   if inside and n == 0]
        if emptied:
            one = len(emptied) == 1
            raise WindowError(f"{where}: {', '.join(map(repr, emptied))} {'is' if one else 'are'} in "
                              f"{'its' if one else 'their'} window there but fill{'s' if one else ''} no batch (every "
                              "bucket holds fewer images than one global batch): raise its repeats, set "
                              "allow_dataset_oversubscription, or lower train_batch_size (or, on one process, set "
                              "disable_bucket_pruning)")
        raise WindowError(f"{where}: each is outside its start_epoch/start_step/end_epoch/end_step window there; "
                          "widen a window so that some dataset covers every step")
    for dataset in never:
        if sampler.counts[sampler.ids.index(dataset)] == 0:  # in its window, maybe, but with nothing to draw
            emit("warning", message=f"dataset {dataset!r} is never sampled in this run: it fills no batch (every "
                                    "bucket holds fewer images than one global batch)")
        else:
            emit("warning", message=f"dataset {dataset!r} is never sampled in this run: its window lies outside the "
                                    f"run's steps {sampler.origin + 1}-{steps}")
