"""Keys of the spec format (SimpleTuner's) that difftune does not implement yet.

A user's config written for the original trainer may carry these. Each is accepted only with a value
that changes nothing (its "off" value); any other value is a config error that says the feature is
not implemented yet, so that no option is ever silently ignored. When a feature lands, its key moves
from here into the schema.

Three kinds of entries:
- `PENDING_TRAIN_KEYS` / `PENDING_DATASET_KEYS`: key -> (off values, what to do instead).
- `DEPENDS_ON`: a setting of a pending feature that only acts when its switch is on
  (`crepa_self_flow_mask_ratio` without `crepa_self_flow`): any value is accepted while the
  switch is off, and refused with the switch's message when it is on. Whole families of keys can be
  matched by prefix (`PREFIX_DEPENDS_ON`).
- `PENDING_VALUES`: one value of a key difftune has (`quantize_via: pipeline`).

Values typed on the command line arrive as strings: `coerce` reads "0.0", "false" or "null" as the
number, boolean or null they spell before they are compared with the off values.
"""

from __future__ import annotations

from typing import Any

# key -> (values that mean "off", what to do instead)
PENDING_TRAIN_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "crepa_self_flow": (
        (False, None), "Self-Flow (crepa_self_flow, SimpleTuner's older switch of crepa_feature_source 'self_flow': "
        "an EMA teacher seeing cleaner tokens); CREPA here aligns with DINOv2 or with a deeper block "
        "(crepa_use_backbone_features): set crepa_self_flow to false",
    ),
}

PENDING_DATASET_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    # SimpleTuner's top-level keys of a type 'huggingface' entry that difftune does not take (the others are in
    # config/source_huggingface_keys.py)
    "filter_func": ((None,), "row filters of a type 'huggingface' dataset; filter the dataset first (datasets' "
                    "Dataset.filter, then to_parquet), or use minimum_image_size / max_num_samples"),
    "split_composite_images": ((False, None), "composite (grid) images; split the grids into images first"),
    "composite_image_column": (("image", None), "composite (grid) images; split the grids into images first"),
    "audio_column": (("audio", None), "audio datasets; remove audio_column"),
    "auto_load": ((False, None), "auto_load: a type 'huggingface' dataset is always read once before training, "
                  "to download it; remove auto_load"),
}

# A setting that only acts when its switch is on: any value while the switch is off.
DEPENDS_ON: dict[str, str] = {
    "crepa_self_flow_mask_ratio": "crepa_self_flow",
}
PREFIX_DEPENDS_ON: dict[str, str] = {}

# --- The rest of SimpleTuner's options (its OPTIONS page and field registry), audited one by one. Each is
# accepted at the values that change nothing here (SimpleTuner's default where difftune does just that, and
# null/false where that means off) and refused otherwise with what to do instead.


class StartsWith(str):
    """An off value that is any text starting with this one (a long default text, as SimpleTuner writes it)."""


# the start of SimpleTuner's default sana_complex_human_instruction, which its configure tool writes for every model
SANA_INSTRUCTION = "Given a user prompt, generate an"  # then 'Enhanced prompt' or "Enhanced prompt" (both seen)


def _elsewhere(what: str, models: str) -> str:
    return (f"{what}, which SimpleTuner applies to {models} only; Lumina2 and Kandinsky 5 have nothing for it "
            "to act on: remove it")


def _per_dataset(key: str, where: str = "") -> str:
    return (f"a config-level {key} for every dataset; set {where or key} on each entry of the dataset list "
            "(data_backend_config) instead")


_DDPM = "epsilon and v-prediction (DDPM) models"  # Lumina2 and Kandinsky 5 are flow-matching models
_REMOVE = "; remove it"
# SimpleTuner's knobs for its own data pipeline (worker counts, batch sizes of its caching, save intervals):
# results do not depend on them and difftune has none, so only SimpleTuner's default is accepted.
# (write_batch_size, max_workers and metadata_update_interval are fields, accepted at any value with a note:
# config/small_keys.py PIPELINE_KNOBS)
_PIPELINE_KNOBS = {"aspect_bucket_worker_count": 12, "image_processing_batch_size": 32, "read_batch_size": 25,
                   "torch_num_threads": 8, "enable_multiprocessing": False}

