"""The CREPA / REPA keys (`crepa_*`, train/crepa.py): the fields, mixed into TrainConfig, and their cross-key
checks, called from TrainConfig's validator. Import-light: no torch.

The spec (Kandinsky 5 Video) recommends block index 8, weight 0.5, adjacent distance 1, temporal decay
1.0 and the encoder `dinov2_vitg14` at 518 px (`dinov2_vits14` + 224 for a smaller one); those are the
defaults. The torch hub names are read as the matching transformers checkpoints (`ENCODER_ALIASES`).

SimpleTuner's backbone mode (`crepa_use_backbone_features`, or its newer `crepa_feature_source: backbone`) aligns
the block with a deeper block of the transformer itself (`crepa_teacher_block_index`) instead of DINOv2. One
difference: SimpleTuner's unset teacher falls back to the student block, which aligns a block with its own output
through the projector and teaches nothing; here the teacher must be named, and deeper.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, model_validator

from difftune.config.fields import field, unset

# torch hub names of the spec -> the same weights as transformers checkpoints (difftune loads with transformers)
ENCODER_ALIASES = {
    "dinov2_vits14": "facebook/dinov2-small", "dinov2_vitb14": "facebook/dinov2-base",
    "dinov2_vitl14": "facebook/dinov2-large", "dinov2_vitg14": "facebook/dinov2-giant",
    "dinov2_vits14_reg": "facebook/dinov2-with-registers-small",
    "dinov2_vitb14_reg": "facebook/dinov2-with-registers-base",
    "dinov2_vitl14_reg": "facebook/dinov2-with-registers-large",
    "dinov2_vitg14_reg": "facebook/dinov2-with-registers-giant",
}


CREPA_SCHEDULERS = ("constant", "linear", "cosine", "polynomial")
FEATURE_SOURCES = ("encoder", "backbone", "self_flow")  # SimpleTuner's crepa_feature_source; self_flow is not here


class CrepaKeys(BaseModel):
    crepa_enabled: bool = field(
        False, "CREPA (video) / REPA (images): align the transformer's hidden states after block crepa_block_index, "
        "through a small trained projector, with frozen DINOv2 features of the clean frames (and, for video, of "
        "the neighbouring frames). Steadier subjects, less flicker. The projector is trained and checkpointed but "
        "is not part of the saved LoRA. Costs a VAE decode and a DINOv2 pass per step (crepa_use_backbone_features: "
        "neither; a deeper block of the transformer is the target).", "training", advanced=True,
    )
    crepa_block_index: int = field(
        8, "With crepa_enabled: the block (0-based, of the image/video blocks: Lumina2's `layers`, Kandinsky 5's "
        "visual blocks) whose output is aligned.", "training", ge=0, advanced=True,
    )
    crepa_lambda: float = field(
        0.5, "With crepa_enabled: weight of the alignment loss added to the flow-matching loss (its peak, with "
        "crepa_warmup_steps or a decaying crepa_scheduler).", "training",
        ge=0.0, advanced=True,
    )
    crepa_adjacent_distance: int = field(
        1, "With crepa_enabled, video: each latent frame is also aligned with the DINOv2 features of the frames this "
        "many latent frames away (every frame up to it with crepa_cumulative_neighbors; 0: its own frame only, "
        "plain REPA). Images use 0.", "training", ge=0,
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
    crepa_cumulative_neighbors: bool = field(
        False, "With crepa_enabled, video: align each latent frame with every frame up to crepa_adjacent_distance "
        "away (1..d, each weighed exp(-d/tau)); off: with its own frame and the two exactly d away (the paper's "
        "K = {f-d, f+d}). The same at distance 1.", "training", advanced=True,
    )
    crepa_spatial_align: bool = field(
        True, "With crepa_enabled: align token by token (DINOv2's patch grid resized to the frame's token grid); "
        "off: align the mean of the frame's tokens with the mean of its features (less memory, coarser).",
        "training", advanced=True,
    )
    crepa_use_backbone_features: bool = field(
        False, "With crepa_enabled: align block crepa_block_index with a deeper block of the transformer itself "
        "(crepa_teacher_block_index: its output in the same forward pass, taken without gradient) instead of DINOv2 "
        "features of the decoded frames. No encoder to download or hold, no VAE decode or DINOv2 pass per step "
        "(SimpleTuner's backbone mode).", "training", advanced=True,
    )
    crepa_teacher_block_index: int | None = field(
        None, "With crepa_use_backbone_features: the teacher block (0-based, of the same image/video blocks as "
        "crepa_block_index, and deeper than it), e.g. 16 with crepa_block_index 8 on a 32-block model.", "training",
        ge=0, advanced=True,
    )
    crepa_feature_source: Literal[FEATURE_SOURCES] = field(  # type: ignore[valid-type]
        "encoder", "With crepa_enabled (SimpleTuner's newer switch of crepa_use_backbone_features): 'encoder' aligns "
        "with DINOv2 (crepa_encoder), 'backbone' with the transformer's block crepa_teacher_block_index; 'self_flow' "
        "is not implemented yet.", "training", advanced=True,
    )
    crepa_scheduler: Literal[CREPA_SCHEDULERS] = field(  # type: ignore[valid-type]
        "constant", "With crepa_enabled: how the alignment weight moves from crepa_lambda to crepa_lambda_end after "
        "the warm-up: 'constant' (stays at crepa_lambda), 'linear', 'cosine' or 'polynomial' (crepa_power), over "
        "crepa_decay_steps.", "training", advanced=True,
    )
    crepa_warmup_steps: int = field(
        0, "With crepa_enabled: the weight rises linearly from 0 to crepa_lambda over this many optimizer steps.",
        "training", ge=0, advanced=True,
    )
    crepa_decay_steps: int = field(
        0, "With crepa_enabled and a decaying crepa_scheduler: steps of the decay after the warm-up (0: until the "
        "last step of the run).", "training", ge=0, advanced=True,
    )
    crepa_lambda_end: float = field(
        0.0, "With crepa_enabled and a decaying crepa_scheduler: the weight at the end of the decay (it stays there).",
        "training", ge=0.0, advanced=True,
    )
    crepa_power: float = field(
        1.0, "With crepa_scheduler 'polynomial': the decay's power (1: linear, 2: quadratic, faster at first).",
        "training", gt=0.0, advanced=True,
    )
    crepa_cutoff_step: int = field(
        0, "With crepa_enabled: no alignment from this optimizer step on (0: never cut off). Steps without it skip "
        "the VAE decode and the DINOv2 pass.", "training", ge=0, advanced=True,
    )
    crepa_similarity_threshold: float | None = field(
        None, "With crepa_enabled: cut the alignment off once the moving average of the frames' cosine similarity "
        "to their own targets (DINOv2 features; the teacher block's with crepa_use_backbone_features) reaches this "
        "value (0 to 1; null: never). The term is still computed, since its similarity decides (crepa_cutoff_step "
        "saves the time).", "training", gt=0.0, le=1.0, advanced=True,
    )
    crepa_similarity_ema_decay: float = field(
        0.99, "With crepa_similarity_threshold: the moving average's decay per micro-batch (0.99: about the last "
        "100).", "training", ge=0.0, lt=1.0, advanced=True,
    )
    crepa_threshold_mode: Literal["permanent", "recoverable"] = field(
        "permanent", "With crepa_similarity_threshold: 'permanent' (once cut, off for the rest of the run) or "
        "'recoverable' (on again whenever the average falls below the threshold).", "training", advanced=True,
    )
    crepa_drop_vae_encoder: bool = field(
        False, "With crepa_enabled: once the latent caches are complete, free the VAE's encoder (CREPA only decodes "
        "latents), saving its memory during training. Refused with on-the-fly latents (vae_cache_disable, a dataset's "
        "vae_cache_clear_each_epoch) and with "
        "validation of image-to-image/video flavours, which encode the input image.", "training", advanced=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _crepa_feature_source(cls, data: Any) -> Any:
        """crepa_feature_source 'backbone' is crepa_use_backbone_features true. 'encoder' is SimpleTuner's default,
        which its configure tool writes into every config: crepa_use_backbone_features true beside it (in the file or
        on the command line) wins. 'backbone' beside crepa_use_backbone_features false is a contradiction."""
        if not isinstance(data, dict):
            return data
        source, flag = data.get("crepa_feature_source"), data.get("crepa_use_backbone_features")
        flag_on = str(flag).strip().lower() in ("1", "on", "t", "true", "y", "yes")  # as pydantic reads a bool
        if unset(source) or (source == "encoder" and flag_on):
            return data  # crepa_use_backbone_features decides (the form and a saved config keep what was written)
        if source not in ("encoder", "backbone"):
            return data  # self_flow (refused by crepa_checks while crepa_enabled) or a typo (the Literal's error)
        if source == "backbone" and not unset(flag) and not flag_on:
            raise ValueError(f"crepa_feature_source {source!r} and crepa_use_backbone_features {flag!r} disagree: "
                             "remove one of them")
        return {**data, "crepa_use_backbone_features": source == "backbone"}


def crepa_checks(cfg: Any) -> None:
    """Raise ValueError for a CREPA setting difftune cannot run (its settings are free while it is off)."""
    if not cfg.crepa_enabled:
        return
    if cfg.crepa_feature_source == "self_flow":
        raise ValueError("not implemented yet: crepa_feature_source 'self_flow' (Self-Flow: an EMA teacher seeing "
                         "cleaner tokens); use 'encoder' (DINOv2) or 'backbone' (a deeper block, "
                         "crepa_teacher_block_index)")
    if cfg.crepa_use_backbone_features:
        teacher, student = cfg.crepa_teacher_block_index, cfg.crepa_block_index
        if teacher is None or teacher <= student:
            said = "is unset" if teacher is None else f"is {teacher}"
            raise ValueError(f"crepa_use_backbone_features aligns block crepa_block_index ({student}) with a deeper "
                             f"block of the transformer, crepa_teacher_block_index, which {said}: set it above "
                             f"{student}, e.g. {2 * student or 1} (SimpleTuner's unset teacher is the block itself, "
                             "which aligns the block with its own output and teaches nothing)")
    if cfg.fsdp_enable:
        raise ValueError("crepa_enabled with fsdp_enable is not supported (the projector is not sharded); turn one "
                         "of them off")
    if cfg.crepa_drop_vae_encoder and not cfg.crepa_use_backbone_features:  # backbone mode: unused (crepa_notes)
        _drop_encoder_checks(cfg)


def _drop_encoder_checks(cfg: Any) -> None:
    """crepa_drop_vae_encoder frees the encoder after caching (train/crepa.py): whatever encodes pixels later is
    refused here, before any model loads. Per-dataset vae_cache_disable is checked by `crepa_dataset_problems`."""
    from difftune.models.registry import FAMILY_FACTS

    if cfg.vae_cache_disable:
        raise ValueError("crepa_drop_vae_encoder with vae_cache_disable: on-the-fly latents are encoded during "
                         "training, which needs the VAE's encoder; turn one of them off")
    # The stock I2I/I2V pipelines encode the validation input image with the VAE at every validation (and CLIP
    # evaluation samples through validation): the encoder is needed after caching.
    validating = cfg.validation_prompt or cfg.user_prompt_library or cfg.validation_prompt_library
    if validating and FAMILY_FACTS[cfg.model_family].takes_input_image(cfg.flavour()):
        raise ValueError(f"crepa_drop_vae_encoder with validation of the image-conditioned flavour {cfg.flavour()!r}: "
                         "its pipeline encodes the validation input image with the VAE's encoder; set "
                         "crepa_drop_vae_encoder to false, or validate without prompts (no validation_prompt, "
                         "user_prompt_library or validation_prompt_library)")


def crepa_dataset_problems(cfg: Any, datasets: list[Any]) -> list[str]:
    """crepa_drop_vae_encoder against the dataset list (config/load.py, before any model loads): a dataset whose
    latents are encoded during training (its vae_cache_disable, or vae_cache_clear_each_epoch) needs the encoder the
    option frees."""
    if not (decodes(cfg) and cfg.crepa_drop_vae_encoder):
        return []
    return [f"dataset {ds.id!r}: {key} encodes its latents during training, but crepa_drop_vae_encoder frees the VAE's "
            f"encoder after caching; remove {key} from the dataset or set crepa_drop_vae_encoder to false"
            for ds in datasets for key in ("vae_cache_disable", "vae_cache_clear_each_epoch", "vae_cache_ondemand")
            if getattr(ds, key, False)]


def decodes(cfg: Any) -> bool:
    """Whether CREPA decodes the clean latents with the VAE every step (DINOv2's targets; not in backbone mode)."""
    return bool(getattr(cfg, "crepa_enabled", False)) and not getattr(cfg, "crepa_use_backbone_features", False)


def crepa_notes(cfg: Any) -> list[str]:
    """CREPA keys set (in the file or on the command line) to something the other CREPA keys leave unused. SimpleTuner
    passes them on silently; here a note says so, as for the lr schedule's keys."""
    if not cfg.crepa_enabled:
        return []
    given = cfg.model_fields_set
    unused = []
    if cfg.crepa_scheduler == "constant":
        unused += [(k, "crepa_scheduler 'constant' keeps crepa_lambda") for k in
                   ("crepa_decay_steps", "crepa_lambda_end", "crepa_power") if k in given]
    elif cfg.crepa_scheduler != "polynomial" and "crepa_power" in given:
        unused.append(("crepa_power", f"crepa_scheduler {cfg.crepa_scheduler!r} is not 'polynomial'"))
    if cfg.crepa_similarity_threshold is None:
        unused += [(k, "crepa_similarity_threshold is unset") for k in
                   ("crepa_similarity_ema_decay", "crepa_threshold_mode") if k in given]
    if cfg.crepa_use_backbone_features:
        unused += [(k, "crepa_use_backbone_features aligns with the transformer's own block crepa_teacher_block_index, "
                       "not DINOv2") for k in ("crepa_encoder", "crepa_encoder_image_size", "crepa_drop_vae_encoder")
                   if k in given]
    elif "crepa_teacher_block_index" in given and cfg.crepa_teacher_block_index is not None:
        unused.append(("crepa_teacher_block_index", "crepa_use_backbone_features is off (the teacher is DINOv2)"))
    if "video" not in cfg.model_family:
        unused += [(k, f"{cfg.model_family} trains images, one frame each (these act between a clip's frames)")
                   for k in ("crepa_adjacent_distance", "crepa_adjacent_tau", "crepa_cumulative_neighbors",
                             "crepa_normalize_by_frames") if k in given]
    return [f"{key} not used: {why}; remove it" for key, why in unused]

