"""The LayerSync keys (`layersync_*`, train/layersync.py): the fields, mixed into TrainConfig, and their checks.
Import-light: no torch.

The blocks count from 1, as SimpleTuner reads them (it tries `block - 1` first, which always exists below the last
block; 0 is the first block too). SimpleTuner's unset teacher is the student block itself, whose loss is constant
(a block's output against its own detached copy) and teaches nothing: here the teacher must be named, and deeper.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from difftune.config.fields import field

DEFAULT_LAMBDA = 0.2  # the LayerSync paper's weight, SimpleTuner's default


class LayerSyncKeys(BaseModel):
    layersync_enabled: bool = field(
        False, "LayerSync: pull the output of an earlier block (layersync_student_block) towards that of a deeper one "
        "(layersync_teacher_block) of the same forward pass, by their tokens' cosine similarity; the teacher is a "
        "target taken without gradient. A self-contained regularizer: no extra model, no VAE decode, no trained "
        "projector (CREPA's backbone mode is the same idea through a projector).", "training", advanced=True,
    )
    layersync_student_block: int | None = field(
        None, "With layersync_enabled: the block (counted from 1, of the image/video blocks: Lumina2's `layers`, "
        "Kandinsky 5's visual blocks) whose output is aligned, e.g. 8 on a 24- to 32-block model.", "training",
        ge=0, advanced=True,
    )
    layersync_teacher_block: int | None = field(
        None, "With layersync_enabled: the deeper block (counted from 1) whose output is the target, e.g. 16 with "
        "layersync_student_block 8.", "training", ge=0, advanced=True,
    )
    layersync_lambda: float = field(
        DEFAULT_LAMBDA, "With layersync_enabled: weight of the alignment loss (minus the mean cosine similarity) added "
        "to the flow-matching loss.", "training", ge=0.0, advanced=True,
    )


def block_index(block: int) -> int:
    """A LayerSync block number (from 1; 0 is read as 1, as SimpleTuner does) -> the 0-based index."""
    return max(block - 1, 0)


def layersync_checks(cfg: Any) -> None:
    """Raise ValueError for a LayerSync setting that cannot train (its settings are free while it is off)."""
    if not cfg.layersync_enabled:
        return
    student, teacher = cfg.layersync_student_block, cfg.layersync_teacher_block
    if student is None:
        raise ValueError("layersync_enabled needs layersync_student_block: the block (counted from 1) to align, e.g. 8")
    if teacher is None or block_index(teacher) <= block_index(student):
        said = "is unset" if teacher is None else f"is {teacher}"
        raise ValueError(f"layersync_enabled aligns block layersync_student_block ({student}) with a deeper block, "
                         f"layersync_teacher_block, which {said}: set it above {max(student, 1)}, e.g. "
                         f"{2 * max(student, 1)} (SimpleTuner's unset teacher is the block itself, whose loss is "
                         "constant and teaches nothing)")
    if cfg.layersync_lambda <= 0:
        raise ValueError(f"layersync_lambda {cfg.layersync_lambda:g} with layersync_enabled: the weight must be above "
                         f"0 ({DEFAULT_LAMBDA} is the paper's); or set layersync_enabled to false")