PENDING_TRAIN_KEYS |= {
    key: ((default, None), f"{key} (SimpleTuner's own data pipeline; difftune has no such setting){_REMOVE}")
    for key, default in _PIPELINE_KNOBS.items()
} | {
    # the other config-level dataset settings are defaults of every dataset (config/dataset_default_keys.py);
    # a cache folder shared by every dataset would mix their latents, and parquet columns need a parquet block
    key: ((None, ""), _per_dataset(key, where))
    for key, where in [("cache_dir_vae", ""), ("parquet_caption_column", "parquet.caption_column"),
                       ("parquet_filename_column", "parquet.filename_column")]
} | {
    # models difftune does not train
    "prediction_type": ((None, "flow_matching"), "another prediction type; Lumina2 and Kandinsky 5 are "
                        "flow-matching models: set prediction_type to 'flow_matching' or remove it"),
    "snr_gamma": ((None, 0), _elsewhere("min-SNR loss weighting", _DDPM)),
    "use_soft_min_snr": ((False,), _elsewhere("soft min-SNR weighting", _DDPM)),
    "rescale_betas_zero_snr": ((False,), _elsewhere("zero-terminal-SNR betas", _DDPM)),
    "timestep_bias_strategy": ((None, "none"), _elsewhere("timestep bias", _DDPM) + " (timestep_sampling, "
                               "flow_schedule_shift and flow_schedule_auto_shift shape the noise levels here)"),
    "training_scheduler_timestep_spacing": (("trailing", None), _elsewhere("DDPM timestep spacing", _DDPM)),
    "inference_scheduler_timestep_spacing": (("trailing", None), _elsewhere("DDPM timestep spacing", _DDPM)),
    "offset_noise": ((False,), _elsewhere("offset noise", _DDPM)),
    "diff2flow_enabled": ((False,), _elsewhere("the diffusion-to-flow bridge", _DDPM)),
    "pretrained_t5_model_name_or_path": ((None,), _elsewhere("a separate T5 text encoder", "PixArt, SD3 and Flux")),
    "t5_padding": (("unmodified", None), _elsewhere("T5 padding", "PixArt, SD3 and Flux")),
    "sd3_clip_uncond_behaviour": (("empty_string", None), _elsewhere("the unconditional prompt's encoding", "SD3")),
    "sd3_t5_uncond_behaviour": ((None,), _elsewhere("the unconditional prompt's encoding", "SD3")),
    "pretrained_unet_model_name_or_path": ((None,), _elsewhere("a separate UNet", "UNet models (SD, SDXL)")),
    "pretrained_unet_subfolder": (("unet", None), _elsewhere("the UNet's subfolder", "UNet models (SD, SDXL)")),
    "unet_attention_slice": ((False,), _elsewhere("UNet attention slicing", "UNet models (SD, SDXL)")),
    "flux_lora_target": (("all", None), _elsewhere("Flux's LoRA target presets", "Flux") + " (use "
                         "lora_target_modules to choose the modules)"),
    "flux_fast_schedule": ((False,), _elsewhere("the fast schedule", "Flux")),
    "flux_guidance_mode": (("constant", None), _elsewhere("guidance-embedding training", "Flux")),
    "flux_guidance_value": ((1.0, None), _elsewhere("guidance-embedding training", "Flux")),
    "flux_guidance_min": ((0.0, None), _elsewhere("guidance-embedding training", "Flux")),
    "flux_guidance_max": ((4.0, None), _elsewhere("guidance-embedding training", "Flux")),
    "flux_attention_masked_training": ((False,), _elsewhere("attention-masked training", "Flux")),
    "validation_guidance_real": ((1.0, None), _elsewhere("real CFG for guidance-distilled models", "Flux")),
    "hidream_use_load_balancing_loss": ((False,), _elsewhere("the mixture-of-experts balancing loss", "HiDream")),
    "ltx_train_mode": (("i2v", None), _elsewhere("LTX's training mode", "LTX-Video") + " (Kandinsky 5 Video "
                       "trains image-to-video with an i2v flavour)"),
    "ltx_i2v_prob": ((0.1, None), _elsewhere("LTX's image-to-video share", "LTX-Video")),
    "ltx_partial_noise_fraction": ((0.05, None), _elsewhere("LTX's partial noise", "LTX-Video")),
    "ltx_protect_first_frame": ((False,), _elsewhere("LTX's first-frame protection", "LTX-Video")),
    "refiner_training": ((False,), _elsewhere("refiner (mixture-of-experts) training", "SDXL")),
    "sdxl_refiner_uses_full_range": ((False,), _elsewhere("the refiner's timestep range", "SDXL")),
    "data_aesthetic_score": ((7.0, None), _elsewhere("the aesthetic-score conditioning", "the SDXL refiner")),
    "sana_complex_human_instruction": ((None, "", StartsWith(SANA_INSTRUCTION)),
                                       _elsewhere("the prompt-enhancing instruction", "Sana")),
    "text_encoder_3_precision": (("no_change", None), "a third text encoder; Lumina2 has one and Kandinsky 5 two"
                                 + _REMOVE),
    "text_encoder_4_precision": (("no_change", None), "a fourth text encoder; Lumina2 has one and Kandinsky 5 two"
                                 + _REMOVE),
    "controlnet": ((False,), "ControlNet training (diffusers has no ControlNet for Lumina2 or Kandinsky 5); set "
                   "controlnet to false"),
    "control": ((False,), "channel-wise control training; set control to false"),
    # model loading
    "pretrained_gemma_model_name_or_path": ((None,), "Lumina2's Gemma text encoder from another repository; the "
                                            "text encoder is loaded from the model's folder" + _REMOVE),
    "non_ema_revision": ((None,), "hub revisions" + _REMOVE),
    "quantization_config": ((None,), "Diffusers quantization configs (quantize_via 'pipeline'); use "
                            "base_model_precision"),
    "quantize_activations": ((False,), "quantized activations; base_model_precision quantizes weights only"
                             + _REMOVE),
    "fuse_qkv_projections": ((False,), "fused attention projections (attention_mechanism picks the kernel)"
                             + _REMOVE),
    "sla_config": ((None,), "SLA attention (attention_mechanism 'sla' is refused too)" + _REMOVE),
    "i_know_what_i_am_doing": ((False, None), "difftune has no safety limits to unlock" + _REMOVE),
    # LoRA
    "peft_lora_mode": (("standard", None), "SingLoRA; use peft_lora_mode 'standard' or lora_type 'lycoris'"),
    "slider_lora_target": ((False,), "slider LoRA targets; use lora_target_modules to choose the modules"),
    "init_lokr_norm": ((None,), "LoKr's perturbed-normal initialisation" + _REMOVE),
    # text encoders: their embeddings are cached, so they never train
    "train_text_encoder": ((False,), "training the text encoder; difftune trains the transformer and caches the "
                           "text embeddings: set train_text_encoder to false"),
    # noise levels, loss, learning rate
    # same result either way: torch frees gradients (zero_grad(set_to_none=True)); flow-matching noise levels are
    # never segmented (SimpleTuner segments DDPM timesteps only)
    "set_grads_to_none": ((False, True, None), "set_grads_to_none takes true or false"),
    "disable_segmented_timestep_sampling": ((False, True, None), "disable_segmented_timestep_sampling takes true or false"),
    # optimizer
    "fuse_optimizer": ((False,), "fused offloaded optimizers" + _REMOVE),
    "optimizer_release_gradients": ((False,), "releasing gradients inside the optimizer step" + _REMOVE),
    "gradient_precision": ((None, "unmodified"), "a forced gradient precision; each gradient keeps its "
                           "parameter's dtype" + _REMOVE),
    # EMA: difftune's CPU EMA is updated on the CPU (as with ema_cpu_only: true); the result is the same
    "ema_cpu_only": ((False, True, None), "ema_cpu_only takes true or false"),
    "ema_foreach_disable": ((False,), "EMA updates without torch._foreach kernels" + _REMOVE),
    # data
    "conditioning_multidataset_sampling": (("random", None), "several conditioning datasets per dataset; each "
                                           "dataset names one (conditioning_data)" + _REMOVE),
    "ignore_missing_files": ((False,), "keeping files that left the disk in the buckets" + _REMOVE),
    "delete_unwanted_images": ((False,), "deleting your images; difftune never deletes them and reports the "
                               "skipped ones in the data report" + _REMOVE),
    "delete_problematic_images": ((False,), "deleting your images; difftune never deletes them and reports the "
                                  "unreadable ones in the data report" + _REMOVE),
    "override_dataset_config": ((False,), "reusing caches made with other dataset settings; the caches are "
                                "fingerprinted and rebuilt when a setting changes" + _REMOVE),
    "cache_dir": ((None,), "a download folder for models; set HF_HOME (or HF_HUB_CACHE) in the environment"),
    "vae_cache_scan_behaviour": (("recreate", None), "'sync' (rewriting bucket metadata to match stale latents); "
                                 "a latent whose fingerprint changed is encoded again, as with 'recreate'"
                                 + _REMOVE),
    "vae_enable_temporal_roll": ((False,), "rolling the video VAE over time; use vae_enable_patch_conv to bound "
                                 "its memory"),
    "keep_vae_loaded": ((False,), "keeping the VAE on the accelerator while training; it waits in CPU memory "
                        "after caching" + _REMOVE),
    "cache_clear_validation_prompts": ((False,), "re-encoding the validation prompts; the text cache encodes a "
                                       "prompt again when its text or the encoder changes" + _REMOVE),
    # memory and processes
    "accelerator_cache_clear_interval": ((None, 0), "emptying the accelerator's memory cache every N steps"
                                         + _REMOVE),
    "offload_during_save": ((False,), "offloading while saving; checkpoints never hold the base model" + _REMOVE),
    "delete_model_after_load": ((False,), "deleting the model from the hub cache" + _REMOVE),
    "musubi_block_swap_device": (("cpu", None), "streaming blocks from another device than CPU memory"
                                 + _REMOVE),
    "ramtorch": ((False,), "RamTorch's CPU-streamed layers; use enable_group_offload or musubi_blocks_to_swap"),
    "group_offload_text_encoder": ((False,), "streaming the text encoders; offload_during_startup keeps the "
                                   "transformer off the accelerator while they encode" + _REMOVE),
    "group_offload_vae": ((False,), "streaming the VAE; use vae_enable_tiling or vae_enable_patch_conv"),
    "num_processes": ((1, None), "launch with `accelerate launch --num_processes N`; remove num_processes"),
    "num_machines": ((1, None), "multi-machine runs: give the machine settings to accelerate launch (accelerate "
                     "config)"),
    "accelerate_config": ((None,), "pass it to accelerate launch (--config_file)"),
    "accelerate_extra_args": ((None,), "pass them to accelerate launch"),
    "local_rank": ((-1, None), "the launcher sets each process's rank" + _REMOVE),
    "deepspeed_config": ((None,), "DeepSpeed; use fsdp_enable to shard the model between processes"),
    "offload_param_path": ((None,), "DeepSpeed's parameter offload; use fsdp_enable" + _REMOVE),
    "context_parallel_size": ((1, None), "context parallelism" + _REMOVE),
    "fsdp_auto_wrap_policy": (("TRANSFORMER_BASED_WRAP", None), "other FSDP wrap policies; each transformer block "
                              "is one shard unit (TRANSFORMER_BASED_WRAP)" + _REMOVE),
    "fsdp_limit_all_gathers": ((True, None), "FSDP1's all-gather limit (FSDP2 has none)" + _REMOVE),
    "fsdp_cpu_offload": ((False,), "FSDP's CPU offload" + _REMOVE),
    "fsdp_activation_checkpointing": ((False,), "use gradient_checkpointing"),
    "seed_for_each_device": ((True, None), "the same seed on every process; noise is drawn for the global batch "
                             "from one seed and split between the processes" + _REMOVE),
    # validation and evaluation
    # validation samples on process 0 (SimpleTuner's 'single-gpu'); the samples are the same either way
    "validation_multigpu": (("batch-parallel", "single-gpu", None), "validation_multigpu takes 'batch-parallel' or 'single-gpu'"),
    "validation_torch_compile": ((False,), "compiling the validation pipeline; compile: true compiles the "
                                 "transformer for training and validation alike"),
    "validation_guidance_skip_layers": ((None,), "skip-layer guidance" + _REMOVE),
    "validation_noise_scheduler": ((None,), "another validation scheduler; samples use the pipeline's own "
                                   "flow-matching scheduler" + _REMOVE),
    "validation_method": (("simpletuner-local", None), "external validation scripts" + _REMOVE),
    "validation_adapter_path": ((None,), "validating with an extra LoRA loaded" + _REMOVE),
    "validation_adapter_config": ((None,), "validating with extra LoRAs loaded" + _REMOVE),
    "validation_preview": ((False,), "streaming previews of validation samples" + _REMOVE),
    # checkpoints, trackers, publishing
    # checkpoints are always written into a temporary folder and renamed into place
    "checkpointing_use_tempdir": ((False, True, None), "checkpointing_use_tempdir takes true or false"),
    "tracker_image_layout": (("gallery", None), "the 'table' layout of validation images" + _REMOVE),
    "custom_tracker": ((None,), "custom tracker modules; use report_to 'wandb' or 'tensorboard'"),
    "publishing_config": ((None,), "publishing to other stores than the Hugging Face hub" + _REMOVE),
    # uploads always run in the background (the run waits for the last one); the result is the same
    "push_to_hub_background": ((False, True, None), "push_to_hub_background takes true or false"),
    "enable_watermark": ((False,), "watermarked validation images" + _REMOVE),
    "debug_aspect_buckets": ((False,), "SimpleTuner's debug printing; the data report lists the buckets"
                             + _REMOVE),
    "debug_dataset_loader": ((False,), "SimpleTuner's debug printing; the data report lists the datasets"
                             + _REMOVE),
    "print_filenames": ((False,), "SimpleTuner's debug printing; the data report names the unreadable files"
                        + _REMOVE),
    "print_sampler_statistics": ((False,), "SimpleTuner's debug printing" + _REMOVE),
    "distillation_method": ((None,), "distillation (LCM, DCM, ...)" + _REMOVE),
}

