"""Data planning before any model loads: size rules, caption rules and discovery of every enabled
dataset, with `max_num_samples` applied, then the bucket plan (repeats, pruning: data/repeats.py) that
train/setup.build_data makes again from the files that decoded.

Import-light on purpose (no diffusers, no peft): `difftune check`, `difftune plan` and the early failures of
`difftune train` run through here. The bucket plan before caching uses every discovered file; caching can only
lose files, so a plan that fails here fails in training too, and one that passes here may still fail there
(files that do not decode). Without a process count (check, plan) it is planned for WORLD_SIZE processes, 1 when
unset, which prunes least.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from difftune.config import ImageDataset, RunConfig, TrainConfig, caption_filter_keys
from difftune.config.datasets import REMOTE_TYPES
from difftune.config.resume_check import world_size
from difftune.data.buckets import SizeRule
from difftune.data.caption_filter import CaptionFilter
from difftune.data.captions import CaptionRule, CaptionShuffle, CaptionTable
from difftune.data.discovery import DatasetSpec, Discovery, Sample, discover
from difftune.data.frames import FrameRule
from difftune.data.repeats import Bucket, RepeatsPlan, StepSize, plan_repeats
from difftune.data.report import LIST_LIMIT, DataReport, window_text
from difftune.models.registry import FAMILY_FACTS
from difftune.train.windows import WindowError, bucket_sampler, check_windows, total_steps


class DataError(Exception):
    """The datasets cannot train (for example a dataset with no usable image)."""


class NothingToTrain(DataError):
    """Every bucket holds fewer items than one global batch; `plan` has the pruned buckets."""

    def __init__(self, message: str, plan: RepeatsPlan):
        super().__init__(message)
        self.plan = plan


I2V_MIN_FRAMES = 5  # image-to-video trains the frames after the first latent frame (the input image)


def size_rule(ds: ImageDataset, pixel_multiple: int) -> SizeRule:
    return SizeRule(
        resolution=ds.resolution, resolution_type=ds.resolution_type, crop=ds.crop, crop_aspect=ds.crop_aspect,
        multiple=pixel_multiple, minimum_image_size=ds.minimum_image_size,
        maximum_image_size=ds.maximum_image_size, target_downsample_size=ds.target_downsample_size,
        crop_aspect_buckets=tuple(ds.crop_aspect_buckets or ()), minimum_aspect_ratio=ds.minimum_aspect_ratio,
        maximum_aspect_ratio=ds.maximum_aspect_ratio, max_upscale_threshold=ds.max_upscale_threshold,
    )


def size_rules(run_cfg: RunConfig) -> list[SizeRule]:
    # aspect_bucket_alignment: a coarser grid, a multiple of the family's (config/small_keys.py)
    multiple = run_cfg.train.aspect_bucket_alignment or FAMILY_FACTS[run_cfg.train.model_family].pixel_multiple
    return [size_rule(ds, multiple) for ds in run_cfg.datasets.discovered()]  # eval datasets too


def caption_table(ds: ImageDataset) -> CaptionTable | None:
    if ds.caption_strategy != "parquet" or ds.parquet is None:
        return None
    path = Path(ds.parquet.path)
    if not path.is_absolute() and (Path(ds.instance_data_dir) / path).is_file():
        path = Path(ds.instance_data_dir) / path
    try:
        return CaptionTable(path, ds.parquet)
    except (ValueError, OSError) as e:
        raise DataError(f"dataset {ds.id!r}: parquet: {e}") from e


def frame_rule(run_cfg: RunConfig, ds: ImageDataset) -> FrameRule | None:
    v = ds.video
    if v is None:
        return None
    fps = v.frame_rate if v.frame_rate is not None else run_cfg.train.video_fps()
    least = v.min_frames
    if FAMILY_FACTS[run_cfg.train.model_family].first_frame(run_cfg.train.flavour()):
        least = max(least or 0, I2V_MIN_FRAMES)  # image-to-video trains frames after the first latent frame
    return FrameRule(v.num_frames, fps, v.bucket_strategy, least, v.max_frames, v.frame_interval)


def frame_rule_as_set(run_cfg: RunConfig, ds: ImageDataset) -> FrameRule | None:
    """The dataset's own frame rule when image-to-video's floor raised its min_frames (so a clip the floor leaves
    out is reported as such, not as below a min_frames the user never set), else None."""
    rule = frame_rule(run_cfg, ds)
    if rule is None or ds.video is None or rule.min_frames == ds.video.min_frames:
        return None
    return replace(rule, min_frames=ds.video.min_frames)


def downloaded_captions(strategy: str) -> str:
    """A downloaded dataset's caption column is written as a caption file beside each image (data/sources/)."""
    return "textfile" if strategy in REMOTE_TYPES else strategy


