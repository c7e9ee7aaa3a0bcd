"""`vae_dtype` (config/precision_keys.py): the VAE in a dtype of its own, beside weights of another.

The families load their VAE through `load_vae`: `from_pretrained` in the VAE's dtype itself (so an fp32 checkpoint
is not rounded through the weights' dtype on the way), then `adapt`: when that dtype is not the weights' dtype,
forward pre-hooks on the VAE's entry modules (`encoder` for pixels, `post_quant_conv` and `decoder` for latents)
cast what they are given to the VAE's dtype. The stock pipelines hand the VAE tensors in the transformer's dtype
(Lumina2Pipeline decodes its latents as they are; the Kandinsky 5 i2i/i2v pipelines encode their input image in
it); the hooks let them use a VAE of another dtype unchanged.

What the VAE returns stays in its dtype, and each caller already takes it to its own: the families'
`encode_images` feed the latent cache and on-the-fly batches, which store and hand out fp32 (`.float()`, so an fp32
VAE's latents keep their precision); the pipelines cast encoded input images to their latents' dtype and
post-process decoded images to 8-bit pixels; CREPA's decode takes `.float()`. The latent cache's fingerprint
holds the VAE's dtype (the families' `identity`), so latents of another VAE dtype are cached apart, and latents
of the same VAE dtype are shared whatever the weights' dtype (they are the same numbers).
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.models.sources import ModelSource, load_vae_from

ENTRY_MODULES = ("encoder", "post_quant_conv", "decoder")


def load_vae(cls: Any, source: str | ModelSource, weights: torch.dtype, vae_dtype: torch.dtype | None = None) -> Any:
    """`cls.from_pretrained(source, subfolder="vae")` (or from pretrained_vae_model_name_or_path: models/sources.py)
    in `vae_dtype` (None: the weights' dtype), adapted."""
    vae = load_vae_from(cls, ModelSource.of(source), vae_dtype or weights)
    return adapt(vae, weights)


def adapt(vae: Any, weights: torch.dtype) -> Any:
    """Make a VAE whose dtype is not the weights' take inputs of any float dtype. A VAE in the weights' dtype
    is left as it is (no hook: the usual run is unchanged)."""
    if vae.dtype == weights:
        return vae
    for name in ENTRY_MODULES:
        module = getattr(vae, name, None)
        if isinstance(module, torch.nn.Module):
            module.register_forward_pre_hook(_to_own_dtype)
    return vae


def _to_own_dtype(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    dtype = next(module.parameters()).dtype
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