PENDING_DATASET_KEYS |= {
    "scan_for_errors": ((False,), "scanning the latent cache for errors; each cached latent's fingerprint is "
                        "checked on every start" + _REMOVE),
}  # a dataset entry's preserve_data_backend_cache and skip_file_discovery: config/dataset_entry_keys.prepare

# --- The other dataset-entry keys of SimpleTuner's DATALOADER.md (the dataset_audit, tests/test_dataset_key_audit.py):
# each is accepted at its "off" value and refused otherwise, as above.
_NOT_HERE = "; Lumina2 and Kandinsky 5 have nothing for it to act on: remove it"
_CLIP_EMBEDS = ("image-encoder (CLIP vision) embeddings of the input images, which SimpleTuner caches for models "
                "that ask for them (Wan 2.2 I2V); none are cached for Lumina2 or Kandinsky 5" + _REMOVE)
_WEBSHART = "WebDataset shards (type 'webshart'); unpack the shards into a folder and use type 'local'"
_MEMORY = "memory (tmpfs) caches (type 'memory'); the caches are folders on disk" + _REMOVE
PENDING_DATASET_KEYS |= {
    # SimpleTuner always hashes cache file names too: it ignores hash_filenames (except for type 'csv' downloads)
    "hash_filenames": ((True, None), "cache files named after the images; cache entries are always named by a hash "
                       "of their inputs (as in SimpleTuner, which ignores hash_filenames): set it to true or remove it"),
    "cache_file_suffix": ((None,), "naming SimpleTuner's bucket-metadata file; the image sizes are kept in "
                          "metadata.json beside the dataset's latents (cache_dir_vae)" + _REMOVE),
    "text_cache_ondemand": ((False, None), "encoding captions during training; every caption is encoded before "
                            "training starts" + _REMOVE),
    "text_cache_disable": ((False, None), "encoding captions during training without caching them; every caption "
                           "is encoded and cached before training starts" + _REMOVE),
    "timestep_sampling_offset": ((0, None), "a per-dataset shift of the noise levels drawn for its batches; "
                                 "logit_mean shifts them for every dataset" + _REMOVE),
    "disable_validation": ((False, None), "excluding a dataset from validation; validation input images come from "
                           "eval_dataset_id (validation_using_datasets) or the first training pair or clip"
                           + _REMOVE),
    "slider_strength": ((None, 0), "slider LoRA training (opposite concepts in turn)" + _REMOVE),
    "grounding": ((None,), "spatial grounding (bounding boxes of the entities in each image)" + _REMOVE),
    "conditioning": ((None, []), "generated conditioning images are made from an image dataset's images: write "
                     "the generator list on that image dataset's entry"),
    "conditioning_config": ((None,), "SimpleTuner's record of a generated dataset's generator (it writes it "
                            "itself); write the generator in the image dataset's conditioning list instead, such as "
                            "\"conditioning\": [{\"type\": \"canny\"}]"),
    "image_embeds": ((None,), "a separate entry storing the latents (dataset_type 'image_embeds'); each dataset's "
                     "latents go to its cache_dir_vae: remove it and set cache_dir_vae"),
    "conditioning_image_embeds": ((None,), _CLIP_EMBEDS),
    "cache_dir_conditioning_image_embeds": ((None,), _CLIP_EMBEDS),
    "conditioning_image_embed_batch_size": ((None,), _CLIP_EMBEDS),
    "audio": ((None,), "audio training (sound-to-video, audio generation), which SimpleTuner applies to audio "
              "models (ACE-Step, LTX-2, Wan S2V)" + _NOT_HERE),
    "delete_unwanted_images": ((False, None), "deleting your images; difftune never deletes them and reports the "
                               "skipped ones in the data report" + _REMOVE),
    "delete_problematic_images": ((False, None), "deleting your images; difftune never deletes them and reports "
                                  "the unreadable ones in the data report" + _REMOVE),
    "delete_nsfw_images": ((False, None), "deleting your images (difftune has no NSFW check and never deletes "
                           "images)" + _REMOVE),
    "disable_vae_cache": ((None,), "disable_vae_cache, SimpleTuner's removed spelling (it refuses it too); use "
                          "vae_cache_disable"),
    "memory_filesystem_path": ((None,), _MEMORY), "memory_filesystem_size": ((None,), _MEMORY),
    "memory_filesystem_sudo": ((False, None), _MEMORY),
} | {key: ((None,), _WEBSHART) for key in ("webshart", "source", "metadata", "hf_token", "subfolder",
                                            "shard_cache_gb", "parallel_downloads", "buffer_size", "max_file_size")}

