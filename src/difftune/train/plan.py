"""Data planning before any model loads: size rules, caption rules and discovery of every enabled
dataset, with `max_num_samples` applied.

Import-light on purpose (no diffusers, no peft): `difftune check` and the early failures of
`difftune train` run through here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from difftune.config import ImageDataset, RunConfig, TrainConfig, caption_filter_keys
from difftune.config.datasets import REMOTE_TYPES
from difftune.data.buckets import SizeRule
from difftune.data.caption_filter import CaptionFilter
from difftune.data.captions import CaptionRule, CaptionTable
from difftune.data.discovery import DatasetSpec, Discovery, discover
from difftune.data.frames import FrameRule
from difftune.data.report import DataReport
from difftune.models.registry import FAMILY_FACTS


class DataError(Exception):
    """The datasets cannot train (for example a dataset with no usable image)."""


def size_rule(ds: ImageDataset, pixel_multiple: int) -> SizeRule:
    return SizeRule(
        resolution=ds.resolution, resolution_type=ds.resolution_type, crop=ds.crop, crop_aspect=ds.crop_aspect,
        multiple=pixel_multiple, minimum_image_size=ds.minimum_image_size,
        maximum_image_size=ds.maximum_image_size, target_downsample_size=ds.target_downsample_size,
        crop_aspect_buckets=tuple(ds.crop_aspect_buckets or ()), minimum_aspect_ratio=ds.minimum_aspect_ratio,
        maximum_aspect_ratio=ds.maximum_aspect_ratio,
    )


def size_rules(run_cfg: RunConfig) -> list[SizeRule]:
    multiple = FAMILY_FACTS[run_cfg.train.model_family].pixel_multiple
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
        least = max(least or 0, 5)  # image-to-video trains frames after the first latent frame: 5 at least
    return FrameRule(v.num_frames, fps, v.bucket_strategy, least, v.max_frames, v.frame_interval)


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


def caption_filters(run_cfg: RunConfig, ds: ImageDataset) -> CaptionFilter | None:
    """caption_filter_list of the text_embeds entry caching the dataset's captions (read again here: the loader
    checked it, and the file may have changed since)."""
    entry = run_cfg.datasets.text_embeds_for(ds)
    try:
        return caption_filter_keys.build(entry.caption_filter_list if entry is not None else None)
    except ValueError as e:
        raise DataError(f"dataset {ds.id!r}: text_embeds entry {entry.id!r}: caption_filter_list: {e}") from e


def dataset_spec(run_cfg: RunConfig, ds: ImageDataset, rule: SizeRule, write_metadata: bool = True) -> DatasetSpec:
    pairs, masks = run_cfg.datasets.conditioning_dir(ds), run_cfg.datasets.mask_dir(ds)
    return DatasetSpec(
        dataset_id=ds.id, root=Path(ds.instance_data_dir), rule=rule,
        captions=CaptionRule(downloaded_captions(ds.caption_strategy), ds.instance_prompt, ds.prepend_instance_prompt,
                             ds.only_instance_prompt, split_lines=not ds.disable_multiline_split,
                             filters=caption_filters(run_cfg, ds)),
        table=caption_table(ds), conditioning_root=Path(pairs) if pairs else None,
        metadata_file=Path(ds.vae_cache_root(run_cfg.train.model_family)) / "metadata.json",
        seed=run_cfg.train.seed, write_metadata=write_metadata, frames=frame_rule(run_cfg, ds),
        mask_root=Path(masks) if masks else None,
    )


def limit(found: Discovery, max_num_samples: int | None) -> Discovery:
    """A fixed subset (seeded by the dataset id) when the dataset has more images than allowed."""
    if max_num_samples is None or len(found.samples) <= max_num_samples:
        return found
    def rank(sample) -> str:
        return hashlib.sha256(f"{found.dataset_id}|{sample.path}".encode()).hexdigest()

    keep = set(sorted(found.samples, key=rank)[:max_num_samples])
    dropped = [s for s in found.samples if s not in keep]
    found.samples = [s for s in found.samples if s in keep]
    found.notes.append((Path(found.dataset_id), f"max_num_samples {max_num_samples}: "
                                                f"{len(dropped)} image(s) not used this run"))
    return found


def encoded_in_training(train: TrainConfig, ds: ImageDataset) -> bool:
    """Whether a dataset's latents are encoded during training: vae_cache_disable (the run's or its own), or
    vae_cache_clear_each_epoch (a new random crop each epoch: nothing cached)."""
    return train.vae_cache_disable or ds.vae_cache_disable or ds.vae_cache_clear_each_epoch


def discover_all(run_cfg: RunConfig, write_metadata: bool = True, fetch: bool = True) -> list[Discovery]:
    """Every dataset's usable files. `fetch`: download remote datasets first (process 0 of a run does it before
    the others discover; the web UI never downloads)."""
    if fetch:
        fetch_sources(run_cfg)
    found = [
        limit(discover(dataset_spec(run_cfg, ds, rule, write_metadata)), ds.max_num_samples)
        for ds, rule in zip(run_cfg.datasets.discovered(), size_rules(run_cfg), strict=True)
    ]
    for d, ds in zip(found, run_cfg.datasets.discovered(), strict=True):
        d.held_out = ds.dataset_type == "eval"
        d.regularisation = ds.is_regularisation_data
        d.crops_each_epoch = ds.vae_cache_clear_each_epoch
        d.on_the_fly = encoded_in_training(run_cfg.train, ds)
        d.masks = ds.conditioning_data if run_cfg.datasets.mask_dir(ds) else None
    empty = [d.dataset_id for d in found if not d.samples]
    if empty:
        report = DataReport(found, [], {})
        raise DataError(
            f"dataset(s) {', '.join(map(repr, empty))} have no usable image or clip (see each file's reason "
            f"below); add captioned files or disable the dataset\n{report.render()}"
        )
    return found
