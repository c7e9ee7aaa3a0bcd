"""LayerSync (`layersync_*` keys): a block's output aligned with a deeper block's output of the same forward pass.

LayerSync (a 2025 paper, and SimpleTuner's option of the same name) regularizes a diffusion transformer with its own
representations: the
loss gains lambda times minus the mean cosine similarity between the tokens after the student block and those after
the deeper teacher block, the teacher taken without gradient. No encoder, no decode, no trained projector, so
nothing to checkpoint: a resume continues exactly with the adapter and the optimizer alone.

The blocks are the image/video blocks of train/tread.LAYOUTS (Lumina2's joint `layers`, of which the image tokens
are aligned; Kandinsky 5's visual blocks), tapped from outside diffusers' classes (train/block_taps.py), and are
numbered from 1 as SimpleTuner numbers them (config/layersync_keys.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from difftune.config.layersync_keys import block_index
from difftune.models.hub import ComponentError
from difftune.train.block_taps import Taps, check_indexes, spatial_patch, token_grid
from difftune.train.tread import LAYOUTS

KEYS = ("layersync_student_block", "layersync_teacher_block")


class LayerSyncError(ComponentError):
    """A LayerSync block that does not fit the model (exit code 2 with the message)."""


def _check(cfg: Any, count: int) -> None:
    shown = {key: getattr(cfg, key) for key in KEYS}
    check_indexes(cfg, {key: block_index(value) for key, value in shown.items()}, count, LayerSyncError, shown,
                  first=1)


def check_before_load(cfg: Any, build_tiny: bool = True) -> None:
    """The blocks against the transformer's config.json, before any model loads (`difftune check` and `plan` too),
    where its depth is known then; otherwise `check_blocks` checks them once it loads."""
    if not cfg.layersync_enabled:
        return
    from difftune.train.tread import blocks_before_load

    count = blocks_before_load(cfg, build_tiny)
    if count is not None:
        _check(cfg, count)


def check_blocks(cfg: Any, family: Any, transformer: torch.nn.Module) -> None:
    """The blocks against the loaded model (before caching: what cannot train fails before the caches fill)."""
    if cfg.layersync_enabled:
        _check(cfg, len(LAYOUTS[family.tread_layout].blocks(transformer)))


class LayerSync:
    def __init__(self, cfg: Any, family: Any, transformer: torch.nn.Module):
        check_blocks(cfg, family, transformer)
        self.student = block_index(cfg.layersync_student_block)
        self.teacher = block_index(cfg.layersync_teacher_block)
        self.weight = cfg.layersync_lambda
        self.patch = spatial_patch(transformer)
        self.taps = Taps(transformer, family.tread_layout, [self.student, self.teacher], detached=[self.teacher])

    def similarity(self, x0: torch.Tensor) -> torch.Tensor:
        """The mean cosine similarity of the student's tokens to the teacher's in the last training call (the taps
        are emptied: each call's outputs are used once)."""
        grid = token_grid(x0, self.patch)
        student = self.taps.tokens(self.student, grid, "LayerSync: block layersync_student_block")
        teacher = self.taps.tokens(self.teacher, grid, "LayerSync: block layersync_teacher_block")
        self.taps.clear()
        return F.cosine_similarity(student.float(), teacher.float(), dim=-1).mean()


def attach(cfg: Any, family: Any, transformer: torch.nn.Module) -> LayerSync | None:
    """Hook LayerSync onto the (unwrapped) transformer; None when layersync_enabled is off."""
    return LayerSync(cfg, family, transformer) if cfg.layersync_enabled else None


def add_term(run: Any, loss: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """The loss plus lambda times minus the student's similarity to the teacher (unchanged when LayerSync is off);
    the similarity goes into the step's event as `layersync_similarity`."""
    sync = getattr(run, "layersync", None)
    if sync is None:
        return loss
    similarity = sync.similarity(x0).to(loss.device)
    run.record("layersync_similarity", similarity)
    return loss - sync.weight * similarity