# SimpleTuner's config-level default of its conditioning_image_embed_batch_size entries (else vae_batch_size)
PENDING_TRAIN_KEYS["conditioning_image_embed_batch_size"] = ((None,), _CLIP_EMBEDS)

# A SimpleTuner setting of a pending switch above: any value while the switch is off.
DEPENDS_ON |= {key: switch for switch, keys in {
    "peft_lora_mode": ["singlora_ramp_up_steps"],
    "train_text_encoder": ["text_encoder_lr", "freeze_encoder", "freeze_encoder_before", "freeze_encoder_after",
                           "freeze_encoder_strategy", "layer_freeze_strategy", "save_text_encoder",
                           "text_encoder_limit", "fully_unload_text_encoder"],
    "use_soft_min_snr": ["soft_min_snr_sigma_data"],
    "snr_gamma": ["snr_weight"],
    "timestep_bias_strategy": ["timestep_bias_begin", "timestep_bias_end", "timestep_bias_multiplier",
                               "timestep_bias_portion"],
    "offset_noise": ["noise_offset", "noise_offset_probability"],
    "diff2flow_enabled": ["diff2flow_loss"],
    "validation_guidance_real": ["validation_no_cfg_until_timestep"],
    "hidream_use_load_balancing_loss": ["hidream_load_balancing_loss_weight"],
    "refiner_training": ["refiner_training_invert_schedule", "refiner_training_strength"],
    "controlnet": ["controlnet_custom_config", "controlnet_model_name_or_path"],
    "ramtorch": ["ramtorch_target_modules", "ramtorch_text_encoder", "ramtorch_vae", "ramtorch_controlnet",
                 "ramtorch_transformer_percent", "ramtorch_text_encoder_percent", "ramtorch_disable_sync_hooks",
                 "ramtorch_disable_extensions"],
    "num_machines": ["main_process_ip", "main_process_port", "machine_rank", "same_network"],
    "context_parallel_size": ["context_parallel_comm_strategy"],
    "validation_torch_compile": ["validation_torch_compile_mode"],
    "validation_guidance_skip_layers": ["validation_guidance_skip_layers_start",
                                        "validation_guidance_skip_layers_stop", "validation_guidance_skip_scale"],
    "validation_method": ["validation_external_script", "validation_external_background"],
    "validation_adapter_path": ["validation_adapter_name", "validation_adapter_strength", "validation_adapter_mode"],
    "validation_preview": ["validation_preview_steps"],
    "distillation_method": ["distillation_config"],
}.items() for key in keys}

