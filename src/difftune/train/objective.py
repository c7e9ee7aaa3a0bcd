"""The flow-matching objective, in one place, in the canonical convention of `models.base`:

    x_t = (1 - s) * x0 + s * noise,  target = noise - x0,  s in (0, 1), s = 1 is pure noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3


def shift_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The time-shift of SD3/Flux: s' = shift*s / (1 + (shift-1)*s). shift > 1 moves mass to noise."""
    return shift * u / (1.0 + (shift - 1.0) * u)


@dataclass(frozen=True)
class TimestepSampling:
    """How training noise levels are drawn: 'logit_normal' (SD3's default), 'uniform' or 'mode'
    (the SD3 paper's mode sampling with heavy tails), before the shift."""

    distribution: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29


def resolution_shift(scheduler_config: dict, image_tokens: int) -> float:
    """The shift a flow pipeline applies at this many image tokens (Flux's rule, from the scheduler's
    base/max sequence lengths and shifts): more tokens, more shift."""
    cfg = scheduler_config
    mu = calculate_shift(
        image_tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
        cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15),
    )
    return math.exp(mu)


def sample_sigmas(batch: int, shift: float, generator: torch.Generator,
                  sampling: TimestepSampling = TimestepSampling()) -> torch.Tensor:
    """Noise levels [B] in (0, 1), drawn from the run's generator (on its device), then shifted."""
    u = compute_density_for_timestep_sampling(
        sampling.distribution, batch, sampling.logit_mean, sampling.logit_std, sampling.mode_scale,
        device=generator.device, generator=generator,
    )
    return shift_sigmas(u, shift)


def loss_weights(sigmas: torch.Tensor, scheme: str) -> torch.Tensor:
    """Per-sample loss weights [B]: 'none', 'sigma_sqrt' or 'cosmap' (SD3 paper)."""
    return compute_loss_weighting_for_sd3(scheme, sigmas).float()


def noisy_input(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    s = sigmas.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1.0 - s) * x0 + s * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


def flow_loss(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error in float32, averaged over every element; `weights` [B] scale each sample."""
    error = (prediction.float() - target.float()) ** 2
    if weights is None:
        return error.mean()
    per_sample = error.reshape(error.shape[0], -1).mean(dim=1)
    return (per_sample * weights.to(per_sample.device)).mean()
