"""The CREPA / REPA keys (`crepa_*`, train/crepa.py): the fields, mixed into TrainConfig, and their cross-key
checks, called from TrainConfig's validator. Import-light: no torch.

The spec (Kandinsky 5 Video) recommends block index 8, weight 0.5, adjacent distance 1, temporal decay
1.0 and the encoder `dinov2_vitg14` at 518 px (`dinov2_vits14` + 224 for a smaller one); those are the
defaults. The torch hub names are read as the matching transformers checkpoints (`ENCODER_ALIASES`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from difftune.config.fields import field

# torch hub names of the spec -> the same weights as transformers checkpoints (difftune loads with transformers)
ENCODER_ALIASES = {
    "dinov2_vits14": "facebook/dinov2-small", "dinov2_vitb14": "facebook/dinov2-base",
    "dinov2_vitl14": "facebook/dinov2-large", "dinov2_vitg14": "facebook/dinov2-giant",
    "dinov2_vits14_reg": "facebook/dinov2-with-registers-small",
    "dinov2_vitb14_reg": "facebook/dinov2-with-registers-base",
    "dinov2_vitl14_reg": "facebook/dinov2-with-registers-large",
    "dinov2_vitg14_reg": "facebook/dinov2-with-registers-giant",
}


class CrepaKeys(BaseModel):
    crepa_enabled: bool = field(
        False, "CREPA (video) / REPA (images): align the transformer's hidden states after block crepa_block_index, "
        "through a small trained projector, with frozen DINOv2 features of the clean frames (and, for video, of "
        "the neighbouring frames). Steadier subjects, less flicker. The projector is trained and checkpointed but "
        "is not part of the saved LoRA. Costs a VAE decode and a DINOv2 pass per step.", "training", advanced=True,
    )
    crepa_block_index: int = field(
        8, "With crepa_enabled: the block (0-based, of the image/video blocks: Lumina2's `layers`, Kandinsky 5's "
        "visual blocks) whose output is aligned.", "training", ge=0, advanced=True,
    )
    crepa_lambda: float = field(
        0.5, "With crepa_enabled: weight of the alignment loss added to the flow-matching loss.", "training",
        ge=0.0, advanced=True,
    )
    crepa_adjacent_distance: int = field(
        1, "With crepa_enabled, video: each latent frame is also aligned with the DINOv2 features of the frames up "
        "to this many latent frames away (0: its own frame only, plain REPA). Images use 0.", "training", ge=0,
        advanced=True,
    )
    crepa_adjacent_tau: float = field(
        1.0, "With crepa_enabled: temporal decay; a neighbour d frames away weighs exp(-d/tau).", "training",
        gt=0.0, advanced=True,
    )
    crepa_encoder: str = field(
        "dinov2_vitg14", "With crepa_enabled: the DINOv2 encoder, a hub id such as facebook/dinov2-small, a "
        "torch hub name of the spec (dinov2_vits14, dinov2_vitg14, ...: the same weights from the Hugging Face hub) "
        "or the local folder of a transformers DINOv2 model.", "training", advanced=True,
    )
    crepa_encoder_image_size: int = field(
        518, "With crepa_enabled: side in pixels the frames are resized to for DINOv2 (a multiple of its patch "
        "size, 14; 518 for dinov2_vitg14, 224 for dinov2_vits14).", "training", ge=14, advanced=True,
    )
    crepa_normalize_by_frames: bool = field(
        True, "With crepa_enabled: average the alignment loss over the latent frames (off: sum it, so longer "
        "clips weigh more).", "training", advanced=True,
    )
    crepa_drop_vae_encoder: bool = field(
        False, "With crepa_enabled: free the VAE's encoder after caching. Not implemented yet (must stay false).",
        "training", advanced=True,
    )


def crepa_checks(cfg: Any) -> None:
    """Raise ValueError for a CREPA setting difftune cannot run (its settings are free while it is off)."""
    if not cfg.crepa_enabled:
        return
    if cfg.crepa_drop_vae_encoder:
        raise ValueError("not implemented yet: crepa_drop_vae_encoder (CREPA decodes the cached latents with the "
                         "VAE, and on-the-fly latents and image-conditioned validation need its encoder); set "
                         "crepa_drop_vae_encoder to false")
    if cfg.fsdp_enable:
        raise ValueError("crepa_enabled with fsdp_enable is not supported (the projector is not sharded); turn one "
                         "of them off")
