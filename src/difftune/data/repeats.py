"""Each training dataset's repeats and the buckets left out: what train/setup.build_data trains on.

A bucket that holds fewer items (with its dataset's repeats) than one global batch (train_batch_size per
process, times the processes) is pruned unless disable_bucket_pruning keeps it.

allow_dataset_oversubscription (SimpleTuner's key) first raises the repeats of each dataset that is too small,
as SimpleTuner does: one optimizer step draws train_batch_size x processes x gradient_accumulation_steps
samples, and a dataset with a bucket that holds fewer than that (with repeats) gets the smallest repeats with which
every one of its buckets holds at least that many. Only a dataset whose entry does not set `repeats` is raised (an
entry that writes it, even 0 or null, keeps it, as in SimpleTuner); repeats are never lowered. The result depends
only on the cached items and the config, so a resumed run trains on the same items in the same order.

Pure functions on counts: no torch, and never models/ (docs/architecture.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

Bucket = tuple[str, tuple[int, ...]]  # (dataset id, bucket group)


@dataclass(frozen=True)
class StepSize:
    """What one optimizer step draws: train_batch_size per process, the processes, gradient_accumulation_steps."""

    batch: int
    processes: int = 1
    accumulation: int = 1

    @property
    def global_batch(self) -> int:
        return self.batch * self.processes

    @property
    def samples(self) -> int:
        return self.global_batch * self.accumulation

    def describe(self) -> str:
        return (f"{self.samples} (train_batch_size {self.batch} x {self.processes} process(es) x "
                f"gradient_accumulation_steps {self.accumulation})")


@dataclass(frozen=True)
class RepeatsChange:
    """A dataset smaller than one optimizer step: its repeats raised (`raised`), or kept because its entry sets
    them (then `after` is what allow_dataset_oversubscription would have set)."""

    dataset: str
    before: int
    after: int
    smallest: int  # items in its smallest bucket, before repeats
    step: StepSize
    raised: bool

    def line(self) -> str:
        why = f"its smallest bucket holds {self.smallest} item(s), one optimizer step draws {self.step.describe()}"
        if self.raised:
            return f"repeats of {self.dataset} raised from {self.before} to {self.after} " \
                   f"(allow_dataset_oversubscription): {why}"
        return f"repeats of {self.dataset} kept at {self.before}, set on its entry " \
               f"(allow_dataset_oversubscription raises only repeats an entry leaves out): {why}; set repeats to " \
               f"{self.after} or remove it"


@dataclass
class RepeatsPlan:
    repeats: dict[str, int]  # dataset id -> the repeats it trains with
    pruned: dict[Bucket, int] = field(default_factory=dict)  # bucket -> items left out
    changes: list[RepeatsChange] = field(default_factory=list)


def needed_repeats(bucket_sizes: list[int], samples: int) -> int:
    """The smallest repeats with which each bucket holds at least `samples` items (0 if they all do)."""
    return max((math.ceil(samples / n) - 1 for n in bucket_sizes if n > 0), default=0)


def plan_repeats(
    counts: dict[Bucket, int], repeats: dict[str, int], step: StepSize, *, oversubscribe: bool = False,
    explicit: frozenset[str] | set[str] = frozenset(), keep_small: bool = False,
) -> RepeatsPlan:
    """`counts`: items per bucket of each training dataset; `repeats`: each dataset's own (0 when unset);
    `explicit`: datasets whose entry sets repeats; `keep_small`: disable_bucket_pruning."""
    final = dict(repeats)
    changes = []
    if oversubscribe:
        for dataset in repeats:
            sizes = [n for (d, _), n in counts.items() if d == dataset]
            need = needed_repeats(sizes, step.samples)
            if need > repeats[dataset]:  # never lowered
                raised = dataset not in explicit
                changes.append(RepeatsChange(dataset, repeats[dataset], need, min(sizes), step, raised))
                if raised:
                    final[dataset] = need
    pruned = {} if keep_small else {
        key: n for key, n in counts.items() if n * (1 + final[key[0]]) < step.global_batch
    }
    return RepeatsPlan(final, pruned, changes)
