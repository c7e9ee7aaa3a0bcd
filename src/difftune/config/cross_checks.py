"""The checks between keys of TrainConfig (the schema's model validator calls `cross_checks`): each raises
ValueError with the keys involved and the fix. Feature groups keep their own checks beside their keys
(fsdp_keys, offload_keys, crepa_keys, reporting_keys, rollout_keys, speed_keys); this module calls them in turn."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from difftune.config import lycoris_file
from difftune.config.crepa_keys import crepa_checks, crepa_notes
from difftune.config.datasets import four_k_plus_one
from difftune.config.fsdp_keys import fsdp_checks
from difftune.config.layersync_keys import layersync_checks
from difftune.config.lora_keys import DEFAULT_LYCORIS_CONFIG, lora_notes
from difftune.config.offload_keys import offload_checks, offload_notes
from difftune.config.optimizer_keys import optimizer_notes
from difftune.config.reporting_keys import TRACKERS, reporting_checks
from difftune.config.rollout_keys import rollout_checks
from difftune.config.schedule_keys import schedule_notes
from difftune.config.speed_keys import speed_checks
from difftune.config.values import read_json_file
from difftune.models.registry import FAMILY_FACTS

if TYPE_CHECKING:
    from difftune.config.schema import TrainConfig

VIDEO_KEYS = ("validation_num_video_frames", "frame_rate", "vae_enable_patch_conv")  # video families only


def cross_checks(cfg: TrainConfig, spellings: dict[str, str] | None = None) -> None:
    """`spellings`: difftune key -> the SimpleTuner alias the config wrote it as (config/compat.py), to name it."""
    facts = FAMILY_FACTS[cfg.model_family]
    if cfg.model_flavour is not None and cfg.model_flavour not in facts.flavours:
        raise ValueError(
            f"model_flavour {cfg.model_flavour!r} is not a flavour of {cfg.model_family}; "
            f"choose one of {', '.join(facts.flavours)}"
        )
    if cfg.lora_type == "lycoris" and cfg.lycoris_config is None and cfg.model_type == "lora":
        if not Path(DEFAULT_LYCORIS_CONFIG).is_file():
            raise ValueError("lora_type 'lycoris' needs lycoris_config: a JSON file such as "
                             '{"algo": "lokr", "linear_dim": 16, "linear_alpha": 1, "factor": 16} (unset, '
                             f"{DEFAULT_LYCORIS_CONFIG} in the working folder is read, as in SimpleTuner)")
        # SimpleTuner's default file, which its LyCORIS configs rely on; set past validate_assignment (this runs in
        # the model's validator), and marked so that lora_notes says where the network came from
        cfg.__dict__["lycoris_config"] = DEFAULT_LYCORIS_CONFIG
        cfg._lycoris_config_by_default = True
    if cfg.model_type == "full" and cfg.weight_dtype_name() == "fp16":
        # fp16 weights updated in place overflow and underflow (AdamW's epsilon is 0 in fp16): NaN at step 2.
        if cfg.base_model_default_dtype == "fp16":  # set on its own: the mixed_precision may be anything
            raise ValueError("a full fine-tune cannot update fp16 weights (base_model_default_dtype 'fp16'); set "
                             "base_model_default_dtype to 'bf16' or 'fp32'")
        raise ValueError("a full fine-tune cannot update fp16 weights; use mixed_precision 'bf16', or keep "
                         "mixed_precision 'fp16' with base_model_default_dtype 'fp32' (classic fp16 autocast)")
    halves = {cfg.base_model_default_dtype, cfg.mixed_precision}
    if cfg.base_model_precision != "no_change" and halves == {"fp16", "bf16"}:
        # the quantized layers compute in the weights' half type beside activations autocast to the other one, and
        # autocast cannot combine fp16 with bf16 (torch.stack's "Unexpected floating ScalarType" at the first step)
        raise ValueError(f"base_model_default_dtype {cfg.base_model_default_dtype!r} with mixed_precision "
                         f"{cfg.mixed_precision!r} on a quantized base (base_model_precision "
                         f"{cfg.base_model_precision!r}) mixes fp16 and bf16, which autocast cannot combine; set "
                         f"base_model_default_dtype to {cfg.mixed_precision!r} (or 'fp32'), or remove it")
    if cfg.model_type == "full" and cfg.base_model_precision != "no_change":
        raise ValueError(f"a full fine-tune cannot train quantized weights (base_model_precision "
                         f"{cfg.base_model_precision!r}); use model_type 'lora' (or lora_type 'lycoris') "
                         "on the quantized base, or base_model_precision 'no_change'")
    bnb = [k for k, v in (("base_model_precision", cfg.base_model_precision),
                          *((k, v) for k, v, _ in cfg._text_encoder_keys())) if v == "nf4-bnb"]
    if bnb and importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"{bnb[0]} 'nf4-bnb' needs the bitsandbytes package: install it with "
                         "`pip install 'difftune[bnb]'` (or bitsandbytes), or use 'int4-quanto'")
    for key, precision, index in cfg._text_encoder_keys():
        if precision != "no_change" and index >= len(facts.text_encoders):
            have = " and ".join(f"{name} (text_encoder_{i + 1}_precision)"
                                for i, name in enumerate(facts.text_encoders))
            raise ValueError(f"{key} {precision!r}: {cfg.model_family} has no text encoder {index + 1} "
                             f"(its text encoders: {have or 'none'}); remove {key} or set it to 'no_change'")
    if cfg.gradient_checkpointing_interval not in (None, 1) and not cfg.gradient_checkpointing:
        raise ValueError("gradient_checkpointing_interval only acts with gradient_checkpointing; set "
                         "gradient_checkpointing to true, or remove gradient_checkpointing_interval")
    if cfg.lycoris_config is not None and cfg.lora_type == "lycoris" and cfg.model_type == "lora":
        data = read_json_file(cfg.lycoris_config, "lycoris_config")  # only read when used (SimpleTuner's configs
        if (why := lycoris_file.problem(data)) is not None:     # name a default file whatever lora_type is)
            raise ValueError(f"{cfg.lycoris_config}: {why}")
        if lycoris_file.algo_of(data) == "full" and cfg.base_model_precision != "no_change":
            # it replaces each weight it trains; on a quantized base LyCORIS runs its modules beside the frozen
            # weights (bypass mode), which its full algo does not have
            raise ValueError(f"{cfg.lycoris_config}: algo 'full' trains the weights themselves, which a quantized "
                             f"base (base_model_precision {cfg.base_model_precision!r}) does not have: use "
                             "base_model_precision 'no_change', or another algo (lokr, loha, locon)")
        if lycoris_file.uses_dora(data) and cfg.base_model_precision != "no_change":
            # LyCORIS' bypass mode (how it trains beside quantized weights) leaves the decomposition out: the
            # magnitudes stayed as initialised, and were read from the packed bytes of an nf4 weight
            raise ValueError(f"{cfg.lycoris_config}: dora_wd (weight decomposition) is not trained on a quantized "
                             f"base (base_model_precision {cfg.base_model_precision!r}): LyCORIS runs its modules "
                             "beside quantized weights without it; remove dora_wd, or use base_model_precision "
                             "'no_change' (or a LoRA with use_dora, which trains on a quantized base)")
    if cfg.lora_format == "comfyui" and cfg.model_type != "lora":
        raise ValueError("lora_format 'comfyui' applies to LoRA and LyCORIS (model_type lora); a full fine-tune "
                         "saves a diffusers transformer folder")
    if cfg.validation_using_datasets and not facts.takes_input_image(cfg.flavour()):
        raise ValueError("validation_using_datasets only applies to image-to-image and image-to-video "
                         "flavours; remove it")
    video_keys = [k for k in VIDEO_KEYS if getattr(cfg, k) not in (None, False)]
    if video_keys and not facts.video:
        named = [f"{spellings[k]} (difftune's {k})" if k in (spellings or {}) else k for k in video_keys]
        one = len(named) == 1
        families = ", ".join(f.name for f in FAMILY_FACTS.values() if f.video)
        raise ValueError(f"{' and '.join(named)} appl{'ies' if one else 'y'} only to video families ({families}); "
                         f"remove {'it' if one else 'them'} for {cfg.model_family}")
    n = cfg.validation_num_video_frames
    if n is not None and (n - 1) % 4:
        advice = four_k_plus_one(n) if not facts.first_frame(cfg.flavour()) or n > 17 else "17 or more (4k+1)"
        raise ValueError(f"validation_num_video_frames {n} is not 4k+1 (the VAE compresses time 4x); "
                         f"use {advice}")  # image-to-video validation needs 17 or more: config/load.py
    if cfg.validation_using_datasets and cfg.eval_dataset_id is None:
        raise ValueError("validation_using_datasets needs eval_dataset_id: the dataset to take the image from")
    if cfg.flow_schedule_shift <= 0 and not cfg.flow_schedule_auto_shift:
        raise ValueError(f"flow_schedule_shift {cfg.flow_schedule_shift:g} must be above 0 (1.0 is the default), "
                         "unless flow_schedule_auto_shift is on")
    rollout_checks(cfg)
    if cfg.fsdp_enable or cfg.fsdp_version != 2 or cfg.fsdp_cpu_ram_efficient_loading:
        fsdp_checks(cfg)
    offload_checks(cfg)
    crepa_checks(cfg)
    layersync_checks(cfg)
    reporting_checks(cfg)
    speed_checks(cfg)
    if cfg.max_train_steps == 0 and cfg.num_train_epochs == 0:
        raise ValueError("set max_train_steps or num_train_epochs (both are 0, so training would never start)")


def cross_notes(cfg: TrainConfig) -> list[str]:
    """Keys set to a value their combination with another key leaves unused. SimpleTuner's configs carry such
    values (it ignores them too), so they are notes printed before the run, not errors."""
    notes = lora_notes(cfg) + optimizer_notes(cfg) + unsampled_notes(cfg) + crepa_notes(cfg) + schedule_notes(cfg) \
        + offload_notes(cfg)
    if "grad_clip_method" in cfg.model_fields_set and not cfg.max_grad_norm:  # SimpleTuner's presets set only it
        notes.append(f"grad_clip_method {cfg.grad_clip_method!r} not used: no gradient is clipped without "
                     "max_grad_norm, which this config does not set (difftune's default: none; SimpleTuner has one); "
                     "set max_grad_norm (1.0 is usual) to clip")
    # Any value the file sets, 1.0 included: the Kandinsky 5 guides say to copy config.json.example (auto shift on)
    # and set flow_schedule_shift 1.0, which would otherwise train at ~3.2 at 1024² without a word. 0 is
    # SimpleTuner's spelling of "no fixed shift" beside auto shift.
    if cfg.flow_schedule_auto_shift and cfg.flow_schedule_shift != 0 and \
            (cfg.flow_schedule_shift != 1 or "flow_schedule_shift" in cfg.model_fields_set):
        notes.append(f"flow_schedule_shift {cfg.flow_schedule_shift:g} not used: flow_schedule_auto_shift computes "
                     "the shift from each batch's resolution; remove flow_schedule_shift (or set "
                     "flow_schedule_auto_shift to false to use it)")
    if cfg.validation_disable:
        notes.append("validation_disable: nothing is sampled during training (validation_prompt, the prompt "
                     "libraries and the base-model samples are switched off); remove it to get samples")
    notes += _literal_home(cfg)
    if cfg.validation_prompts() and "validation_negative_prompt" in cfg.model_fields_set and \
            cfg.validation_negative_prompt and cfg.guidance() <= 1:
        notes.append(f"validation_negative_prompt not used: the pipelines apply it only with guidance above 1 "
                     f"(validation_guidance {cfg.guidance():g}); raise validation_guidance, or remove the negative "
                     "prompt")
    if cfg.logging_dir and "tensorboard" not in TRACKERS[cfg.report_to]:  # SimpleTuner's configure tool writes 'logs'
        notes.append(f"logging_dir {cfg.logging_dir!r} not used: it is TensorBoard's folder, and report_to "
                     f"{cfg.report_to!r} does not start TensorBoard; remove it, or set report_to 'tensorboard'")
    # SimpleTuner's web UI writes 'left' whatever the model: a note where there is no input image to stitch
    if cfg.validation_stitch_input_location and cfg.validation_prompts() and \
            not FAMILY_FACTS[cfg.model_family].takes_input_image(cfg.flavour()):
        notes.append(f"validation_stitch_input_location not used: flavour {cfg.flavour()!r} samples without an input "
                     "image; remove it (it applies to image-to-image and image-to-video flavours)")
    ema_keys = [k for k in ("ema_decay", "ema_update_interval", "ema_validation") if k in cfg.model_fields_set]
    if ema_keys and not cfg.use_ema:
        notes.append(f"{', '.join(ema_keys)} not used: use_ema is off, so no EMA is kept; set use_ema true, or "
                     f"remove {'them' if len(ema_keys) > 1 else 'it'}")
    if cfg.eval_dataset_id and not cfg.validation_using_datasets:
        notes.append(f"eval_dataset_id {cfg.eval_dataset_id!r} not used: it names the dataset whose image "
                     "validation_using_datasets takes as the input image, and that is off; set "
                     "validation_using_datasets true (image-to-image and image-to-video flavours), or remove it")
    idle = [i for i, r in enumerate(getattr(cfg.tread_config, "routes", None) or []) if r.selection_ratio == 0]
    if idle:
        notes.append(f"tread_config route{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} (counting from "
                     "0): selection_ratio 0 routes no token past the blocks, so training runs as without it; set a "
                     "share such as 0.5, or remove the route")
    return notes


def _literal_home(cfg: TrainConfig) -> list[str]:
    """difftune before `~` meant the home folder wrote `output_dir: ~/x` to a folder named `~` in the working folder:
    after an upgrade, `latest` would look in the home folder and start afresh without a word."""
    home, out = Path.home(), Path(cfg.output_dir)
    if not out.is_relative_to(home) or out == home:
        return []
    literal = Path("~") / out.relative_to(home)
    if not literal.is_dir() or literal.resolve() == out.resolve():
        return []
    return [f"output_dir {out}: an older difftune took its `~` literally and wrote to {literal.resolve()}; move "
            f"that folder to {out} to go on with its run (resume_from_checkpoint 'latest' looks in {out})"]


# keys that shape validation samples: set without a prompt they do nothing (the other validation keys are errors
# then: config/validation_triggers.py)
SAMPLE_KEYS = ("validation_step_interval", "validation_resolution", "validation_guidance", "validation_seed",
               "validation_negative_prompt", "validation_num_inference_steps", "validation_num_video_frames",
               "validation_stitch_input_location")


def unsampled_notes(cfg: TrainConfig) -> list[str]:
    """Validation keys the file sets while no prompt is set: the run samples nothing. A note, not an error: an
    empty validation_prompt is how a SimpleTuner config switches validation off and keeps its settings."""
    if cfg.validation_prompts() or cfg.validation_disable:  # validation_disable has its own note (cross_notes)
        return []
    # rollouts (scheduled_sampling_max_step_offset) take their step schedule from validation_num_inference_steps
    rollout = "validation_num_inference_steps" if getattr(cfg, "scheduled_sampling_max_step_offset", 0) else None
    unused = [k + (" (validation_steps)" if k == "validation_step_interval" else "") for k in SAMPLE_KEYS
              if k in cfg.model_fields_set and getattr(cfg, k) not in (None, 0, "") and k != rollout]
    if "disable_benchmark" in cfg.model_fields_set and not cfg.disable_benchmark:
        unused.append("disable_benchmark false")  # SimpleTuner's config.json.example writes it
    if not unused:
        return []
    return [f"{', '.join(unused)} not used: no validation prompt is set, so the run samples nothing; set "
            "validation_prompt (or user_prompt_library, or validation_prompt_library: true) for samples during "
            "training, or remove " + ("it" if len(unused) == 1 else "them")]
