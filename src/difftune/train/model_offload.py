"""`enable_model_cpu_offload`: whole models take turns on the accelerator where a run uses them one after
the other.

- Validation: the transformer denoises, then the VAE decodes. While the VAE decodes, the transformer
  waits in CPU memory, and the VAE is on the accelerator only for its decode: the sample's peak is the
  larger of the two, not their sum (the video VAE's decode is the largest single allocation of a
  Kandinsky 5 Video run). Both go back where they were afterwards.
- Caching: it implies `offload_during_startup` (train/setup.py): the transformer stays off the
  accelerator while the text encoders and the VAE fill the caches.

diffusers' `pipeline.enable_model_cpu_offload` does the same with accelerate hooks, but its hooks stay
on the modules and would move the transformer being trained; this is the same idea scoped to one
`with` block. It cannot be combined with block streaming (`enable_group_offload`): the config refuses that.
On a machine without an accelerator the moves are CPU to CPU and change nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


@contextmanager
def model_cpu_offload(on: bool, transformer: torch.nn.Module, vae: torch.nn.Module,
                      device: torch.device) -> Iterator[None]:
    """While the block runs, every `vae.decode` call first moves the transformer to the CPU and the VAE to
    `device`, and afterwards puts both back (the transformer on `device` for the next sample)."""
    if not on:
        vae.to(device)
        yield
        return
    vae_home = _device_of(vae)
    original = vae.decode

    def decode(latents: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        transformer.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()  # give the transformer's memory to the decode
        vae.to(device)
        try:
            return original(latents.to(device), *args, **kwargs)
        finally:
            vae.to(vae_home)
            transformer.to(device)

    transformer.to(device)
    vae.decode = decode  # an instance attribute: the pipeline's `self.vae.decode(...)` finds it first
    try:
        yield
    finally:
        del vae.decode  # the class's method again
