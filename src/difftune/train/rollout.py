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
exactly as without rollouts. TREAD is off inside rollouts (they run without gradient).
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.train import objective


def chance(cfg: Any, step: int) -> float:
    """The rollout chance at optimizer step `step` (steps done so far)."""
    if cfg.scheduled_sampling_max_step_offset <= 0:
        return 0.0
    if cfg.scheduled_sampling_ramp_steps > 0:
        progress = min(1.0, step / cfg.scheduled_sampling_ramp_steps)
        start, end = cfg.scheduled_sampling_prob_start, cfg.scheduled_sampling_prob_end
        return start + (end - start) * progress
    return cfg.scheduled_sampling_probability


def unshift(s: torch.Tensor, shift: float) -> torch.Tensor:
    """The inverse of `objective.shift_sigmas`: the schedule position u of noise level s."""
    return s / (shift - (shift - 1.0) * s)


def noisy_input(run: Any, batch: Any, x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor,
                shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_s, noise) to train on: the ground-truth noisy latent, or for rolled-out samples the model's own
    latent and the noise that latent implies (see the module's docstring)."""
    x_t = objective.noisy_input(x0, noise, sigmas)
    p = chance(run.cfg, run.state.step)
    if p <= 0.0:
        return x_t, noise
    size, lo, n = max(batch.global_size, x0.shape[0]), batch.offset, x0.shape[0]
    g = run.generator  # on the device: the draws stay there
    rolled = torch.rand(size, generator=g, device=g.device) < p
    every = torch.randint(0, run.cfg.scheduled_sampling_max_step_offset + 1, (size,), generator=g, device=g.device) * rolled
    if not bool(every.any()):
        return x_t, noise
    steps = every[lo : lo + n]  # every process runs as many model calls (the global batch's longest rollout)
    grid = run.cfg.validation_num_inference_steps
    u = unshift(sigmas, shift)
    u_from = torch.clamp(u + steps / grid, max=1.0)
    start = objective.shift_sigmas(u_from, shift)
    x = objective.noisy_input(x0, noise, start)
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
    return torch.where(keep, x, x_t), torch.where(keep, implied, noise)


def _predict(run: Any, batch: Any, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The current model's velocity at (x, sigmas), without gradient (and so without TREAD)."""
    device, dtype = run.accelerator.device, run.comps.transformer.dtype
    conditioning = None if batch.conditioning is None else batch.conditioning.to(device, dtype)
    model = run.accelerator.unwrap_model(run.transformer)  # no DDP: no gradient, nothing to synchronise
    with torch.no_grad(), run.accelerator.autocast():
        out = run.family.predict(model, x.to(device, dtype), sigmas.to(device), batch.text, conditioning)
    return out.float()