# Found in configs saved by SimpleTuner's configure tool, which writes every default of its field registry whatever the
# model (an audit of its registry: Wan, ACE-Step and UNet fields, and its newer loss fields). At those defaults they
# change nothing.
PENDING_TRAIN_KEYS |= {
    "wan_force_2_1_time_embedding": ((False, None), _elsewhere("Wan 2.1's time embedding", "Wan")),
    "enable_chunked_feed_forward": ((False, None), _elsewhere("chunked feed-forward layers", "Wan")),
    "lyrics_embedder_train": ((False, None), _elsewhere("training the lyrics embedder", "ACE-Step (audio)")),
    "validation_lyrics": ((None, ""), _elsewhere("lyrics of validation audio", "ACE-Step (audio)")),
    "validation_audio_duration": ((30.0, None), _elsewhere("the length of validation audio", "ACE-Step (audio)")),
    "audio_channels": ((1, None), _elsewhere("audio datasets' channels", "audio models (ACE-Step)")),
    "audio_duration_interval": ((3.0, None), _elsewhere("audio datasets' length buckets", "audio models (ACE-Step)")),
    "audio_truncation_mode": (("beginning", None), _elsewhere("audio datasets' truncation", "audio models (ACE-Step)")),
    "audio_max_duration_seconds": ((None,), _elsewhere("audio datasets' length limits", "audio models (ACE-Step)")),
    "audio_min_duration_seconds": ((None,), _elsewhere("audio datasets' length limits", "audio models (ACE-Step)")),
    "urepa_enabled": ((False, None), _elsewhere("U-REPA (representation alignment of a UNet)", "UNet models (SD, "
                                                "SDXL, Kolors)") + " (difftune's alignment loss is CREPA: crepa_enabled)"),
    "fused_qkv_projections": ((False, None), "fused attention projections (attention_mechanism picks the kernel; "
                              "fused_qkv_projections is SimpleTuner's field name of fuse_qkv_projections)" + _REMOVE),
    "twinflow_enabled": ((False, None), "TwinFlow (few-step generation trained with self-adversarial flows); set "
                         "twinflow_enabled to false"),
    "crepa_use_tae": ((False, None), "decoding CREPA's frames with a tiny autoencoder (TAE); CREPA decodes with the "
                      "model's own VAE" + _REMOVE),
    "crepa_normalize_neighbour_sum": ((False, None), "normalising CREPA's sum over neighbouring frames; CREPA "
                                      "weighs each neighbour as crepa_normalize_by_frames says" + _REMOVE),
    "crepa_encoder_frames_batch_size": ((-1, None), "encoding CREPA's frames in batches of N; the encoder takes "
                                        "every frame of a batch at once (-1)" + _REMOVE),
}
DEPENDS_ON |= {"feed_forward_chunk_size": "enable_chunked_feed_forward", "lyrics_embedder_lr": "lyrics_embedder_train",
               "lyrics_embedder_optimizer": "lyrics_embedder_train",
               "lyrics_embedder_lr_scheduler": "lyrics_embedder_train"}
