"""The data summary printed before training: what was found, used, bucketed, and left out (and why)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from difftune.data.discovery import Discovery
from difftune.data.frames import bucket_name
from difftune.data.repeats import RepeatsChange

LIST_LIMIT = 20  # lines of each per-file list on the console (`difftune check --all` shows them all)


@dataclass
class DataReport:
    found: list[Discovery]
    failed: list[tuple[Path, str]]  # files that failed to decode while caching
    pruned: dict[tuple[str, tuple[int, ...]], int]  # (dataset, bucket group) -> items left out by pruning
    data: Any = None  # TrainingData, when built
    lines: list[str] = field(default_factory=list)
    # allow_dataset_oversubscription: datasets whose repeats were raised, or kept because their entry sets them
    repeats: list[RepeatsChange] = field(default_factory=list)
    # `difftune check` (no TrainingData): bucket group -> items with repeats, as training will bucket them
    planned: dict[tuple[int, ...], int] | None = None
    plan_note: str | None = None  # for how many processes the buckets were planned (`difftune check`)
    incomplete: int = 0  # `difftune check`: items per epoch that fill no batch in their bucket (training: the sampler's)
    # `difftune check`: the planned sampler's batches per epoch and regularisation datasets (training: its data's)
    batches: int | None = None
    regularisation: list[str] = field(default_factory=list)

    def render(self, limit: int | None = None, more: str = "") -> str:
        """The report; with `limit`, each per-file list shows its first `limit` lines and the bucket line its
        `limit` largest buckets, then how many more and `more` (where the whole list is): a 20,000-image dataset at
        a large resolution gave one note per image (18,938 lines)."""
        return "\n".join(self._lines(limit, more))

    def _lines(self, limit: int | None, more: str) -> list[str]:
        def capped(lines: list[str]) -> list[str]:
            if limit is None or len(lines) <= limit:
                return lines
            return lines[:limit] + [f"    ... and {len(lines) - limit} more" + (f" ({more})" if more else "")]

        def bucket_line(counts: dict) -> str:
            shown = sorted(counts.items())
            if limit is not None and len(shown) > limit:
                largest = sorted(sorted(counts.items(), key=lambda kv: -kv[1])[:limit])
                rest = len(shown) - limit
                return (", ".join(f"{bucket_name(*g)}: {n}" for g, n in largest) +
                        f", and {rest} smaller bucket(s) with {sum(counts.values()) - sum(n for _, n in largest)} "
                        "item(s)")
            return ", ".join(f"{bucket_name(*g)}: {n}" for g, n in shown)

        failed_paths = {p for p, _ in self.failed}
        out = ["data report:", f"  {'dataset':<24} {'found':>7} {'used':>7} {'left out':>9}"]
        for d in self.found:
            used = sum(1 for s in d.samples if s.path not in failed_paths and (d.dataset_id, s.group) not in self.pruned)
            total = len(d.samples) + len(d.skipped) + d.not_drawn
            kind = "  (eval: measured, never trained on)" if d.held_out else \
                "  (regularisation: trained towards the base model)" if d.regularisation else ""
            out.append(f"  {d.dataset_id:<24} {total:>7} {used:>7} {total - used:>9}{kind}")
        if self.data is not None:
            buckets = Counter(item.sample.group for item in self.data.items)
            out.append(f"  buckets (with repeats): {bucket_line(buckets)}")
            out.append(f"  batches per epoch: {self.data.sampler.batches_per_epoch()}")
            if self.data.sampler.windows is not None:  # start_epoch/start_step/end_epoch/end_step
                out.append("  sampled: " + "; ".join(f"{i} {window_text(w)}" for i, w in
                                                     zip(self.data.sampler.ids, self.data.sampler.windows, strict=True))
                           + " (drawn by weight among the datasets in their window)")
        elif self.planned:
            out.append(f"  buckets (with repeats): {bucket_line(self.planned)}")
            if self.batches is not None:
                out.append(f"  batches per epoch: {self.batches}")
        regularisation = sorted(self.data.regularisation) if self.data is not None else self.regularisation
        if regularisation:  # is_regularisation_data (train/regularisation.py)
            out.append(f"  regularisation data: {', '.join(regularisation)} (trained towards the base model's "
                       "prediction, the adapter switched off)")
        if self.plan_note:
            out.append(f"  {self.plan_note}")
        partial = self.data.sampler.left_per_epoch() if self.data is not None else self.incomplete
        if partial:  # the used count above is per run: each epoch draws which items these are
            out.append(f"  incomplete batches: {partial} item(s) per epoch do not fill a batch in their bucket and sit "
                       "that epoch out, a different draw each epoch (disable_bucket_pruning keeps them, on one "
                       "process)")
        masked = [f"{d.dataset_id} (from {d.masks!r})" for d in self.found if d.masks]
        if masked:  # conditioning_type 'mask' (train/masked_loss.py)
            out.append(f"  loss masks: {', '.join(masked)}: the loss is weighted by each image's mask")
        each = [d.dataset_id for d in self.found if d.crops_each_epoch]
        if each:  # vae_cache_clear_each_epoch (data/latents.py)
            out.append(f"  new crops each epoch: {', '.join(each)}: latents encoded during training, with a new random "
                       "crop position per image each epoch (its aspect and bucket stay)")
        for d in (d for d in self.found if d.caption_filter):  # caption_filter_list (data/caption_filter.py)
            out.append(f"  caption_filter_list: {d.dataset_id}: {d.captions_changed} caption(s) changed, "
                       f"{d.captions_emptied} left empty" + (" (see the notes)" if d.captions_emptied else ""))
        out += [f"  {change.line()}" for change in self.repeats]
        kept = {change.dataset for change in self.repeats}  # their line above says which repeats would do
        for (dataset, group), n in sorted(self.pruned.items()):
            raise_it = "" if dataset in kept else ", or allow_dataset_oversubscription to raise the dataset's repeats"
            out.append(f"  pruned bucket {bucket_name(*group)} of {dataset}: {n} item(s), fewer than one batch "
                       f"(set disable_bucket_pruning to keep them, on one process{raise_it})")
        left = [(p, r) for d in self.found for p, r in d.skipped] + self.failed
        if left:
            out.append(f"  left out ({len(left)}):")
            out += capped([f"    {p}: {r}" for p, r in left])
        unread = [item for d in self.found for item in d.unread_reasons()]
        if unread:  # files of a type the dataset does not read, one line per extension
            count = sum(len(files) for d in self.found for files in d.unread.values())
            out.append(f"  not read ({count} file(s) of other types):")
            out += [f"    {p}: {r}" for p, r in unread]
        gone = {p for p, _ in self.failed}  # failed while caching: its notes (trimmed, resampled) no longer apply
        notes = [(p, r) for d in self.found for p, r in d.notes if p not in gone]
        if notes:
            out.append(f"  notes ({len(notes)}):")
            out += capped([f"    {p}: {r}" for p, r in notes])
        return out


def window_text(window: tuple[int, int, int | None, int | None]) -> str:
    """A dataset's sampling window in words: 'always', 'from step 301', 'epochs 1-2, up to step 300'."""
    start_e, start_s, end_e, end_s = window
    parts = []
    if start_e > 1 or end_e is not None:
        parts.append(f"epochs {start_e}-{end_e}" if end_e is not None else f"from epoch {start_e}")
    if start_s > 1 or end_s is not None:
        parts.append(f"steps {max(start_s, 1)}-{end_s}" if end_s is not None else f"from step {start_s}")
    return ", ".join(parts) or "always"
