"""Masked loss: `masked_loss_probability` (the field, mixed into TrainConfig) and the checks between it and the
dataset list's mask entries (`conditioning_type: "mask"`, config/datasets.py). The weighting itself is
train/masked_loss.py. Import-light: no torch.

What SimpleTuner does, and where difftune follows or differs (its DATALOADER.md `conditioning_type`, and the loss
code of its model classes, read for the facts):
- a mask dataset is a `dataset_type: "conditioning"` entry with `conditioning_type: "mask"`, linked from the image
  dataset by `conditioning_data`, one mask per image with the same relative name;
- the mask's red channel, 0..255 read as 0..1 (white trains, black is ignored, grey weighs in between; no
  threshold), is area-averaged to the latent grid and multiplies the per-element loss, which is then averaged
  over every element (no division by the mask's area);
- SimpleTuner applies a 'mask' entry on every batch and draws `masked_loss_probability` (default 1.0) only for its
  'segmentation' entries; difftune has no 'segmentation' kind and draws it for 'mask' entries: the chance that a
  batch from a masked dataset uses its masks. At the default both agree.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, field_validator

from difftune.config.fields import field, unset


class MaskKeys(BaseModel):
    masked_loss_probability: float = field(
        1.0, "With a mask dataset (a conditioning entry with conditioning_type 'mask', named by an image dataset's "
        "conditioning_data): the chance that a batch of a masked dataset has its loss weighted by its masks (drawn "
        "per batch from the run's seeded generator; the other batches train on the whole image). 1: always. "
        "(SimpleTuner draws it only for its 'segmentation' entries and always applies 'mask' entries; difftune has no "
        "'segmentation' kind.)", "training", ge=0.0, le=1.0, advanced=True,
    )

    @field_validator("masked_loss_probability", mode="before")
    @classmethod
    def _mask_null_is_default(cls, value: Any) -> Any:
        return 1.0 if unset(value) else value  # SimpleTuner writes null for "not set"


def mask_checks(train: Any, plan: Any, path: Path, where_of: Callable[[str], str], problems: list[str]) -> None:
    """Mask datasets where they cannot act, and a probability that would act on no mask, each with the fix.
    `path`: the dataset list (its entries' problems); `where_of(key)`: the config file or the command line, whichever
    set a config.json key."""
    masked = [ds.id for ds in plan.images if plan.mask_dir(ds) is not None]
    for ds in plan.evaluation:
        if plan.mask_dir(ds) is not None:
            problems.append(f"{path}: dataset {ds.id!r}: conditioning_data {ds.conditioning_data!r} holds loss masks, "
                            "but the evaluation loss of an eval dataset is measured unmasked; remove conditioning_data")
    eval_id = train.eval_dataset_id if train.validation_using_datasets else None
    entry = plan.conditioning.get(eval_id) if eval_id else None
    if entry is not None and entry.conditioning_type == "mask":
        problems.append(f"{path}: eval_dataset_id {eval_id!r} is a mask dataset (conditioning_type 'mask'): its "
                        "images are loss masks, not validation input images; name the input images' dataset")
    probability = train.masked_loss_probability
    if not masked and 0.0 < probability < 1.0:
        problems.append(f"{where_of('masked_loss_probability')}: masked_loss_probability: {probability:g}: no image "
                        "dataset names a mask dataset (conditioning_type 'mask') in conditioning_data, so nothing "
                        "would be masked; remove masked_loss_probability or add the masks")