PREFIX_DEPENDS_ON |= {"urepa_": "urepa_enabled", "twinflow_": "twinflow_enabled"}


# (key, value) -> message, for keys difftune has, whose other values work
PENDING_VALUES: dict[tuple[str, str], str] = {
    ("base_model_precision", "int4-torchao"): (
        "not implemented yet: base_model_precision 'int4-torchao'. An adapter trains through the frozen base, "
        "and torch has no backward for torchao's int4 matrix product (measured on an H100, torch 2.11, torchao "
        "0.18, tile_packed_to_4d: 'derivative for aten::_weight_int4pack_mm is not implemented'; on the CPU "
        "torchao has no int4 layout at all); use 'int4-quanto' or 'nf4-bnb' for 4 bits"),
    ("quantize_via", "pipeline"): (
        "not implemented yet: quantize_via 'pipeline' (quantizing while the pipeline loads); use 'cpu' or "
        "'accelerator'"),
}


# Values of dataset-entry keys from SimpleTuner's DATALOADER.md (the dataset_audit)
PENDING_VALUES |= {
    ("dataset_type", "audio"): "not implemented yet: audio datasets (dataset_type 'audio'), which SimpleTuner "
                               "trains audio models on" + _NOT_HERE,
    ("dataset_type", "image_embeds"): "not implemented yet: a separate entry storing the latents (dataset_type "
                                      "'image_embeds'); each dataset's latents go to its cache_dir_vae: remove this "
                                      "entry (and the image_embeds key naming it) and set cache_dir_vae",
    ("dataset_type", "conditioning_image_embeds"): "not implemented yet: " + _CLIP_EMBEDS.replace(
        "remove it", "remove this entry (and the conditioning_image_embeds key naming it)"),
    ("type", "webshart"): "not implemented yet: " + _WEBSHART,
    ("type", "memory"): "not implemented yet: " + _MEMORY.replace("remove it", "use type 'local'"),
    ("conditioning_type", "controlnet"): "not implemented yet: ControlNet conditioning (diffusers has no ControlNet "
                                         "for Lumina2 or Kandinsky 5); use 'reference_strict' (input images of an "
                                         "image-to-image flavour) or 'mask' (loss masks)",
    ("conditioning_type", "reference_loose"): "not implemented yet: loosely aligned reference images; input images "
                                              "pair pixel for pixel with their training image ('reference_strict')",
    ("crop_style", "face"): "not implemented yet: crops centred on a detected face; use 'center', 'random' or "
                            "'corner'",
}

