"""Runtime switches of torch and the VAE that come from the config (SimpleTuner's keys).

`apply_torch_options` runs once the caches are filled, so that cached latents never depend on them:
- `cudnn_benchmark` -> `torch.backends.cudnn.benchmark`;
- `vae_enable_tiling` -> `vae.enable_tiling()` (validation decoding and on-the-fly encoding go tile by
  tile; a VAE the family already tiles, such as the video family's, keeps its own tile settings);
- `vae_enable_slicing` -> `vae.enable_slicing()` (one image of a batch at a time);
- `disable_tf32` -> fp32 matmuls and cuDNN convolutions in TF32 (false) or IEEE fp32 (true); null leaves
  torch's defaults. Through `torch.set_float32_matmul_precision` and `torch.backends.cudnn.allow_tf32`: in
  torch 2.13 the per-backend `fp32_precision` setters leave the older getters raising ("mix of the legacy
  and new APIs"), and torch's own inductor still calls them; these two keep both views consistent.
A VAE without these methods makes a requested switch an error, not a silent no-op.
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.config.schema import TrainConfig


def apply_torch_options(cfg: TrainConfig, vae: Any) -> list[str]:
    """Apply the switches; returns what was switched on (for the log)."""
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    done = ["cuDNN benchmark"] if cfg.cudnn_benchmark else []
    done += set_tf32(cfg.disable_tf32)
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


def set_tf32(disable_tf32: bool | None) -> list[str]:
    """TF32 for fp32 matmuls (CUDA, and CPUs with TF32 units) and cuDNN convolutions: on for false, off for
    true, untouched for None. Returns what was set, for the log."""
    if disable_tf32 is None:
        return []
    torch.set_float32_matmul_precision("highest" if disable_tf32 else "high")
    torch.backends.cudnn.allow_tf32 = not disable_tf32
    return ["TF32 off (disable_tf32)" if disable_tf32 else "TF32 matmuls and convolutions"]