def fetch_sources(run_cfg: RunConfig, say: Callable[[str], None] = print) -> None:
    """Download the datasets of a remote type (huggingface, csv, aws) into their folders; local ones are left."""
    datasets = [*run_cfg.datasets.discovered(), *run_cfg.datasets.validation_only.values()]
    if any(ds.type != "local" for ds in datasets):
        from difftune.data.sources import SourceError, fetch_all

        try:
            fetch_all(datasets, say)
        except SourceError as e:
            raise DataError(str(e)) from e


def generate_conditioning(run_cfg: RunConfig, say: Callable[[str], None] = print) -> None:
    """Make the generated conditioning images (a dataset's `conditioning` list) that are missing or out of date,
    after fetch_sources: a downloaded dataset's images are the sources."""
    generated = run_cfg.datasets.generated
    if not generated:
        return
    from difftune.data.generated_conditioning import generate
    from difftune.data.sources import SourceError

    datasets = {ds.id: ds for ds in run_cfg.datasets.discovered()}
    for gen in generated.values():
        if gen.source_id in datasets:
            try:
                generate(gen, Path(datasets[gen.source_id].instance_data_dir), say)
            except SourceError as e:
                raise DataError(str(e)) from e


def check_generated_folders(run_cfg: RunConfig) -> None:
    """DataError where generate_conditioning would refuse a folder, writing nothing."""
    if not run_cfg.datasets.generated:
        return
    from difftune.data.generated_conditioning import check_folder
    from difftune.data.sources import SourceError

    for gen in run_cfg.datasets.generated.values():
        try:
            check_folder(gen)
        except SourceError as e:
            raise DataError(str(e)) from e


def caption_filters(run_cfg: RunConfig, ds: ImageDataset) -> CaptionFilter | None:
    """caption_filter_list of the text_embeds entry caching the dataset's captions (read again here: the loader
    checked it, and the file may have changed since)."""
    entry = run_cfg.datasets.text_embeds_for(ds)
    try:
        return caption_filter_keys.build(entry.caption_filter_list if entry is not None else None)
    except ValueError as e:
        raise DataError(f"dataset {ds.id!r}: text_embeds entry {entry.id!r}: caption_filter_list: {e}") from e


def caption_shuffle(run_cfg: RunConfig, ds: ImageDataset) -> CaptionShuffle | None:
    """The dataset's caption_shuffle block as the data layer's rule (None when off); its seed, else the run's, else 0."""
    block = ds.caption_shuffle
    if block is None or not block.enable:
        return None
    seed = block.seed if block.seed is not None else run_cfg.train.seed if run_cfg.train.seed is not None else 0
    return CaptionShuffle(block.count, seed, block.split_on, block.position_start, block.include_original)


def dataset_spec(run_cfg: RunConfig, ds: ImageDataset, rule: SizeRule, write_metadata: bool = True,
                 generated: bool = True) -> DatasetSpec:
    """`generated`: the generated conditioning images are up to date (generate_conditioning ran)."""
    pairs, masks = run_cfg.datasets.conditioning_dir(ds), run_cfg.datasets.mask_dir(ds)
    return DatasetSpec(
        dataset_id=ds.id, root=Path(ds.instance_data_dir), rule=rule,
        captions=CaptionRule(downloaded_captions(ds.caption_strategy), ds.instance_prompt, ds.prepend_instance_prompt,
                             # a huggingface download writes each caption of a row on its own line
                             ds.only_instance_prompt,
                             split_lines=not ds.disable_multiline_split or ds.caption_strategy == "huggingface",
                             filters=caption_filters(run_cfg, ds), shuffle=caption_shuffle(run_cfg, ds)),
        table=caption_table(ds), conditioning_root=Path(pairs) if pairs else None,
        metadata_file=run_cfg.datasets.metadata_file(ds, run_cfg.train.model_family),
        seed=run_cfg.train.seed, write_metadata=write_metadata, frames=frame_rule(run_cfg, ds),
        mask_root=Path(masks) if masks else None, frames_as_set=frame_rule_as_set(run_cfg, ds),
        conditioning_pending=not generated and ds.conditioning_data in run_cfg.datasets.generated,
        conditioning_generated=ds.conditioning_data in run_cfg.datasets.generated,
        sizes_from_table=ds.metadata_backend == "parquet",
    )