# The text encoders take the precisions of base_model_precision: the same ones are not implemented yet. A text
# encoder runs forward only, so int4-torchao's reason is another.
PENDING_VALUES |= {
    (key, value): message.replace("base_model_precision", key)
    for (base, value), message in list(PENDING_VALUES.items()) if base == "base_model_precision" and value != "int4-torchao"
    for key in ("text_encoder_1_precision", "text_encoder_2_precision")
}
PENDING_VALUES |= {
    (key, "int4-torchao"): (f"not implemented yet: {key} 'int4-torchao': torchao's int4 weights have a CUDA layout "
                            "only (none on the CPU, where difftune's tests run), so this path is untested; use "
                            "'int4-quanto' or 'nf4-bnb' for 4 bits")
    for key in ("text_encoder_1_precision", "text_encoder_2_precision")
}

# SimpleTuner's optimizer names (its optimizer_param.py) that difftune has not (train/optimizer_catalog.py has the rest)
PENDING_VALUES |= {
    ("optimizer", "torch-sparseadam"): "not implemented yet: optimizer 'torch-sparseadam' (SimpleTuner's): torch's "
                                       "SparseAdam takes sparse gradients only (embeddings built with sparse=True), "
                                       "and every weight trained here gets dense ones; use 'torch-adam' (the same "
                                       "update on dense gradients) or 'adamw'",
    **{("optimizer", name): f"not implemented yet: optimizer {name!r} (SimpleTuner's {what}); the closest here is "
                            f"{closest}" for name, (what, closest) in {
        "adamw_schedulefree+aggressive": ("schedule-free AdamW with Kahan summation and its own settings",
                                          "'adamw_schedulefree' with adam_weight_decay 1e-3 and adam_epsilon 1e-6, "
                                          "without Kahan summation"),
        "adamw_schedulefree+no_kahan": ("schedule-free AdamW without Kahan summation and its own settings",
                                        "'adamw_schedulefree' with adam_weight_decay 1e-3 and adam_epsilon 1e-6"),
    }.items()},
}
PENDING_VALUES |= {
    ("mixed_precision", "fp8"): "not implemented yet: mixed_precision 'fp8' (fp8 matrix products in training); use "
                                "'bf16', with base_model_precision 'fp8-torchao' or 'fp8-quanto' to keep the frozen "
                                "weights in 8 bits",
}


