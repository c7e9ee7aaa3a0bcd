"""Masked loss: a dataset's loss masks (a conditioning entry with `conditioning_type: "mask"`, config/mask_keys.py)
weight the per-element loss, in one place.

The data layer gives each sample of a masked dataset its mask with exactly its image's resize and crop, averaged
over each latent cell (data/latents.py `mask_pixels`, `mask_grid`), as `Batch.mask` [B, 1, h, w] in [0, 1]. Here
the per-element loss (`objective.Pointwise`: squared error, pseudo-Huber or smooth L1) is multiplied by it before
the mean, which stays the mean over every element (SimpleTuner's normalisation: a mask covering a quarter of the
image gives a quarter of the loss's scale, not the mean over the masked area). Wrapping the per-element loss puts
the weighting under every loss that uses it: the plain flow loss, the timestep weights (`loss_weighting`) and
ReflexFlow's drift-weighted error on rolled-out samples (train/rollout.py); ReflexFlow's direction term and CREPA's
alignment term are whole-sample terms and stay unmasked.

`masked_loss_probability` p: each masked batch uses its masks with chance p, drawn from the run's generator on the
device (one draw per global batch, so every process decides alike and a resume draws the same; no host sync: the
choice is a `torch.where`). p = 1 and p = 0 draw nothing: p = 0 trains exactly as without masks, and a batch
without masks (an unmasked dataset, or no mask dataset at all) draws nothing and changes nothing.

TREAD routes tokens regardless of the mask (SimpleTuner keeps masked tokens from being routed); the loss is
weighted on the full latent grid either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from difftune.train.objective import Pointwise


@dataclass(frozen=True)
class MaskedPointwise:
    """A per-element loss times the mask's weights [B, 1, h, w] (broadcast over channels, and frames for 5-D
    latents of one-frame images in a video family)."""

    inner: Any  # objective.Pointwise (or another per-element loss with its call signature)
    weights: torch.Tensor

    def __call__(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        error = self.inner(prediction, target)
        w = self.weights.to(error.device, torch.float32)
        if error.dim() == 5:  # [B, C, T, h, w]
            w = w.unsqueeze(2)
        return error * w


def weighted(run: Any, batch: Any, element: Pointwise) -> Pointwise | MaskedPointwise:
    """`element` weighted by the batch's loss masks (drawn by masked_loss_probability), or `element` itself."""
    p = run.cfg.masked_loss_probability
    if batch.mask is None or p <= 0.0:
        return element
    weights = batch.mask
    if p < 1.0:
        g = run.generator
        use = torch.rand((), generator=g, device=g.device) < p
        weights = torch.where(use.to(weights.device), weights, torch.ones_like(weights))
    return MaskedPointwise(element, weights)