def limit(found: Discovery, max_num_samples: int | None) -> Discovery:
    """A fixed subset (seeded by the dataset id) when the dataset has more images than allowed."""
    if max_num_samples is None or len(found.samples) <= max_num_samples:
        return found
    def rank(sample) -> str:
        return hashlib.sha256(sample.ident.encode("utf-8", "surrogateescape")).hexdigest()  # not where it lies

    keep = set(sorted(found.samples, key=rank)[:max_num_samples])
    dropped = [s for s in found.samples if s not in keep]
    found.samples = [s for s in found.samples if s in keep]
    found.not_drawn = len(dropped)
    found.notes.append((Path(found.dataset_id), f"max_num_samples {max_num_samples}: {len(dropped)} "
                                                f"{'clip' if found.video else 'image'}(s) not used this run"))
    return found


def encoded_in_training(train: TrainConfig, ds: ImageDataset) -> bool:
    """Whether a dataset's latents are encoded during training: vae_cache_disable (the run's or its own), or
    vae_cache_clear_each_epoch (a new random crop each epoch: nothing cached)."""
    return train.vae_cache_disable or ds.vae_cache_disable or ds.vae_cache_clear_each_epoch


def latents_on_demand(train: TrainConfig, ds: ImageDataset) -> bool:
    """Whether a dataset's latents are encoded during training as each item is first drawn, and written to its cache
    (vae_cache_ondemand, its own or else the config's: config/latent_cache_keys.py)."""
    own = ds.vae_cache_ondemand
    wanted = own if own is not None else train.vae_cache_ondemand
    return bool(wanted) and ds.dataset_type != "eval" and not encoded_in_training(train, ds)


def cache_everything(run_cfg: RunConfig) -> list[str]:
    """`difftune cache`: the datasets with vae_cache_ondemand are encoded now like the others (the command's purpose);
    returns their ids."""
    ids = [ds.id for ds in run_cfg.datasets.images if latents_on_demand(run_cfg.train, ds)]
    run_cfg.train.vae_cache_ondemand = False
    for ds in run_cfg.datasets.images:
        ds.vae_cache_ondemand = False
    return ids


def bucket_counts(run_cfg: RunConfig, samples: Iterable[Sample]) -> dict[Bucket, int]:
    """Items per (dataset, bucket group) of each training dataset (an eval dataset's are never trained on)."""
    trained = {ds.id for ds in run_cfg.datasets.images}
    counts: dict[Bucket, int] = {}
    for sample in samples:
        if sample.dataset_id in trained:
            key = (sample.dataset_id, sample.group)
            counts[key] = counts.get(key, 0) + 1
    return counts


def plan_buckets(run_cfg: RunConfig, samples: Iterable[Sample], processes: int) -> RepeatsPlan:
    """Each training dataset's repeats and the buckets pruned (data/repeats.py) for `processes` processes: what
    train/setup.build_data trains on. Raises NothingToTrain when every bucket is pruned."""
    cfg = run_cfg.train
    datasets = run_cfg.datasets.images
    step = StepSize(cfg.train_batch_size, processes, cfg.gradient_accumulation_steps)
    counts = bucket_counts(run_cfg, samples)
    plan = plan_repeats(counts, {ds.id: ds.repeats for ds in datasets}, step,
                        oversubscribe=cfg.allow_dataset_oversubscription,
                        explicit={ds.id for ds in datasets if "repeats" in ds.model_fields_set},
                        # a partial batch cannot be split between processes: with several, training drops it
                        keep_small=cfg.disable_bucket_pruning and processes == 1)
    if len(plan.pruned) == len(counts):  # no item left to train on
        fix = "raise repeats on the dataset entries (or remove it there: allow_dataset_oversubscription raises " \
            "only repeats an entry leaves out)" if cfg.allow_dataset_oversubscription else \
            "set allow_dataset_oversubscription (raises each small dataset's repeats) or repeats on the dataset entries"
        if processes == 1:
            pruning = ", or set disable_bucket_pruning"
        elif cfg.disable_bucket_pruning:  # set already: say why it does not help rather than advise it
            pruning = " (disable_bucket_pruning keeps small buckets on one process only: a partial batch cannot " \
                "be split between processes)"
        else:
            pruning = ", or train on one process with disable_bucket_pruning (with several a partial batch cannot " \
                "be split between them)"
        raise NothingToTrain(
            f"every aspect bucket holds fewer images than one global batch ({step.global_batch}); "
            f"lower train_batch_size, add images, {fix}{pruning}"
            + "".join(f"\n  {change.line()}" for change in plan.changes), plan)
    return plan


