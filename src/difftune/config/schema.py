"""The one typed schema of `config/config.json` (flat keys, the spec format).

Owns every training option, its type, default, description and UI group. Must not import torch,
diffusers or anything under `models/`: a bad config has to fail in milliseconds, before any model
loads. Family facts it needs (names, flavours, defaults) come from `models.registry`, which is
import-light by design.
"""

from __future__ import annotations

import json
from contextlib import suppress
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, ValidationInfo, field_validator, model_validator

from difftune.config.compat import family_name
from difftune.config.crepa_keys import CrepaKeys
from difftune.config.cross_checks import cross_checks
from difftune.config.dataset_default_keys import DatasetDefaultKeys
from difftune.config.eval_keys import EvalKeys
from difftune.config.experimental import TreadConfig, tread_from_text
from difftune.config.extra_output_keys import ExtraOutputKeys
from difftune.config.extra_train_keys import ExtraTrainKeys
from difftune.config.fields import UnsetSpellings, default_if_unset, expand_home, field, zero_is_off
from difftune.config.fsdp_keys import FsdpKeys
from difftune.config.latent_cache_keys import LatentCacheKeys
from difftune.config.layersync_keys import LayerSyncKeys
from difftune.config.lora_keys import LoraKeys
from difftune.config.loss_keys import LossKeys
from difftune.config.mask_keys import MaskKeys
from difftune.config.model_source_keys import ModelSourceKeys
from difftune.config.offload_keys import OffloadKeys
from difftune.config.optimizer_keys import OptimizerKeys
from difftune.config.precision_keys import PrecisionKeys
from difftune.config.reporting_keys import project_name, tracker_choice
from difftune.config.rollout_keys import RolloutKeys
from difftune.config.schedule_keys import ScheduleKeys
from difftune.config.small_keys import SmallKeys
from difftune.config.speed_keys import SpeedKeys
from difftune.config.validation_triggers import ValidationTriggerKeys
from difftune.config.values import parse_resolutions, prompt_library, resolution_value, snap_size
from difftune.config.webhook_keys import WebhookKeys
from difftune.models.registry import FAMILY_FACTS, family_names
from difftune.prompt_library import BUILTIN_PROMPTS
from difftune.train.optimizers import MAIN_OPTIMIZERS, OPTIMIZER_ALIASES, OPTIMIZERS

# base_model_precision and text_encoder_{1,2}_precision values that work (models/quantize.py makes them); the
# spec's others are refused in config/pending.py (PENDING_VALUES) with what to use instead.
QUANTIZED_PRECISIONS = ("no_change", "int8-quanto", "int8-torchao", "fp8-quanto", "fp8-torchao", "int4-quanto",
                        "nf4-bnb", "int2-quanto", "fp8uz-quanto")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial", "sine")


