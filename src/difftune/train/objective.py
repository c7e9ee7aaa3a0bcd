"""The flow-matching objective, in one place, in the canonical convention of `models.base`:

    x_t = (1 - s) * x0 + s * noise,  target = noise - x0,  s in (0, 1), s = 1 is pure noise.
"""

from __future__ import annotations

import torch


def shift_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The time-shift of SD3/Flux: s' = shift*s / (1 + (shift-1)*s). shift > 1 moves mass to noise."""
    return shift * u / (1.0 + (shift - 1.0) * u)


def sample_sigmas(batch: int, shift: float, generator: torch.Generator) -> torch.Tensor:
    """Noise levels [B]: logit-normal(0, 1) (the SD3 default), then shifted."""
    u = torch.sigmoid(torch.randn(batch, generator=generator))
    return shift_sigmas(u, shift)


def noisy_input(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    s = sigmas.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1.0 - s) * x0 + s * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


def flow_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in float32, averaged over every element."""
    return torch.nn.functional.mse_loss(prediction.float(), target.float())
