"""Runtime switches of torch and the VAE that come from the config (SimpleTuner's keys).

`apply_torch_options` runs once the caches are filled, so that cached latents never depend on them:
- `disable_benchmark` -> `torch.backends.cudnn.benchmark = not disable_benchmark`;
- `vae_enable_tiling` -> `vae.enable_tiling()` (validation decoding and on-the-fly encoding go tile by
  tile; a VAE the family already tiles, such as the video family's, keeps its own tile settings);
- `vae_enable_slicing` -> `vae.enable_slicing()` (one image of a batch at a time).
A VAE without these methods makes a requested switch an error, not a silent no-op.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.config.schema import TrainConfig


def apply_torch_options(cfg: TrainConfig, vae: Any) -> list[str]:
    """Apply the switches; returns what was switched on (for the log)."""
    torch.backends.cudnn.benchmark = not cfg.disable_benchmark
    done = [] if cfg.disable_benchmark else ["cuDNN benchmark"]
    for key, method, flag in (("vae_enable_tiling", "enable_tiling", "use_tiling"),
                              ("vae_enable_slicing", "enable_slicing", "use_slicing")):
        if not getattr(cfg, key):
            continue
        if vae is None or not callable(getattr(vae, method, None)):
            raise ValueError(f"{key}: the {type(vae).__name__} VAE of {cfg.model_family} has no {method}(); "
                             f"set {key} to false")
        if not getattr(vae, flag, False):  # already on (the family's own settings): keep them
            getattr(vae, method)()
        done.append(key)
    return done