def _planned_items(found: list[Discovery], plan: RepeatsPlan) -> Counter[tuple[str, tuple[int, ...]]]:
    """Items with repeats per (dataset, bucket group), over the buckets training keeps."""
    return Counter(
        (d.dataset_id, s.group) for d in found if d.dataset_id in plan.repeats for s in d.samples
        if (d.dataset_id, s.group) not in plan.pruned for _ in range(1 + plan.repeats[d.dataset_id])
    )


def planned_buckets(found: list[Discovery], plan: RepeatsPlan) -> dict[tuple[int, ...], int]:
    """Items per bucket group with repeats, over the buckets training keeps (the data report's buckets line)."""
    counts: Counter[tuple[int, ...]] = Counter()
    for (_, group), n in _planned_items(found, plan).items():
        counts[group] += n
    return dict(counts)


def incomplete(run_cfg: RunConfig, found: list[Discovery], plan: RepeatsPlan, processes: int) -> int:
    """Items per epoch that fill no global batch in their dataset's bucket, as training's sampler leaves them out
    (data/sampler.py `left_per_epoch`); none where disable_bucket_pruning keeps partial batches (one process)."""
    cfg = run_cfg.train
    if cfg.disable_bucket_pruning and processes == 1:
        return 0
    batch = cfg.train_batch_size * processes
    return sum(n % batch for n in _planned_items(found, plan).values())


def plan_note(run_cfg: RunConfig, processes: int, given: str | None = None) -> str:
    """`given`: what set the number of processes (`difftune plan`'s --processes); else WORLD_SIZE or its absence."""
    batch = run_cfg.train.train_batch_size
    said = given or ("WORLD_SIZE" if "WORLD_SIZE" in os.environ else
                     "WORLD_SIZE is not set: set it to plan a run on more")
    return (f"buckets planned for {processes} process(es) ({said}): one global batch is {batch * processes} "
            f"(train_batch_size {batch} x {processes})")


def planned(run_cfg: RunConfig, found: list[Discovery], processes: int, given: str | None = None) -> RepeatsPlan:
    """plan_buckets on the discovered files; when it fails, training's message followed by the data report."""
    try:
        return plan_buckets(run_cfg, (s for d in found for s in d.samples), processes)
    except NothingToTrain as e:
        report = DataReport(found, [], e.plan.pruned, repeats=e.plan.changes,
                            plan_note=plan_note(run_cfg, processes, given))
        said = str(e).splitlines()
        raise DataError("\n".join([*said, *(line for line in report.render(LIST_LIMIT).splitlines()
                                             if line not in said)])) \
            from e


def check_data(run_cfg: RunConfig, every_line: bool = False) -> str:
    """What `difftune check` says about the data: the data report with the buckets and the pruning training
    would make (for WORLD_SIZE processes, 1 when unset), or training's DataError, without loading any model.
    Long per-file lists are cut to LIST_LIMIT lines unless `every_line` (`--all`)."""
    processes = world_size()
    found = discover_datasets(run_cfg)
    plan = planned(run_cfg, found, processes)
    sampler, _ = bucket_sampler(run_cfg, (s for d in found for s in d.samples), plan, processes)
    regularisation = [ds.id for ds in run_cfg.datasets.images if ds.is_regularisation_data and not ds.disabled]
    report = DataReport(found, [], plan.pruned, repeats=plan.changes, planned=planned_buckets(found, plan),
                        plan_note=plan_note(run_cfg, processes),
                        incomplete=incomplete(run_cfg, found, plan, processes),
                        batches=sampler.batches_per_epoch(), regularisation=regularisation).render(
        None if every_line else LIST_LIMIT, "difftune check --all lists them all")
    from difftune.train import validation_input

    _, _, skipped = validation_input.pick(run_cfg, found)  # fails as training would when none is readable
    lines = planned_windows(run_cfg, found, plan, processes) + [f"warning: {line}" for line in skipped]
    return report + "".join(f"\n{line}" for line in lines)


