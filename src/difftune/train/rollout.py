"""Scheduled sampling ("rollout"): now and then the model makes its own noisy input.

Teacher forcing trains on x_s = (1 - s) x0 + s noise, exactly on the noise path; at sampling time the
model sees latents that its own earlier steps produced, errors included (exposure bias). With
`scheduled_sampling_max_step_offset` k_max > 0, each sample of a micro-batch is rolled out with the
chance of this step (`scheduled_sampling_probability`, or the linear ramp from `_prob_start` to
`_prob_end` over `_ramp_steps`): k in 0..k_max is drawn, the ground-truth latent is made k steps earlier
on the sampling schedule (the validation schedule of `validation_num_inference_steps` steps, with the
training shift), and the current model denoises it back down to s with k Euler steps, without gradient.

The loss is then taken on that self-made latent x~. Its target follows the flow convention of
`models.base`: x~ is read as (1 - s) x0 + s n~ with n~ = (x~ - (1 - s) x0) / s, and the target is
n~ - x0, the velocity that leads from x~ to the clean x0 (keeping noise - x0 would teach the model to
carry its drift into the result). So `noisy_input` returns (x_s, noise) and micro_step goes on as for
teacher forcing.

Every draw comes from the run's generator, for the whole global batch and then sliced, like the noise:
a resumed run rolls out the same samples by the same steps. A chance of 0 draws nothing, so it trains
exactly as without rollouts. TREAD is off inside rollouts (they run without gradient). With
input_perturbation, every input is built from the perturbed noise, a rollout's start too (as SimpleTuner
starts its rollouts from its perturbed input noise); the drift is measured from that perturbed x_s.

ReflexFlow (`scheduled_sampling_reflexflow`, arXiv 2512.04904) changes the loss of the rolled-out samples
only. Its two parts, as difftune computes them (`loss`):
- frequency compensation: the exposure bias of a sample is its drift d = x~ - x_s (the rollout's latent
  minus the true noisy latent). Its size per latent position, |d| over the channels, weights the error there
  (squared, or the Huber / smooth-L1 loss `loss_type` chooses: a spatial weight on any per-element loss):
  w = (1 + alpha |d| / mean|d|) / (1 + alpha), which averages 1 over the sample, so the loss keeps its scale
  and moves towards the places the model drifted most (alpha 0: plain weights).
- anti-drift: beta1 |pred/|pred| - target/|target||^2 over the whole sample, the direction of the prediction
  pulled onto the velocity that leads from x~ back to x0 (the rolled-out target above).
A rolled-out sample's loss is beta2 * weighted error + beta1 * direction term; the others keep the plain
flow loss, and the timestep weights (`loss_weighting`) scale both alike.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from difftune.train import objective


def chance(cfg: Any, step: int) -> float:
    """The rollout chance at optimizer step `step` (steps done so far)."""
    if cfg.scheduled_sampling_max_step_offset <= 0 or step < cfg.scheduled_sampling_start_step:
        return 0.0
    if cfg.scheduled_sampling_ramp_steps > 0:
        progress = min(1.0, (step - cfg.scheduled_sampling_start_step) / cfg.scheduled_sampling_ramp_steps)
        if cfg.scheduled_sampling_ramp_shape == "cosine":
            progress = 0.5 - 0.5 * math.cos(math.pi * progress)
        start, end = cfg.scheduled_sampling_prob_start, cfg.scheduled_sampling_prob_end
        return start + (end - start) * progress
    return cfg.scheduled_sampling_probability


def rollout_steps(cfg: Any, size: int, g: torch.Generator) -> torch.Tensor:
    """Each sample's number of rollout steps k in 0..max_step_offset, by `scheduled_sampling_strategy`
    ('uniform': each k alike; the biased ones draw k >= 1 with a chance falling or rising linearly in k)."""
    top = cfg.scheduled_sampling_max_step_offset
    if cfg.scheduled_sampling_strategy == "uniform":
        return torch.randint(0, top + 1, (size,), generator=g, device=g.device)
    k = torch.arange(1, top + 1, device=g.device, dtype=torch.float32)
    odds = top + 1 - k if cfg.scheduled_sampling_strategy == "biased_early" else k
    cdf = torch.cumsum(odds, 0) / odds.sum()
    u = torch.rand(size, generator=g, device=g.device)
    return 1 + torch.searchsorted(cdf, u, right=True).clamp(max=top - 1)


class Rolled(NamedTuple):
    """What `noisy_input` gives micro_step: the latent to train on and the noise it implies; for ReflexFlow,
    which samples were rolled out ([B] bool) and their drift from the true noisy latent (None: none was)."""

    x: torch.Tensor
    noise: torch.Tensor
    rolled: torch.Tensor | None = None
    drift: torch.Tensor | None = None


def unshift(s: torch.Tensor, shift: float) -> torch.Tensor:
    """The inverse of `objective.shift_sigmas`: the schedule position u of noise level s."""
    return s / (shift - (shift - 1.0) * s)


def noisy_input(run: Any, batch: Any, x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor,
                shift: float, input_noise: torch.Tensor | None = None) -> Rolled:
    """The latent to train on: the ground-truth noisy latent, or for rolled-out samples the model's own
    latent, with the noise that latent implies (see the module's docstring). `input_noise`: the noise the
    inputs are built from when it is not `noise` (input_perturbation): teacher-forced samples keep `noise` for
    their target, and rollouts start from the perturbed latent, their target leading from where they end."""
    input_noise = noise if input_noise is None else input_noise
    x_t = objective.noisy_input(x0, input_noise, sigmas)
    p = chance(run.cfg, run.state.step)
    if p <= 0.0:
        return Rolled(x_t, noise)
    size, lo, n = max(batch.global_size, x0.shape[0]), batch.offset, x0.shape[0]
    g = run.generator  # on the device: the draws stay there
    rolled = torch.rand(size, generator=g, device=g.device) < p
    every = rollout_steps(run.cfg, size, g) * rolled
    if not bool(every.any()):
        return Rolled(x_t, noise)
    steps = every[lo : lo + n]  # every process runs as many model calls (the global batch's longest rollout)
    grid = run.cfg.validation_num_inference_steps
    u = unshift(sigmas, shift)
    u_from = torch.clamp(u + steps / grid, max=1.0)
    start = objective.shift_sigmas(u_from, shift)
    x = objective.noisy_input(x0, input_noise, start)
    k, span = steps.clamp(min=1).to(u.dtype), u_from - u
    for i in range(int(every.max())):
        # sample j takes steps[j] equal steps from u_from down to u; the others stand still
        s_now = objective.shift_sigmas(u_from - span * i / k, shift)
        s_next = torch.where(i + 1 == steps, sigmas, objective.shift_sigmas(u_from - span * (i + 1) / k, shift))
        s_next = torch.where(i < steps, s_next, s_now)
        velocity = _predict(run, batch, x, s_now)
        x = x + (s_next - s_now).view(-1, *([1] * (x.dim() - 1))).to(x.dtype) * velocity.to(x.device, x.dtype)
    keep = (steps > 0).view(-1, *([1] * (x.dim() - 1)))
    s = sigmas.view(-1, *([1] * (x.dim() - 1))).to(x.dtype)
    implied = (x - (1.0 - s) * x0) / s
    x = torch.where(keep, x, x_t)
    return Rolled(x, torch.where(keep, implied, noise), steps > 0, x - x_t)


def _predict(run: Any, batch: Any, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The current model's velocity at (x, sigmas), without gradient (and so without TREAD)."""
    device, dtype = run.accelerator.device, run.comps.transformer.dtype
    conditioning = None if batch.conditioning is None else batch.conditioning.to(device, dtype)
    model = run.accelerator.unwrap_model(run.transformer)  # no DDP: no gradient, nothing to synchronise
    with torch.no_grad(), run.accelerator.autocast():
        out = run.family.predict(model, x.to(device, dtype), sigmas.to(device), batch.text, conditioning)
    return out.float()


def loss(cfg: Any, pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None, rolled: Rolled,
         first: int = 0, element: objective.Pointwise = objective.SQUARED) -> torch.Tensor:
    """The micro-batch's flow loss; with ReflexFlow on, rolled-out samples take its loss (module docstring).
    `first`: latent frames left out of the loss (the input frame of image-to-video), as in pred and target.
    `element`: the per-element loss (loss_type); ReflexFlow's drift map weights it as it weights the squared error."""
    if not cfg.scheduled_sampling_reflexflow or rolled.rolled is None:
        return objective.flow_loss(pred, target, weights, element)
    pred, target = pred.float(), target.float()
    error = element(pred, target)
    drift = rolled.drift.to(pred.device).float()
    drift = drift[:, :, first:] if first else drift
    size = drift.norm(dim=1, keepdim=True)  # the drift's size at each latent position
    mean = size.flatten(1).mean(dim=1).clamp(min=1e-12).view(-1, *([1] * (size.dim() - 1)))
    alpha = cfg.scheduled_sampling_reflexflow_alpha
    w = (1.0 + alpha * size / mean) / (1.0 + alpha)
    compensated = (w * error).flatten(1).mean(dim=1)
    direction = (_unit(pred) - _unit(target)).square().sum(dim=1)
    reflex = cfg.scheduled_sampling_reflexflow_beta2 * compensated + cfg.scheduled_sampling_reflexflow_beta1 * direction
    per_sample = torch.where(rolled.rolled.to(pred.device), reflex, error.flatten(1).mean(dim=1))
    if weights is not None:
        per_sample = per_sample * weights.to(per_sample.device)
    return per_sample.mean()


def _unit(v: torch.Tensor) -> torch.Tensor:
    flat = v.flatten(1)
    return flat / flat.norm(dim=1, keepdim=True).clamp(min=1e-12)
