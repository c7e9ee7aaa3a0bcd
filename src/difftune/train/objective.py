"""The flow-matching objective, in one place, in the canonical convention of `models.base`:

    x_t = (1 - s) * x0 + s * noise,  target = noise - x0,  s in (0, 1), s = 1 is pure noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from difftune.train import noise_levels


def shift_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The time-shift of SD3/Flux: s' = shift*s / (1 + (shift-1)*s). shift > 1 moves mass to noise."""
    return shift * u / (1.0 + (shift - 1.0) * u)


@dataclass(frozen=True)
class TimestepSampling:
    """How training noise levels are drawn: 'logit_normal' (SD3's default), 'uniform' or 'mode'
    (the SD3 paper's mode sampling with heavy tails), 'beta' (Beta(beta_alpha, beta_beta)), each before the shift;
    or 'list': one of `levels` each, unshifted (train/noise_levels.py draws the last two); or 'cycle' (flow_timesteps_mode
    'round-robin'): `levels` in turn, unshifted, from the sample index `start` that sample_sigmas is given."""

    distribution: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    beta_alpha: float = 2.0
    beta_beta: float = 2.0
    levels: tuple[float, ...] = ()

    @classmethod
    def of(cls, cfg: Any) -> TimestepSampling:
        """A run's sampling: flow_custom_timesteps, else flow_use_beta_schedule, else timestep_sampling."""
        levels = cfg.custom_sigmas()
        kind = "beta" if cfg.flow_use_beta_schedule else cfg.timestep_sampling
        if levels:
            kind = "cycle" if cfg.flow_timesteps_mode == "round-robin" else "list"
        return cls(kind, cfg.logit_mean, cfg.logit_std, cfg.mode_scale, cfg.flow_beta_schedule_alpha,
                   cfg.flow_beta_schedule_beta, tuple(levels or ()))


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
                  sampling: TimestepSampling = TimestepSampling(), start: int = 0) -> torch.Tensor:
    """Noise levels [B] in (0, 1), drawn from the run's generator (on its device), then shifted (a fixed list
    is not: flow_custom_timesteps are the levels that train). 'cycle' draws nothing: the levels in turn from the
    run's sample index `start` (noise_levels.cycle_start)."""
    if sampling.distribution == "cycle":
        return noise_levels.cycle_levels(batch, sampling.levels, start, generator.device)
    if sampling.distribution == "list":
        return noise_levels.list_draws(batch, sampling.levels, generator)
    if sampling.distribution == "beta":
        return shift_sigmas(noise_levels.beta_draws(batch, sampling.beta_alpha, sampling.beta_beta, generator), shift)
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


def perturbation(cfg: Any, step: int) -> float:
    """The input perturbation's strength at optimizer step `step` (steps done so far): `input_perturbation`,
    decaying linearly to 0 over `input_perturbation_steps` when that is set (SimpleTuner's rule)."""
    strength, steps = cfg.input_perturbation, cfg.input_perturbation_steps
    if steps <= 0:
        return strength
    return strength * (1.0 - step / steps) if step < steps else 0.0


def perturbed_noise(noise: torch.Tensor, strength: float, generator: torch.Generator, size: int, lo: int) -> torch.Tensor:
    """The noise the model's input is built from: `noise + strength * eps`, eps drawn from the run's generator for
    the global batch of `size` and sliced at `lo` like the noise. The target keeps `noise`, so the model learns to
    undo the extra error too (exposure bias). Strength 0 draws nothing and returns `noise` itself."""
    if strength <= 0.0:
        return noise
    eps = torch.randn((size, *noise.shape[1:]), generator=generator, device=generator.device)
    return noise + strength * eps[lo : lo + noise.shape[0]].to(noise.device, noise.dtype)


def huber_c(sigmas: torch.Tensor, schedule: str, c: float) -> torch.Tensor:
    """Each sample's pseudo-Huber threshold [B] at noise levels `sigmas` (config/loss_keys.py says how SimpleTuner's
    DDPM schedules read on the flow path): 'constant' c, 'exponential' c ** s, 'snr' c + (1 - c)(1 - s)^2."""
    s = sigmas.float()
    if schedule == "constant":
        return torch.full_like(s, c)
    if schedule == "exponential":
        return torch.exp(math.log(c) * s)
    if schedule == "snr":
        return c + (1.0 - c) * (1.0 - s) ** 2
    raise ValueError(f"unknown huber_schedule {schedule!r}")


@dataclass(frozen=True)
class Pointwise:
    """The loss of each element in float32: 'l2' (squared error), 'huber' (pseudo-Huber 2c(sqrt(e^2 + c^2) - c))
    or 'smooth_l1' (the same over c), with `c` [B] per sample. Written as e^2 / (sqrt(e^2 + c^2) + c), the same
    value without the cancellation of the difference when e is small next to c."""

    kind: str = "l2"
    c: torch.Tensor | None = None

    def __call__(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.kind == "l2":
            return (prediction.float() - target.float()) ** 2
        square = (prediction.float() - target.float()) ** 2
        c = self.c.to(square.device, torch.float32).view(-1, *([1] * (square.dim() - 1)))
        soft = square / (torch.sqrt(square + c * c) + c)
        return 2.0 * c * soft if self.kind == "huber" else 2.0 * soft


SQUARED = Pointwise()


def pointwise(cfg: Any, sigmas: torch.Tensor) -> Pointwise:
    """The per-element loss `loss_type` chooses, with each sample's c from `huber_schedule` and `huber_c`."""
    if cfg.loss_type == "l2":
        return SQUARED
    return Pointwise(cfg.loss_type, huber_c(sigmas, cfg.huber_schedule, cfg.huber_c))


def flow_loss(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None,
              element: Pointwise = SQUARED) -> torch.Tensor:
    """The per-element loss (the squared error unless told), averaged over every element; `weights` [B] scale
    each sample."""
    error = element(prediction, target)
    if weights is None:
        return error.mean()
    per_sample = error.reshape(error.shape[0], -1).mean(dim=1)
    return (per_sample * weights.to(per_sample.device)).mean()