class TrainConfig(CrepaKeys, RolloutKeys, SpeedKeys, DatasetDefaultKeys, LossKeys,  # config/*_keys.py
                  ValidationTriggerKeys, ScheduleKeys, PrecisionKeys,  # config/validation_triggers.py
                  ExtraTrainKeys, ExtraOutputKeys, LoraKeys,  # config/extra_*_keys.py, lora_keys.py
                  OptimizerKeys, EvalKeys, MaskKeys,  # config/optimizer_keys.py, eval_keys.py, mask_keys.py
                  WebhookKeys, OffloadKeys, FsdpKeys,  # config/webhook_keys.py, offload_keys.py, fsdp_keys.py
                  SmallKeys, ModelSourceKeys, LatentCacheKeys,  # small_keys.py, model_source_keys.py, latent_cache_keys.py
                  LayerSyncKeys,  # config/layersync_keys.py
                  UnsetSpellings):  # config/fields.py: "" and "none" as null
    """All keys of config.json. Unknown keys are rejected by `config.load` with a suggestion."""

    # protected_namespaces=(): the model_* keys (model_family, model_type) would warn under pydantic<2.10
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
    # optional keys whose text may be the word "none" itself (a prompt, a name): only "" or null unsets them
    FREE_TEXT = frozenset(("validation_prompt", "instance_prompt", "model_card_note", "tracker_project_name",
                           "tracker_run_name", "hub_model_id", "eval_dataset_id"))

    # --- model
    model_family: Literal[family_names()] = field(  # type: ignore[valid-type]
        ..., "Model family to train: " + ", ".join(family_names()) + " (SimpleTuner's kandinsky5_image and "
        "kandinsky5_video are accepted too).", "model"
    )
    model_flavour: str | None = field(
        None,
        "Flavour of the family (a named hub repository). Empty means the family's default flavour. "
        "'tiny-random' builds a tiny random-init model offline, for tests and the demo.",
        "model",
    )
    pretrained_model_name_or_path: str | None = field(
        None, "Hub id or local folder (hub layout) of the base model. Overrides model_flavour.", "model"
    )
    model_type: Literal["lora", "full"] = field(
        "lora", "What trains: 'lora' (an adapter, see lora_type) or 'full' (every transformer weight; saved "
        "as a diffusers transformer folder).", "model"
    )
    lora_type: Literal["standard", "lycoris"] = field(
        "standard", "'standard': a peft LoRA. 'lycoris': a LyCORIS network described by lycoris_config.", "model"
    )
    lycoris_config: str | None = field(
        None, "JSON file for lora_type 'lycoris': algo (lokr, loha, locon, ...), linear_dim, linear_alpha, "
        "factor, apply_preset.", "model", advanced=True,
    )
    lora_dropout: float = field(0.0, "Dropout on the LoRA path during training.", "model", ge=0.0, lt=1.0,
                                advanced=True)
    lora_target_modules: list[str] | None = field(
        None, "Module names (suffixes) to put LoRA on, instead of the family's attention projections; "
        "comma-separated on the command line.", "model", advanced=True,
    )
    init_lora: str | None = field(
        None, "Start from an existing LoRA (a diffusers-layout .safetensors or its folder).", "model",
        advanced=True,
    )
    lora_format: Literal["diffusers", "comfyui"] = field(
        "diffusers", "Layout of the saved LoRA: 'diffusers' (load_lora_weights), or 'comfyui' "
        "(also writes comfyui_lora.safetensors, loadable in ComfyUI without conversion).", "output",
    )
    lora_rank: int = field(16, "LoRA rank (size of the adapter matrices).", "model", gt=0)
    lora_alpha: float | None = field(
        None, "LoRA alpha; the update is scaled by alpha/rank. Empty means equal to lora_rank.", "model", gt=0
    )

    # --- data
    data_backend_config: str = field(
        "config/multidatabackend.json", "Path of the dataset list (multidatabackend.json).", "data"
    )
    disable_bucket_pruning: bool = field(
        False,
        "Keep aspect buckets that hold fewer images than one batch (they then give smaller batches). "
        "Without it such buckets are left out, and the report says which.",
        "data",
        advanced=True,
    )
    vae_batch_size: int = field(4, "Images per VAE forward pass while caching latents.", "data", gt=0, advanced=True)
    vae_enable_patch_conv: bool = field(
        False, "Video VAE: split its 3D convolutions into chunks so peak memory stays bounded on long or large "
        "clips (same latents, a little slower). Use it when caching runs out of memory.", "memory", advanced=True,
    )
    offload_during_startup: bool = field(
        False, "Keep the transformer off the accelerator until the caches are filled, so the text encoder, the "
        "VAE and the transformer each have it to themselves in turn (the text encoder and the VAE never share "
        "it in any case). Off: the transformer moves there right after loading, so a model too large fails at "
        "once instead of after caching.", "memory",
    )
    vae_cache_disable: bool = field(
        False, "Encode images on the fly during training for every dataset; write no latents to disk "
        "(the VAE then stays in memory).", "data", advanced=True,
    )
    compress_disk_cache: bool = field(
        False, "Write the latent and text-embedding caches compressed (zlib): bf16 latents take about 20% less "
        "disk, padded text embeddings about 70% less, for CPU time per read (about 3 ms per 1024 px latent, in "
        "the read-ahead thread). "
        "Entries already written stay readable either way: switching it re-encodes nothing.", "data",
        advanced=True,
    )
    vae_enable_tiling: bool = field(
        False, "Decode validation samples (and encode on-the-fly latents) tile by tile: bounded memory at "
        "large sizes, with faint seams possible. Cached latents are always encoded without it. The video "
        "family tiles its VAE in any case.", "memory", advanced=True,
    )
    vae_enable_slicing: bool = field(
        False, "Pass a batch through the VAE one image at a time (same result, less peak memory).", "memory",
        advanced=True,
    )
    caption_dropout_probability: float = field(
        0.0, "Chance that a sample trains with an empty caption (keeps the model usable without a prompt "
        "and helps classifier-free guidance).", "training", ge=0.0, le=1.0,
    )

    # --- training
    seed: int = field(
        42, "Random seed: data order, noise and timesteps all derive from it (null: 42; a run is always seeded, so "
        "that a resume repeats it).", "training", ge=0, le=2**63 - 1,  # torch.manual_seed's range
    )
    train_batch_size: int = field(1, "Images per micro-batch.", "training", gt=0)
    gradient_accumulation_steps: int = field(1, "Micro-batches per optimizer step.", "training", gt=0)
    learning_rate: float = field(1e-4, "Peak learning rate. LoRA: 1e-4 (5e-5 if artifacts).", "training", gt=0,
                                 allow_inf_nan=False)
    lr_scheduler: Literal[LR_SCHEDULERS] = field(  # type: ignore[valid-type]
        "constant", "Learning-rate schedule, after lr_warmup_steps of linear warm-up: "
        "'constant', 'constant_with_warmup', 'linear' (to 0), 'cosine' (to lr_end, else 0), 'cosine_with_restarts' "
        "(lr_num_cycles cosines, each down to lr_end, else 0), 'polynomial' (to lr_end with power lr_power) or "
        "'sine' (SimpleTuner's waves, no warm-up: lr_end + (learning_rate - lr_end)(1 + sin(pi k / "
        "lr_warmup_steps)) / 2 at step k).", "training",
    )
    lr_warmup_steps: int = field(
        0, "Steps of linear warmup from 0 to learning_rate ('sine': half its wave's period). With optimizer "
        "'adamw_schedulefree': the schedulefree "
        "library's warm-up, learning_rate x (k + 1) / lr_warmup_steps at step k, with lr_scheduler 'constant' too.",
        "training", ge=0,
    )
    max_train_steps: int = field(
        0, "Stop after this many optimizer steps (0: use num_train_epochs). With both, the first reached stops.",
        "training", ge=0,
    )
    num_train_epochs: int = field(
        0, "Stop after this many passes over the data (0 or null: use max_train_steps).", "training", ge=0
    )
    max_grad_norm: float | None = field(
        None, "Clip gradients to this value (1.0 is usual; see grad_clip_method); empty or 0 disables clipping.",
        "training", gt=0,
    )
    grad_clip_method: Literal["norm", "value"] = field(
        "norm", "How max_grad_norm clips: 'norm' scales all gradients so their global norm is at most "
        "max_grad_norm; 'value' clamps each gradient element to [-max_grad_norm, max_grad_norm]. (SimpleTuner's "
        "default is 'value'; set it to train exactly as a SimpleTuner config did.)", "training", advanced=True,
    )
    cudnn_benchmark: bool = field(
        False, "Let cuDNN time and pick the fastest convolution algorithms (torch.backends.cudnn.benchmark), which "
        "may change results in the last bits from run to run. Off: a resumed run repeats its losses exactly. "
        "(SimpleTuner's disable_benchmark is about base-model samples, not this.)", "memory", advanced=True,
    )
    optimizer: str = field(
        "adamw", "Optimizer. " + " ".join(f"'{k}': {OPTIMIZERS[k]}" for k in MAIN_OPTIMIZERS) + " SimpleTuner's other "
        "names are taken too, with SimpleTuner's settings for each: " + ", ".join(
            k for k in OPTIMIZERS if k not in MAIN_OPTIMIZERS) + " (train/optimizer_catalog.py).", "training",
        choices=list(OPTIMIZERS),
    )
    use_ema: bool = field(False, "Keep an exponential moving average of the trained weights.", "training")
    ema_decay: float = field(0.995, "EMA decay per update (closer to 1: slower, smoother).", "training",
                             ge=0.0, le=1.0, advanced=True)
    ema_update_interval: int = field(1, "Update the EMA every N optimizer steps.", "training", ge=1, advanced=True)
    ema_device: Literal["cpu", "accelerator"] = field(
        "cpu", "Where the EMA copy lives: 'cpu' saves accelerator memory.", "memory", advanced=True
    )
    ema_validation: Literal["none", "ema_only", "comparison"] = field(
        "comparison", "With use_ema: validate with the EMA weights ('ema_only'), both ('comparison'), "
        "or only the live weights ('none').", "validation", advanced=True,
    )
    flow_schedule_shift: float = field(
        1.0,
        "Shift of the training timestep distribution: lower favours fine detail, higher favours composition. "
        "Unused (any value) with flow_schedule_auto_shift.",
        "training",
        ge=0,
    )
    flow_schedule_auto_shift: bool = field(
        False,
        "Derive the shift from each batch's image size (more tokens, more shift), as the pipeline does at "
        "sampling time. Replaces flow_schedule_shift.",
        "training",
    )
    timestep_sampling: Literal["logit_normal", "uniform", "mode"] = field(
        "logit_normal", "How training noise levels are drawn (before the shift): 'logit_normal' (SD3's default), "
        "'uniform', or 'mode' (heavier tails).", "training", advanced=True,
    )
    logit_mean: float = field(0.0, "Mean of the logit-normal distribution.", "training", advanced=True)
    logit_std: float = field(1.0, "Standard deviation of the logit-normal distribution.", "training", gt=0,
                             advanced=True)
    mode_scale: float = field(1.29, "Scale of the 'mode' distribution.", "training", advanced=True)
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = field(
        "none", "Per-sample loss weighting by noise level (SD3 paper's schemes).", "training", advanced=True
    )
    max_nonfinite_steps: int = field(
        5, "A step whose loss or gradient is not finite is skipped and reported; this many in a row stop "
        "training (the last checkpoint stays intact).", "training", ge=1, advanced=True,
    )
    checkpoints_total_limit: int | None = field(
        None, "Keep only the newest N checkpoints (older ones are deleted after a new one is complete).",
        "output", ge=1,
    )
    mixed_precision: Literal["bf16", "fp16", "no"] = field(
        "bf16", "Autocast precision of the forward pass ('no' for full fp32; use 'no' on CPU).", "training"
    )
    base_model_default_dtype: Literal["bf16", "fp16", "fp32"] | None = field(
        None, "Dtype of the frozen base weights. Empty follows mixed_precision.", "memory", advanced=True
    )
    base_model_precision: Literal[QUANTIZED_PRECISIONS] = field(  # type: ignore[valid-type]
        "no_change", "Store the frozen transformer's linear weights quantized (weight-only), for LoRA and LyCORIS: "
        "'int8-quanto' or 'int8-torchao' halve a bf16 model's memory; 'fp8-quanto', 'fp8-torchao' (8-bit float) "
        "and 'int4-quanto' or 'nf4-bnb' (bitsandbytes NF4; about a quarter) also exist, and 'int2-quanto' (an eighth; a "
        "large quality cost) and 'fp8uz-quanto' (AMD's fp8). The adapter trains in full precision and loads into the "
        "unquantized pipeline. 'no_change': the weights as loaded.", "memory",
    )
    text_encoder_1_precision: Literal[QUANTIZED_PRECISIONS] = field(  # type: ignore[valid-type]
        "no_change", "Store the first text encoder's linear weights quantized (weight-only), with the values of "
        "base_model_precision: Gemma2 for Lumina2, Qwen2.5-VL for Kandinsky 5 (sensitive to quantization: "
        "'no_change' is recommended there). A quantized encoder gives other embeddings, so the text cache is "
        "encoded again. 'no_change': the weights as loaded.", "memory", advanced=True,
    )
    text_encoder_2_precision: Literal[QUANTIZED_PRECISIONS] = field(  # type: ignore[valid-type]
        "no_change", "Store the second text encoder's linear weights quantized (weight-only), with the values of "
        "base_model_precision: CLIP for Kandinsky 5; Lumina2 has no second text encoder. 'no_change': the "
        "weights as loaded.", "memory", advanced=True,
    )
    quantize_via: Literal["cpu", "accelerator"] = field(
        "cpu", "Where base_model_precision and the text encoders' precisions quantize: 'cpu' (before the model "
        "moves, so the accelerator never holds it in full precision) or 'accelerator' (faster on a GPU).", "memory",
        advanced=True,
    )
    gradient_checkpointing: bool = field(
        False, "Recompute activations in the backward pass: much less memory, about 30% slower.", "memory"
    )
    gradient_checkpointing_interval: int | None = field(
        None, "With gradient_checkpointing: checkpoint only every n-th transformer block (blocks 0, n, 2n, ...); "
        "the others keep their activations. Between no checkpointing and full checkpointing in memory and speed. "
        "Empty or 1: every block.", "memory", advanced=True, ge=1,
    )
    enable_model_cpu_offload: bool = field(
        False, "Whole models take turns on the accelerator: while validation's VAE decodes, the transformer waits in "
        "CPU memory (the sample's peak is the larger model's, not both); while the caches fill, the transformer "
        "stays off the accelerator (as offload_during_startup). Costs a model transfer per validation sample. "
        "Never with enable_group_offload.", "memory", advanced=True,
    )
    tread_config: TreadConfig | None = field(
        None, "TREAD token routing (faster training): a share of the image/video tokens skips a span of blocks and "
        "rejoins after it, e.g. {\"routes\": [{\"selection_ratio\": 0.5, \"start_layer_idx\": 2, "
        "\"end_layer_idx\": -2}]}. Tokens are chosen at random per sample; caption tokens and the input frame of "
        "image-to-video always stay. Training only: validation sees every token. Empty: off.", "training",
        advanced=True,
    )
    # --- validation
    validation_prompt: str | None = field(None, "Prompt sampled during training; empty disables validation.", "validation")
    user_prompt_library: str | None = field(
        None, "JSON file of {name: prompt}; each prompt is sampled beside validation_prompt.", "validation",
    )
    validation_step_interval: int = field(
        0, "Sample every N optimizer steps (0 or null: only at the end of training).", "validation", ge=0
    )
    validation_resolution: str | None = field(
        None, "WIDTHxHEIGHT of validation samples; several separated by commas. Sides that are not multiples "
        "of 16 are rounded to the nearest (480x854 samples at 480x848, with a note). Empty: the family's "
        "default (1024x1024 for images, 512x768 for video).", "validation",
    )
    validation_guidance: float | None = field(
        None, "Classifier-free guidance scale. Empty uses the family default.", "validation", ge=0
    )
    validation_num_inference_steps: int = field(30, "Sampling steps for validation.", "validation", gt=0)
    validation_seed: int | None = field(None, "Seed of validation noise. Empty uses `seed`.", "validation")
    validation_negative_prompt: str = field(
        "blurry, cropped, ugly", "Negative prompt for classifier-free guidance.", "validation"
    )
    validation_using_datasets: bool = field(
        False, "Image-to-image flavours: take the validation input image from the dataset eval_dataset_id "
        "(otherwise the first pair of the training set is used).", "validation", advanced=True,
    )
    eval_dataset_id: str | None = field(
        None, "Id of the dataset (image or conditioning) whose first image is the validation input image.",
        "validation", advanced=True,
    )
    validation_num_video_frames: int | None = field(
        None, "Video families: frames per validation video, 4k+1 (49, 61, ...). Empty: the first video "
        "dataset's num_frames (61 without one).", "validation", ge=1,
    )
    frame_rate: float | None = field(
        None, "Video families: frames per second of validation videos, and of training clips unless a "
        "dataset's video block sets its own. Empty: 24.", "validation", gt=0,
    )
    validation_disable_unconditional: bool = field(
        False, "Skip the extra unconditional sample (the empty prompt) that each validation writes beside "
        "the prompted ones. Guidance and the negative prompt apply either way.", "validation", advanced=True,
    )
    validation_prompt_library: bool = field(
        False, "Also sample difftune's built-in set of varied prompts (portrait, landscape, text, animal, close-up, "
        "architecture, ...) beside validation_prompt, as user_prompt_library does.", "validation", advanced=True,
    )
    validation_guidance_rescale: float = field(
        0.0, "Guidance rescale (phi) of the sampling pipeline. None of the supported families' pipelines takes "
        "guidance_rescale, so only 0.0 is accepted.", "validation", ge=0.0, le=1.0, advanced=True,
    )
    evaluation_type: Literal["none", "clip"] = field(
        "none", "'clip': score validation samples against their prompts with a CLIP model (100 x cosine of the "
        "image and text embeddings, at least 0; videos: the mean over a few frames), logged as an 'evaluation' "
        "event, sent to the trackers and charted in the web UI.", "validation",
    )
    eval_steps_interval: int = field(
        0, "CLIP evaluation every N optimizer steps (it samples the first num_eval_images validation prompts), and "
        "the evaluation loss of eval datasets. 0: score the samples of each validation, and measure the evaluation "
        "loss at each validation trigger (unless eval_epoch_interval sets a schedule).", "validation", ge=0,
    )
    num_eval_images: int | None = field(
        None, "How many validation samples each evaluation scores (the first ones). Empty: all of them.",
        "validation", ge=1, advanced=True,
    )
    evaluation_clip_model: str = field(
        "openai/clip-vit-large-patch14", "CLIP model of evaluation_type 'clip': a hub id or a local folder "
        "(transformers' CLIPModel and CLIPProcessor). Loaded once, kept in CPU memory between evaluations.",
        "validation", advanced=True,
    )

    # --- output
    output_dir: str = field("output/models", "Where the adapter, checkpoints, samples and logs go.", "output")
    checkpoint_step_interval: int = field(
        0, "Write a resumable checkpoint every N optimizer steps (0 or null: only at the end).", "output", ge=0
    )
    resume_from_checkpoint: str | None = field(
        None, "'latest' to continue from the newest complete checkpoint in output_dir, or a checkpoint: its path, or "
        "its folder name under output_dir/checkpoints (checkpoint-0000400). Empty, null or 'none': start afresh. "
        "Checkpoints after the step a run starts from are moved into checkpoints/superseded-<UTC time>/.",
        "output",
    )
    report_to: Literal["none", "wandb", "tensorboard", "all"] = field(
        "none", "Experiment tracker, through accelerate's trackers: 'tensorboard' (event files under "
        "output_dir/tensorboard), 'wandb' (Weights & Biases; WANDB_MODE=offline writes under output_dir/wandb), "
        "'all' (both; SimpleTuner's 'wandb,tensorboard' too) or 'none' (null too). Losses, learning rate, step "
        "time, peak memory, validation samples and CLIP scores are sent; the JSONL event log is always written.",
        "output"
    )
    tracker_project_name: str | None = field(
        None, "Project name for the trackers: the W&B project, and TensorBoard's logs go to "
        "output_dir/tensorboard/<this>. Empty: 'difftune'.",
        "output", advanced=True)
    tracker_run_name: str | None = field(None, "Run name shown by the tracker (W&B run name).", "output",
                                         advanced=True)
    push_to_hub: bool = field(
        False, "Upload the result (adapter, model card README.md, sample images) to the Hugging Face hub repository "
        "hub_model_id at the end of training (in the background; the run waits for it, bounded). Uses your "
        "saved login or HF_TOKEN, checked (and the repository created) before any model loads; a result upload "
        "that still fails ends `difftune train` with exit status 4.", "output")
    push_checkpoints_to_hub: bool = field(
        False, "Also upload each checkpoint (under checkpoints/ in the repository) as it is written, in the "
        "background; a failed upload is retried, then reported as a warning. The repository's checkpoints follow the "
        "local ones: what checkpoints_total_limit and checkpoints_rolling_total_limit prune is deleted there too "
        "(the hub's history keeps it). SimpleTuner uploads each checkpoint over the repository's top level "
        "instead.", "output", advanced=True)
    hub_model_id: str | None = field(None, "Hub repository for push_to_hub: 'user/name', or 'name' under your "
                                           "account.", "output")
    hub_private: bool = field(False, "Create the hub repository as private (when it does not exist yet).",
                              "output", advanced=True)

    @field_validator("output_dir", "data_backend_config", "pretrained_model_name_or_path",
                     "pretrained_transformer_model_name_or_path", "pretrained_vae_model_name_or_path",
                     "user_prompt_library", "lycoris_config", "init_lora", "webhook_config",
                     "crepa_encoder", "evaluation_clip_model", mode="before")
    @classmethod
    def _paths_from_home(cls, value: Any) -> Any:
        return expand_home(value)  # `~/out` is the home folder's out, as in a shell

    @field_validator("resume_from_checkpoint", mode="before")
    @classmethod
    def _resume_off_or_from_home(cls, value: Any) -> Any:
        if value is False or isinstance(value, str) and value.strip().lower() in ("", "none", "null", "false"):
            return None  # what users type to switch a file's 'latest' off (SimpleTuner's default is none)
        if value is True or isinstance(value, str) and value.strip().lower() == "true":  # a bare --resume_from_checkpoint
            raise ValueError("resume_from_checkpoint needs a value: latest, a checkpoint folder or its name "
                             "(checkpoint-0000400)")
        return expand_home(value)

    @model_validator(mode="after")
    def _resume_by_folder_name(self) -> TrainConfig:
        """A checkpoint named as the folder the user sees under output_dir/checkpoints."""
        resume = self.resume_from_checkpoint
        if resume not in (None, "latest") and not Path(resume).is_dir():
            # output_dir/<name>: SimpleTuner's layout, which config/load.check_paths then refuses with what to do
            for named in (Path(self.output_dir) / "checkpoints" / resume, Path(self.output_dir) / resume):
                if named.is_dir():
                    self.resume_from_checkpoint = str(named)
                    break
        return self

    @field_validator("lora_target_modules", "fsdp_transformer_layer_cls_to_wrap", mode="before")
    @classmethod
    def _targets(cls, v: object) -> object:
        if isinstance(v, str) and v.strip().startswith("["):  # a JSON list as text (the command line, SimpleTuner)
            with suppress(ValueError):  # else left as text: refused as matching no layer, quoting what was written
                v = json.loads(v)
        if isinstance(v, str):
            return [part.strip() for part in v.split(",") if part.strip()] or None
        return v

    @field_validator("tread_config", mode="before")
    @classmethod
    def _tread_text(cls, v: object) -> object:
        return tread_from_text(v)

    @field_validator("lycoris_config")
    @classmethod
    def _lycoris_file(cls, v: str | None) -> str | None:
        return None if v in (None, "") else v  # the file is read by cross_checks when lora_type is 'lycoris'

    @field_validator("seed", "max_train_steps", "num_train_epochs", "checkpoint_step_interval",
                     "validation_step_interval", "eval_steps_interval", "validation_using_datasets", mode="before")
    @classmethod
    def _null_is_default(cls, v: object, info: Any) -> object:
        """SimpleTuner writes null for these (its default, or "no epoch / step limit or interval"): the same as
        leaving them out, whose default 0 is that "off"."""
        return default_if_unset(cls, v, info.field_name)

    @field_validator("max_grad_norm", mode="before")
    @classmethod
    def _zero_is_off(cls, v: Any) -> object:
        return zero_is_off(v)  # config/fields.py: 0 is "no clipping" in SimpleTuner and most trainers

    @field_validator("tracker_project_name")
    @classmethod
    def _project_name(cls, v: str | None) -> str | None:
        return project_name(v)  # config/reporting_keys.py: a name, not a path

    @field_validator("init_lora")
    @classmethod
    def _init_lora(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        if not Path(v).exists():
            raise ValueError(f"{v} does not exist; give a LoRA .safetensors file or the folder holding one")
        return v

    @field_validator("user_prompt_library")
    @classmethod
    def _library(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        prompt_library(v)  # fail at config time, not at the first validation
        return v

    @field_validator("model_flavour", "pretrained_model_name_or_path", "validation_prompt", "resume_from_checkpoint")
    @classmethod
    def _empty_is_none(cls, v: str | None) -> str | None:
        return v if v not in ("", None) else None

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers(cls, v: object) -> object:
        return tracker_choice(v)  # config/reporting_keys.py: SimpleTuner's null and comma lists

    @field_validator("evaluation_type", mode="before")
    @classmethod
    def _evaluation_none(cls, v: object) -> object:
        return "none" if v in (None, "None", "") else v

    @field_validator("model_family", mode="before")
    @classmethod
    def _family_alias(cls, v: object) -> object:
        return family_name(v)

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer_alias(cls, v: object) -> object:
        return OPTIMIZER_ALIASES.get(v, v) if isinstance(v, str) else v

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, v: str) -> str:
        if v not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {v!r}; choose one of {', '.join(OPTIMIZERS)}")
        return v

    @field_validator("validation_resolution", mode="before")
    @classmethod
    def _resolution(cls, v: object) -> object:
        return resolution_value(v)  # config/values.py: a JSON number or list as the text form, sizes checked

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> TrainConfig:
        cross_checks(self, (info.context or {}).get("spellings"))  # config/cross_checks.py
        return self

    # --- derived values (no string parsing outside config/)
    def flavour(self) -> str:
        return self.model_flavour or FAMILY_FACTS[self.model_family].default_flavour

    def model_source(self) -> str:
        """Hub id or local folder to load: the explicit path wins over the flavour."""
        return self.pretrained_model_name_or_path or FAMILY_FACTS[self.model_family].flavours[self.flavour()]

    def validation_prompts(self) -> list[tuple[str | None, str]]:
        """(name, prompt) pairs to sample: the main prompt (name None), the user library's, then the built-in
        library's (validation_prompt_library; a name the user library also has is the user's)."""
        main = [(None, self.validation_prompt)] if self.validation_prompt is not None else []
        library = prompt_library(self.user_prompt_library) if self.user_prompt_library else {}
        builtin = BUILTIN_PROMPTS if self.validation_prompt_library else {}
        return main + list(library.items()) + [(k, v) for k, v in builtin.items() if k not in library]

    def validation_sizes(self) -> list[tuple[int, int]]:
        """(width, height) of each validation size, snapped to the family's pixel multiple."""
        multiple = FAMILY_FACTS[self.model_family].pixel_multiple
        return list(dict.fromkeys(snap_size(w, h, multiple) for w, h in self._given_sizes()))  # each size once

    def validation_notes(self) -> list[str]:
        """One line per validation size that was snapped (to print before the run starts)."""
        multiple = FAMILY_FACTS[self.model_family].pixel_multiple
        notes = [f"validation_resolution {w}x{h}: sides must be multiples of {multiple}; validation samples are "
                 f"{snap_size(w, h, multiple)[0]}x{snap_size(w, h, multiple)[1]}"
                 for w, h in self._given_sizes() if snap_size(w, h, multiple) != (w, h)]
        if len(self.validation_sizes()) < len(self._given_sizes()):  # each sampled once: twice wrote one file twice
            notes.append(f"validation_resolution {self.validation_resolution!r} names a size twice (after snapping): "
                         f"each is sampled once ({', '.join(f'{w}x{h}' for w, h in self.validation_sizes())})")
        return notes

    def _given_sizes(self) -> list[tuple[int, int]]:
        return parse_resolutions(self.validation_resolution or FAMILY_FACTS[self.model_family].default_resolution)

    def video_fps(self) -> float:
        return self.frame_rate if self.frame_rate is not None else FAMILY_FACTS[self.model_family].default_frame_rate

    def guidance(self) -> float:
        if self.validation_guidance is not None:
            return self.validation_guidance
        return FAMILY_FACTS[self.model_family].default_guidance

    def effective_lora_alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else float(self.lora_rank)

    def _text_encoder_keys(self) -> list[tuple[str, str, int]]:
        return [("text_encoder_1_precision", self.text_encoder_1_precision, 0),
                ("text_encoder_2_precision", self.text_encoder_2_precision, 1)]

    def text_encoder_precisions(self) -> dict[str, str]:
        """Pipeline component name ('text_encoder', 'text_encoder_2') -> precision, for each text encoder
        to quantize: empty when both are 'no_change'."""
        return {("text_encoder", "text_encoder_2")[index]: precision
                for _, precision, index in self._text_encoder_keys() if precision != "no_change"}

    def weight_dtype_name(self) -> str:
        if self.base_model_default_dtype is not None:
            return self.base_model_default_dtype
        return {"bf16": "bf16", "fp16": "fp16", "no": "fp32"}[self.mixed_precision]
