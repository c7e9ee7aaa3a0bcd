"""Regularisation datasets (`is_regularisation_data` on a dataset entry): prior preservation against the base
model itself, with no class images generated in advance.

A sample of such a dataset is trained towards the base model's own prediction instead of the flow velocity of
its image: the same noisy input, noise level, caption and input image go through the transformer with the
adapter switched off (`validation.adapter_off`: a peft LoRA disabled, a LyCORIS network at multiplier 0),
without gradient, and that output is the target of the adapter's prediction. The loss is otherwise the usual
one (`loss_type`, `loss_weighting`, ReflexFlow on rolled-out samples), so the adapter is pulled towards leaving
such prompts as the base model draws them. This is what SimpleTuner does (its trainer asks the parent model for
the target of a regularisation batch, with the LoRA disabled or the LyCORIS multiplier at 0; no loss weight of
its own). Differences, decided here:
- a full fine-tune is refused by the config (config/regularisation_keys.py), where SimpleTuner trains the data
  as ordinary images: there is no frozen base model left, and a key that silently changes nothing is refused;
- SimpleTuner's documentation speaks of LyCORIS only; its code handles standard LoRA too, and so does this.

How it meets the rest of the step (`target` runs before the student's forward pass in `loop.micro_step`):
- rollout (scheduled sampling) and input_perturbation: the teacher sees the input the student sees (the rolled
  out or perturbed latent), so it answers the same question;
- TREAD and CREPA hook the transformer only while gradients are on: the teacher runs unrouted (the base
  model's real prediction, and no draw from the run's generator, so a resume routes the same tokens), and
  captures nothing. CREPA clears its capture at each call, so the teacher must run first, as it does;
- gradient checkpointing is off without gradients (diffusers checks `torch.is_grad_enabled()`);
- several processes: the teacher runs on the unwrapped transformer, outside DDP (no collective, nothing for
  its unused-parameter tracking). With FSDP2 its forward gathers each block's weights, a collective: every
  process runs it together, since a global batch holds one dataset (data/sampler.py);
- peft's `disable_adapters` also sets requires_grad False on the adapter weights, and `enable_adapters` sets it
  True again before the student's pass; FSDP2 copies the flag to its unsharded parameters at each gather, so a
  teacher pass as the run's very first forward leaves the adapter trainable (tests/test_regularisation.py).
With no regularisation dataset, `target` is the velocity as before, computed by the same operations.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.train import objective
from difftune.train.validation import adapter_off


def target(run: Any, batch: Any, x0: torch.Tensor, rolled: Any, sigmas: torch.Tensor) -> torch.Tensor:
    """The micro-batch's target on the device: the flow velocity `noise - x0` (from the noise its input implies:
    train/rollout.py), and for the regularisation samples the base model's prediction at that input."""
    velocity = objective.velocity_target(x0, rolled.noise).to(run.accelerator.device)
    if batch.regularisation is None:
        return velocity
    base = base_prediction(run, batch, rolled.x, sigmas).to(velocity.device, velocity.dtype)
    mask = batch.regularisation.to(velocity.device).view(-1, *([1] * (velocity.dim() - 1)))
    return torch.where(mask, base, velocity)


def base_prediction(run: Any, batch: Any, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The base model's velocity at (x, sigmas) for the batch's captions (and input images), without gradient."""
    device, dtype = run.accelerator.device, run.comps.transformer.dtype
    conditioning = None if batch.conditioning is None else batch.conditioning.to(device, dtype)
    model = run.accelerator.unwrap_model(run.transformer)  # outside DDP: no gradient, nothing to synchronise
    with torch.no_grad(), adapter_off(run), run.accelerator.autocast():
        out = run.family.predict(model, x.to(device, dtype), sigmas.to(device), batch.text, conditioning)
    return out.float()
