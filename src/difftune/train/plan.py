"""Data planning before any model loads: size rules and discovery of every enabled dataset.

Import-light on purpose (no diffusers, no peft): `difftune check` and the early failures of
`difftune train` run through here.
"""

from __future__ import annotations

from pathlib import Path

from difftune.config import ImageDataset, RunConfig
from difftune.data.buckets import SizeRule
from difftune.data.discovery import Discovery, discover
from difftune.data.report import DataReport
from difftune.models.registry import FAMILY_FACTS


class DataError(Exception):
    """The datasets cannot train (for example a dataset with no usable image)."""


def size_rule(ds: ImageDataset, pixel_multiple: int) -> SizeRule:
    return SizeRule(
        resolution=ds.resolution, resolution_type=ds.resolution_type, crop=ds.crop, crop_aspect=ds.crop_aspect,
        multiple=pixel_multiple, minimum_image_size=ds.minimum_image_size,
        maximum_image_size=ds.maximum_image_size, target_downsample_size=ds.target_downsample_size,
    )


def size_rules(run_cfg: RunConfig) -> list[SizeRule]:
    multiple = FAMILY_FACTS[run_cfg.train.model_family].pixel_multiple
    return [size_rule(ds, multiple) for ds in run_cfg.datasets.images]


def discover_all(run_cfg: RunConfig) -> list[Discovery]:
    plan = run_cfg.datasets
    found = []
    for ds, rule in zip(plan.images, size_rules(run_cfg), strict=True):
        pairs = plan.conditioning_dir(ds)
        found.append(discover(ds.id, Path(ds.instance_data_dir), rule, Path(pairs) if pairs else None))
    empty = [d.dataset_id for d in found if not d.samples]
    if empty:
        report = DataReport(found, [], {})
        raise DataError(
            f"dataset(s) {', '.join(map(repr, empty))} have no usable image (see each file's reason "
            f"below); add captioned images or disable the dataset\n{report.render()}"
        )
    return found