def coerce(value: Any) -> Any:
    """A string as typed on the command line -> the bool, null or number it spells; anything else unchanged."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text in ("true", "false"):
        return text == "true"
    if text in ("null", "none", ""):
        return None if text != "" else ""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return value


def _is_off(neutral: tuple[Any, ...], value: Any) -> bool:
    if isinstance(value, str) and not value.strip() and None in neutral:  # "" is "not set" (the README's rule)
        return True
    if isinstance(value, str) and any(isinstance(n, StartsWith) and value.lstrip().startswith(n) for n in neutral):
        return True
    for candidate in (value, coerce(value)):
        if any(type(candidate) is type(n) and candidate == n for n in neutral):
            return True
        if isinstance(candidate, int | float) and not isinstance(candidate, bool):
            if any(type(n) in (int, float) and candidate == n for n in neutral):
                return True
        # null on a switch: not set (SimpleTuner skips null keys), so off
        if candidate is None and (None in neutral or any(n is False for n in neutral)):
            return True
    return False


def switch_of(key: str) -> str | None:
    """The switch a setting depends on (None: it stands alone)."""
    if key in DEPENDS_ON:
        return DEPENDS_ON[key]
    if key in PENDING_TRAIN_KEYS:  # a key with its own off values
        return None
    return next((s for p, s in PREFIX_DEPENDS_ON.items() if key.startswith(p)), None)


def is_pending(table: dict[str, tuple[tuple[Any, ...], str]], key: str) -> bool:
    return key in table or (table is PENDING_TRAIN_KEYS and switch_of(key) is not None)


def pending_problem(
    table: dict[str, tuple[tuple[Any, ...], str]], key: str, value: Any, raw: dict[str, Any] | None = None
) -> str | None:
    """The 'not implemented yet' message for `key=value`, or None when the value changes nothing.
    `raw`: the whole config, to see whether the switch of a dependent setting is on."""
    switch = switch_of(key) if table is PENDING_TRAIN_KEYS else None
    if switch is not None:
        raw = raw or {}
        if switch not in raw or pending_problem(table, switch, raw[switch]) is None:
            return None  # the feature is off: its settings change nothing
        if key not in table:
            return f"not implemented yet: {table[switch][1]}"
    if key not in table:
        return None
    neutral, message = table[key]
    if _is_off(neutral, value):
        return None
    return f"not implemented yet: {message}"