def planned_windows(run_cfg: RunConfig, found: list[Discovery], plan: RepeatsPlan, processes: int) -> list[str]:
    """The datasets' sampling windows as training will check them, from the planned batches: the data report's
    line and a warning per dataset never sampled; a step that no dataset covers is training's DataError."""
    if not any(ds.scheduled() for ds in run_cfg.datasets.images):  # no sampler to build for most configs
        return []
    sampler, _ = bucket_sampler(run_cfg, (s for d in found for s in d.samples), plan, processes)
    warnings: list[str] = []
    try:
        check_windows(sampler, total_steps(run_cfg.train, sampler.batches_per_epoch()),
                      lambda kind, message: warnings.append(f"{kind}: {message}"))
    except WindowError as e:
        raise DataError(str(e)) from e
    windows = "; ".join(f"{i} {window_text(w)}" for i, w in zip(sampler.ids, sampler.windows, strict=True))
    return [f"  sampled: {windows} (drawn by weight among the datasets in their window)", *warnings]


def discover_all(run_cfg: RunConfig, write_metadata: bool = True, fetch: bool = True,
                 processes: int | None = None, given: str | None = None, prepared: bool = False) -> list[Discovery]:
    """Every dataset's usable files, after checking that training would have a bucket to train on (`processes`:
    the run's; None: world_size(); `given`: what set it, for the message). `fetch`: download remote datasets first (process 0 of a run does it before
    the others discover; the web UI never downloads)."""
    found = discover_datasets(run_cfg, write_metadata, fetch, prepared)
    planned(run_cfg, found, processes or world_size(), given)
    return found


def discover_datasets(run_cfg: RunConfig, write_metadata: bool = True, fetch: bool = True,
                      prepared: bool = False) -> list[Discovery]:
    """Every dataset's usable files (no bucket plan); an error when a dataset has none. `fetch`: download the
    remote datasets first, and with `write_metadata` make the generated conditioning images too (`check`);
    `prepared`: the caller did both (a training run). Otherwise images whose generated input image is not made yet
    are taken as if it were (the web UI and the wizard write nothing)."""
    if fetch:
        fetch_sources(run_cfg)
    if fetch and write_metadata:
        generate_conditioning(run_cfg)
    generated = prepared or fetch and write_metadata
    if not generated:  # a folder generating would refuse (the user's files, another's): said now too
        check_generated_folders(run_cfg)
    found = [
        limit(discover(dataset_spec(run_cfg, ds, rule, write_metadata, generated)), ds.max_num_samples)
        for ds, rule in zip(run_cfg.datasets.discovered(), size_rules(run_cfg), strict=True)
    ]
    for d, ds in zip(found, run_cfg.datasets.discovered(), strict=True):
        d.held_out = ds.dataset_type == "eval"
        d.regularisation = ds.is_regularisation_data
        d.crops_each_epoch = ds.vae_cache_clear_each_epoch
        d.on_the_fly = encoded_in_training(run_cfg.train, ds) or latents_on_demand(run_cfg.train, ds)
        d.masks = ds.conditioning_data if run_cfg.datasets.mask_dir(ds) else None
    empty = [d for d in found if not d.samples]
    if empty:
        report = DataReport(found, [], {})
        why = empty[0].why_empty() if len(empty) == 1 else \
            "; ".join(f"{d.dataset_id!r}: {d.why_empty()}" for d in empty)
        raise DataError(
            f"dataset(s) {', '.join(repr(d.dataset_id) for d in empty)} have no usable image or clip ({why}); "
            f"add captioned files or disable the dataset\n{report.render(LIST_LIMIT)}"
        )
    return found
