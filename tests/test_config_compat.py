"""SimpleTuner configs as users bring them: spellings, aliases, placeholders, pending keys, typed values."""

import json
import math

import pytest

from conftest import config_problems as problems
from conftest import write_config
from difftune.cli import parse_overrides
from difftune.config import ConfigError, load_config
from difftune.config.compat import suggest
from difftune.config.schema import TrainConfig


@pytest.mark.parametrize("given,family", [("kandinsky5_image", "kandinsky5-image"),
                                          ("kandinsky5_video", "kandinsky5-video"), ("lumina2", "lumina2")])
def test_family_spellings(given, family):
    assert TrainConfig(model_family=given, max_train_steps=1).model_family == family


def test_key_aliases(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, validation_steps=7, checkpointing_steps="9")).train
    assert cfg.validation_step_interval == 7 and cfg.checkpoint_step_interval == 9
    same = load_config(write_config(tmp_path, dataset, validation_steps=7, validation_step_interval="7")).train
    assert same.validation_step_interval == 7
    text = problems(write_config(tmp_path, dataset, checkpointing_steps=5, checkpoint_step_interval=10))
    assert "checkpointing_steps" in text and "checkpoint_step_interval" in text and "keep one" in text
    # null under either name is "not set" (configs mixing both spellings null one of them)
    mixed = load_config(write_config(tmp_path, dataset, checkpointing_steps=2, checkpoint_step_interval=None)).train
    assert mixed.checkpoint_step_interval == 2
    # On the command line an alias overrides the file's own spelling.
    path = write_config(tmp_path, dataset, validation_step_interval=50)
    assert load_config(path, {"validation_steps": "5"}).train.validation_step_interval == 5


@pytest.mark.parametrize("name,canonical", [("torch-adamw", "adamw"), ("bnb-adamw8bit", "adamw8bit"),
                                            ("optimi-lion", "optimi-lion"), ("optimi-adamw", "optimi-adamw")])
def test_optimizer_names(tmp_path, dataset, name, canonical):
    assert load_config(write_config(tmp_path, dataset, optimizer=name)).train.optimizer == canonical


def test_model_family_placeholder(tmp_path, dataset):
    path = write_config(tmp_path, dataset, output_dir=str(tmp_path / "out" / "{model_family}"),
                        model_family="kandinsky5_image",
                        dataset={"cache_dir_vae": str(tmp_path / "cache" / "{model_family}" / "vae")})
    backend = tmp_path / "config" / "multidatabackend.json"
    entries = json.loads(backend.read_text())
    entries[1]["cache_dir"] = str(tmp_path / "cache" / "{model_family}" / "text")
    backend.write_text(json.dumps(entries))
    run = load_config(path)
    assert run.train.output_dir == str(tmp_path / "out" / "kandinsky5-image")
    assert run.datasets.images[0].cache_dir_vae == str(tmp_path / "cache" / "kandinsky5-image" / "vae")
    assert run.datasets.text_embeds.cache_dir == str(tmp_path / "cache" / "kandinsky5-image" / "text")
    text = problems(write_config(tmp_path, dataset, output_dir=str(tmp_path / "{model_type}")))
    assert "output_dir" in text and "{model_type}" in text


def test_config_level_dataset_defaults(tmp_path, dataset):
    path = write_config(tmp_path, dataset, resolution=128, resolution_type="pixel", minimum_image_size=32)
    entries = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    del entries[0]["resolution"], entries[0]["resolution_type"]
    (tmp_path / "config" / "multidatabackend.json").write_text(json.dumps(entries))
    ds = load_config(path).datasets.images[0]
    assert (ds.resolution, ds.resolution_type, ds.minimum_image_size) == (128, "pixel", 32)
    own = write_config(tmp_path, dataset, resolution=128, dataset={"resolution": 48, "minimum_image_size": 16})
    ds = load_config(own).datasets.images[0]
    assert (ds.resolution, ds.minimum_image_size) == (48, 16)  # the dataset's own value wins


def test_config_level_crop_and_caption_defaults(tmp_path, dataset):
    """SimpleTuner's config-level crop_*, caption and size keys reach every dataset lacking its own."""
    path = write_config(tmp_path, dataset, crop=True, crop_style="random", crop_aspect="closest",
                        crop_aspect_buckets=[0.75, 1.0], caption_strategy="instanceprompt",
                        instance_prompt="a photo of sks", maximum_image_size=2048, target_downsample_size=1024)
    entries = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    del entries[0]["caption_strategy"]
    (tmp_path / "config" / "multidatabackend.json").write_text(json.dumps(entries))
    ds = load_config(path).datasets.images[0]
    assert (ds.crop, ds.crop_style, ds.crop_aspect, ds.crop_aspect_buckets) == (True, "random", "closest", [0.75, 1.0])
    assert (ds.caption_strategy, ds.instance_prompt) == ("instanceprompt", "a photo of sks")
    assert (ds.maximum_image_size, ds.target_downsample_size) == (2048, 1024)
    own = write_config(tmp_path, dataset, crop=True, crop_style="random", prepend_instance_prompt=True,
                       instance_prompt="sks", dataset={"crop": False, "crop_style": "corner"})
    ds = load_config(own).datasets.images[0]
    assert (ds.crop, ds.crop_style, ds.prepend_instance_prompt) == (False, "corner", True)
    # a default that makes a dataset invalid is reported there, naming the key
    text = problems(write_config(tmp_path, dataset, crop=True, crop_aspect="closest"))
    assert "crop_aspect_buckets" in text
    text = problems(write_config(tmp_path, dataset, crop_style="diagonal"))
    assert "crop_style" in text


def test_vae_and_runtime_keys(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, vae_enable_tiling=True, vae_enable_slicing="true",
                                   grad_clip_method="value", cudnn_benchmark=True)).train
    assert cfg.vae_enable_tiling and cfg.vae_enable_slicing and cfg.grad_clip_method == "value"
    assert cfg.cudnn_benchmark is True and cfg.disable_benchmark is True  # base-model samples: their own key
    assert "grad_clip_method" in problems(write_config(tmp_path, dataset, grad_clip_method="percentile"))
    assert load_config(write_config(tmp_path, dataset, compress_disk_cache="true")).train.compress_disk_cache


def test_apply_torch_options():
    import torch
    from diffusers import AutoencoderKL

    from difftune.train.torch_options import apply_torch_options

    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4, sample_size=32)
    cfg = TrainConfig(model_family="lumina2", max_train_steps=1, vae_enable_tiling=True, vae_enable_slicing=True,
                      cudnn_benchmark=True)
    before = torch.backends.cudnn.benchmark
    try:
        assert apply_torch_options(cfg, vae) == ["cuDNN benchmark", "vae_enable_tiling", "vae_enable_slicing"]
        assert vae.use_tiling and vae.use_slicing and torch.backends.cudnn.benchmark
        plain = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4, sample_size=32)
        assert apply_torch_options(TrainConfig(model_family="lumina2", max_train_steps=1), plain) == []
        assert not plain.use_tiling and not plain.use_slicing and not torch.backends.cudnn.benchmark
        with pytest.raises(ValueError, match="vae_enable_tiling"):
            apply_torch_options(cfg, object())
    finally:
        torch.backends.cudnn.benchmark = before


@pytest.mark.parametrize("key,value", [
    ("peft_lora_mode", "singlora"),
])
def test_simpletuner_keys_are_pending_not_unknown(tmp_path, dataset, key, value):
    text = problems(write_config(tmp_path, dataset, **{key: value}))
    assert "not implemented yet" in text and "unknown key" not in text


def test_settings_of_a_switched_off_feature_are_accepted(tmp_path, dataset):
    load_config(write_config(
        tmp_path, dataset, hub_model_id="me/lora", push_to_hub=False, crepa_drop_vae_encoder=True,
        crepa_block_index=8, scheduled_sampling_sampler="unipc", scheduled_sampling_probability=1.0,
        fsdp_version=2, group_offload_type="block_level", enable_group_offload=False, num_eval_images=4,
        eval_steps_interval=50, quantize_via="cpu"))
    load_config(write_config(tmp_path, dataset, hub_model_id="lumina2-lora"))  # no push_to_hub at all
    load_config(write_config(tmp_path, dataset, scheduled_sampling_reflexflow_alpha=0.5, scheduled_sampling_order=3,
                             scheduled_sampling_strategy="biased_late", scheduled_sampling_ramp_shape="cosine"))


def test_hub_datasets_need_a_name(tmp_path, dataset):  # the type itself: tests/test_source_huggingface.py
    text = problems(write_config(tmp_path, dataset, dataset={"type": "huggingface"}))
    assert "needs dataset_name" in text and "not implemented yet" not in text


def test_values_typed_on_the_command_line(tmp_path, dataset):
    path = write_config(tmp_path, dataset)
    overrides = parse_overrides(["--validation_guidance_rescale", "0.0", "--eval_steps_interval", "0",
                                 "--push_to_hub", "false", "--learning_rate=2e-4", "--use_ema",
                                 "--max_grad_norm", "1", "--evaluation_type", "none"])
    cfg = load_config(path, overrides).train
    assert cfg.learning_rate == 2e-4 and cfg.use_ema is True and cfg.max_grad_norm == 1.0
    assert "Lumina2Pipeline" in problems(path, **parse_overrides(["--validation_guidance_rescale", "0.7"]))
    assert "needs hub_model_id" in problems(path, **parse_overrides(["--push_to_hub", "true"]))
    with pytest.raises(ConfigError, match="twice"):
        parse_overrides(["--seed", "1", "--seed", "2"])


def test_shift_zero_with_auto_shift(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, flow_schedule_shift=0.0, flow_schedule_auto_shift=True)).train
    assert cfg.flow_schedule_auto_shift and cfg.flow_schedule_shift == 0.0
    assert "flow_schedule_shift" in problems(write_config(tmp_path, dataset, flow_schedule_shift=0.0))
    assert "flow_schedule_shift" in problems(write_config(tmp_path, dataset, flow_schedule_shift=-1.0,
                                                          flow_schedule_auto_shift=True))


def test_family_default_validation_resolution():
    video = TrainConfig(model_family="kandinsky5-video", max_train_steps=1)
    assert video.validation_resolution is None and video.validation_sizes() == [(512, 768)]
    assert TrainConfig(model_family="kandinsky5-image", max_train_steps=1).validation_sizes() == [(1024, 1024)]
    assert TrainConfig(model_family="kandinsky5-video", max_train_steps=1,
                       validation_resolution="480x854").validation_sizes() == [(480, 848)]


@pytest.mark.parametrize("typo,meant", [("learning_rat", "learning_rate"), ("lora_rnk", "lora_rank"),
                                        ("train_batchsize", "train_batch_size"),
                                        ("validaton_prompt", "validation_prompt"),
                                        ("resolution_typ", "resolution_type")])
def test_did_you_mean_finds_misspellings(typo, meant):
    assert suggest(typo, list(TrainConfig.model_fields) + ["resolution_type"]) == f"; did you mean {meant!r}?"


def test_did_you_mean_finds_a_key_without_its_first_word():
    from difftune.config.datasets import VideoOptions

    assert suggest("frames", list(VideoOptions.model_fields)) == "; did you mean 'num_frames'?"  # video.frames
    assert "did you mean" not in suggest("type", list(TrainConfig.model_fields))  # loss_type? lora_type? not said


@pytest.mark.parametrize("key", ["gradient_checkpointing_steps", "validation_seeds_list", "num_eval_batches",
                                 "vae_cache_mode", "init_lokr_norm", "snr_gamma", "data_loader_workers"])
def test_did_you_mean_does_not_suggest_unrelated_keys(key):
    assert "did you mean" not in suggest(key, list(TrainConfig.model_fields))


def test_clip_gradients_by_norm_and_value():
    import torch
    from accelerate import Accelerator

    from difftune.train.optimizers import clip_gradients

    accelerator = Accelerator(cpu=True)

    def params():
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.tensor([3.0, -4.0, 0.5])
        return [p]

    by_norm = params()
    norm = clip_gradients(accelerator, by_norm, 1.0, "norm")
    assert math.isclose(float(norm), math.sqrt(25.25), rel_tol=1e-5)
    assert math.isclose(float(by_norm[0].grad.norm()), 1.0, rel_tol=1e-4)
    by_value = params()
    norm = clip_gradients(accelerator, by_value, 1.0, "value")
    assert math.isclose(float(norm), math.sqrt(25.25), rel_tol=1e-5)  # measured before clipping
    assert by_value[0].grad.tolist() == [1.0, -1.0, 0.5]
    untouched = params()
    clip_gradients(accelerator, untouched, None, "value")
    assert untouched[0].grad.tolist() == [3.0, -4.0, 0.5]


def test_train_sh_runs_difftune_train_with_config_and_passes_arguments(tmp_path, dataset):
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "train.sh"
    write_config(tmp_path, dataset, lora_rank="many")  # a bad value: exits 2 before any model loads
    env = {k: v for k, v in os.environ.items() if k not in ("ENV", "CONFIG_PATH")}
    done = subprocess.run([str(script), "--lora_rnk", "4"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "config/config.json: lora_rank" in done.stderr  # config/config.json of the current folder
    assert "command line: unknown key 'lora_rnk'" in done.stderr  # extra arguments passed through
    (tmp_path / "config" / "other").mkdir()
    (tmp_path / "config" / "other" / "config.json").write_text("")
    done = subprocess.run([str(script)], cwd=tmp_path, env={**env, "ENV": "other"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "config/other/config.json" in done.stderr and "empty" in done.stderr


# --- SimpleTuner's other options (config/pending.py, the st_keys audit) --------------------------------------

# (key, a value that changes nothing here, a value that would): every SimpleTuner option difftune does not have
SIMPLETUNER_PENDING = [
    ("aspect_bucket_worker_count", 12, 4), ("image_processing_batch_size", 32, 8), ("read_batch_size", 25, 8),
    ("torch_num_threads", 8, 2),
    ("enable_multiprocessing", False, True), ("cache_dir_vae", None, "cache/vae"),
    ("parquet_caption_column", None, "caption"), ("parquet_filename_column", None, "filename"),
    ("prediction_type", None, "epsilon"), ("snr_gamma", None, 5), ("use_soft_min_snr", False, True),
    ("rescale_betas_zero_snr", False, True), ("timestep_bias_strategy", None, "later"),
    ("training_scheduler_timestep_spacing", "trailing", "leading"),
    ("inference_scheduler_timestep_spacing", "trailing", "leading"), ("offset_noise", False, True),
    ("diff2flow_enabled", False, True), ("pretrained_t5_model_name_or_path", None, "google/t5-v1_1-xxl"),
    ("t5_padding", "unmodified", "zero"), ("sd3_clip_uncond_behaviour", "empty_string", "zero"),
    ("sd3_t5_uncond_behaviour", None, "zero"), ("pretrained_unet_model_name_or_path", None, "me/unet"),
    ("pretrained_unet_subfolder", "unet", "unet2"), ("unet_attention_slice", False, True),
    ("flux_lora_target", "all", "mmdit"), ("flux_fast_schedule", False, True),
    ("flux_guidance_mode", "constant", "random-range"), ("flux_guidance_value", 1.0, 3.5),
    ("flux_guidance_min", 0.0, 1.0), ("flux_guidance_max", 4.0, 5.0),
    ("flux_attention_masked_training", False, True), ("validation_guidance_real", 1.0, 3.0),
    ("hidream_use_load_balancing_loss", False, True), ("ltx_train_mode", "i2v", "t2v"),
    ("ltx_i2v_prob", 0.1, 0.5), ("ltx_partial_noise_fraction", 0.05, 0.1),
    ("ltx_protect_first_frame", False, True), ("refiner_training", False, True),
    ("sdxl_refiner_uses_full_range", False, True), ("data_aesthetic_score", 7.0, 6.0),
    ("sana_complex_human_instruction", None, "Enhance:"),
    ("text_encoder_3_precision", "no_change", "int8-quanto"),
    ("text_encoder_4_precision", "no_change", "int8-quanto"), ("controlnet", False, True),
    ("control", False, True),
    ("pretrained_gemma_model_name_or_path", None, "google/gemma-2-2b"), ("non_ema_revision", None, "main"),
    ("quantization_config", None, {"transformer": {"load_in_4bit": True}}),
    ("quantize_activations", False, True), ("fuse_qkv_projections", False, True),
    ("sla_config", None, {"topk": 0.2}), ("i_know_what_i_am_doing", False, True),
    ("peft_lora_mode", "standard", "singlora"),
    ("slider_lora_target", False, True),
    ("init_lokr_norm", None, 0.001), ("train_text_encoder", False, True),
    ("set_grads_to_none", False, "sometimes"), ("disable_segmented_timestep_sampling", False, "sometimes"),
    ("fuse_optimizer", False, True),
    ("optimizer_release_gradients", False, True), ("gradient_precision", None, "fp32"),
    ("ema_cpu_only", False, "sometimes"), ("ema_foreach_disable", False, True),
    ("conditioning_multidataset_sampling", "random", "combined"), ("ignore_missing_files", False, True),
    ("delete_unwanted_images", False, True), ("delete_problematic_images", False, True),
    ("override_dataset_config", False, True), ("cache_dir", None, "/models"),
    ("vae_cache_scan_behaviour", "recreate", "sync"), ("vae_enable_temporal_roll", False, True),
    ("keep_vae_loaded", False, True), ("cache_clear_validation_prompts", False, True),
    ("conditioning_image_embed_batch_size", None, 4),
    ("accelerator_cache_clear_interval", None, 100), ("offload_during_save", False, True),
    ("delete_model_after_load", False, True), ("musubi_block_swap_device", "cpu", "cuda:0"),
    ("ramtorch", False, True), ("group_offload_text_encoder", False, True), ("group_offload_vae", False, True),
    ("num_processes", 1, 8), ("num_machines", 1, 2), ("accelerate_config", None, "accelerate.yaml"),
    ("accelerate_extra_args", None, "--multi_gpu"), ("local_rank", -1, 0),
    ("deepspeed_config", None, {"zero_optimization": {"stage": 2}}), ("offload_param_path", None, "/offload"),
    ("context_parallel_size", 1, 2), ("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"),
    ("fsdp_limit_all_gathers", True, False), ("fsdp_cpu_offload", False, True),
    ("fsdp_activation_checkpointing", False, True), ("seed_for_each_device", True, False),
    ("validation_multigpu", "batch-parallel", "all"), ("validation_torch_compile", False, True),
    ("validation_guidance_skip_layers", None, [7, 8]),
    ("validation_noise_scheduler", None, "unipc"),
    ("validation_method", "simpletuner-local", "external-script"),
    ("validation_adapter_path", None, "me/lora"), ("validation_adapter_config", None, "adapters.json"),
    ("validation_preview", False, True),
    ("checkpointing_use_tempdir", False, "sometimes"),
    ("tracker_image_layout", "gallery", "table"), ("custom_tracker", None, "my_tracker"),
    ("publishing_config", None, "publish.json"),
    ("push_to_hub_background", False, "sometimes"),
    ("enable_watermark", False, True), ("debug_aspect_buckets", False, True),
    ("debug_dataset_loader", False, True), ("print_filenames", False, True),
    ("print_sampler_statistics", False, True), ("distillation_method", None, "lcm"),
    # written by SimpleTuner's configure tool whatever the model (its field registry's defaults)
    ("wan_force_2_1_time_embedding", False, True), ("enable_chunked_feed_forward", False, True),
    ("lyrics_embedder_train", False, True), ("validation_lyrics", None, "la la"),
    ("validation_audio_duration", 30.0, 10.0), ("audio_channels", 1, 2), ("audio_duration_interval", 3.0, 5.0),
    ("audio_truncation_mode", "beginning", "end"), ("audio_max_duration_seconds", None, 60),
    ("urepa_enabled", False, True), ("fused_qkv_projections", False, True), ("twinflow_enabled", False, True),
    ("crepa_use_tae", False, True), ("crepa_normalize_neighbour_sum", False, True),
    ("crepa_encoder_frames_batch_size", -1, 8),
]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """One small dataset for the many config-only tests below (none of them reads it)."""
    from difftune.demo import make_dataset

    folder = tmp_path_factory.mktemp("st-images")
    make_dataset(folder, count=2)
    return folder


@pytest.mark.parametrize("key,off,on", SIMPLETUNER_PENDING, ids=[k for k, _, _ in SIMPLETUNER_PENDING])
def test_simpletuner_option_accepted_off_refused_on(tmp_path, images, key, off, on):
    load_config(write_config(tmp_path, images, **{key: off}))
    text = problems(write_config(tmp_path, images, **{key: on}))
    assert f"{key}=" in text and "not implemented yet" in text and "unknown key" not in text


@pytest.mark.parametrize("setting,value,switch,off,on", [
    ("noise_offset", 0.1, "offset_noise", False, True),
    ("text_encoder_lr", 1e-5, "train_text_encoder", False, True),
    ("validation_no_cfg_until_timestep", 2, "validation_guidance_real", 1.0, 3.0),
    ("ramtorch_vae", True, "ramtorch", False, True),
    ("timestep_bias_portion", 0.25, "timestep_bias_strategy", "none", "later"),
    ("validation_adapter_strength", 0.5, "validation_adapter_path", None, "me/lora"),
    ("main_process_port", 29500, "num_machines", 1, 2),
])
def test_settings_of_a_pending_switch(tmp_path, images, setting, value, switch, off, on):
    load_config(write_config(tmp_path, images, **{setting: value}))  # no switch: SimpleTuner ignores it too
    load_config(write_config(tmp_path, images, **{setting: value, switch: off}))
    text = problems(write_config(tmp_path, images, **{setting: value, switch: on}))
    assert f"{setting}=" in text and f"{switch}=" in text and "not implemented yet" in text


@pytest.mark.parametrize("alias,value,key,expected,other", [
    ("flow_sigmoid_scale", 1.5, "logit_std", 1.5, 1.0),  # sigmoid(scale * randn) is logit-normal sampling
    ("pretrained_evaluation_model_name_or_path", "openai/clip-vit-large-patch14-336", "evaluation_clip_model",
     "openai/clip-vit-large-patch14-336", "openai/clip-vit-base-patch32"),
    ("model_card_private", "true", "hub_private", True, False),
    # the optimizer's betas (SimpleTuner passes them only as a pair; here each sets its own)
    ("optimizer_beta1", 0.95, "adam_beta1", 0.95, 0.9), ("optimizer_beta2", "0.99", "adam_beta2", 0.99, 0.999),
    # module names for peft's target_modules, as a JSON list
    ("peft_lora_target_modules", ["to_q", "to_k"], "lora_target_modules", ["to_q", "to_k"], ["to_v"]),
    ("framerate", 30, "frame_rate", 30.0, 24.0),  # video models: clips trained on and videos written
])
def test_simpletuner_aliases(tmp_path, images, alias, value, key, expected, other):
    video = {"model_family": "kandinsky5-video"} if key == "frame_rate" else {}  # frame_rate is a video key
    assert getattr(load_config(write_config(tmp_path, images, **{alias: value}, **video)).train, key) == expected
    text = problems(write_config(tmp_path, images, **{alias: value, key: other}, **video))
    assert alias in text and key in text and "keep one" in text
    # SimpleTuner writes null for "not set": the same as leaving the alias out, whatever the key says
    same = load_config(write_config(tmp_path, images, **{alias: None, key: other}, **video)).train
    assert getattr(same, key) == other
    unset = load_config(write_config(tmp_path, images, **{alias: "null"}, **video)).train  # null as typed
    assert key not in unset.model_fields_set


def test_a_simpletuner_kandinsky5_config_loads(tmp_path, images):
    """A config.json as a SimpleTuner user brings it: the Kandinsky 5 Image quickstart's keys, those of
    SimpleTuner's config.json.example, and many options left at SimpleTuner's defaults."""
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "user_prompt_library.json").write_text(json.dumps({"portrait": "a portrait"}))
    spec = {
        "model_type": "lora", "model_family": "kandinsky5-image", "model_flavour": "t2i-lite-sft",
        "train_batch_size": 1, "gradient_accumulation_steps": 1, "validation_resolution": "1024x1024",
        "validation_guidance": 5.0, "flow_schedule_shift": 1.0,
        "user_prompt_library": str(tmp_path / "config" / "user_prompt_library.json"),
        "enable_group_offload": True, "group_offload_type": "block_level", "group_offload_blocks_per_group": 1,
        "group_offload_use_stream": True, "offload_during_startup": True, "base_model_precision": "int8-quanto",
        "text_encoder_1_precision": "no_change", "text_encoder_2_precision": "no_change", "lora_rank": 16,
        "base_model_default_dtype": "bf16",
        "tread_config": {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]},
    }
    example = {  # SimpleTuner's config/config.json.example, with the leading dashes it writes
        "--resume_from_checkpoint": "latest", "--seed": 42, "--max_train_steps": 10000, "--num_train_epochs": 0,
        "--checkpointing_steps": 500, "--checkpoints_total_limit": 5, "--hub_model_id": "simpletuner-lora",
        "--push_to_hub": "false", "--tracker_project_name": "lora-training", "--tracker_run_name": "simpletuner-lora",
        "--gradient_checkpointing": "true", "--caption_dropout_probability": 0.1, "--resolution_type": "pixel_area",
        "--resolution": 1024, "--validation_seed": 42, "--validation_steps": 500,
        "--validation_guidance_rescale": "0.0", "--validation_num_inference_steps": "20",
        "--validation_prompt": "A photo-realistic image of a cat", "--mixed_precision": "bf16",
        "--optimizer": "adamw_bf16", "--learning_rate": "1e-4", "--lr_scheduler": "polynomial",
        "--lr_warmup_steps": 100, "--validation_torch_compile": "false", "--disable_benchmark": "false",
    }
    defaults = {  # SimpleTuner's defaults of options difftune does not have (or has under another name)
        "lr_power": 1.0, "lr_num_cycles": 1, "noise_offset": 0.1, "noise_offset_probability": 0.25,
        "offset_noise": False, "input_perturbation": 0.0, "input_perturbation_steps": 0, "flow_sigmoid_scale": 1.0,
        "flow_use_uniform_schedule": False, "flow_use_beta_schedule": False, "flow_beta_schedule_alpha": 2.0,
        "loss_type": "l2", "huber_schedule": "snr", "huber_c": 0.1, "snr_gamma": None, "use_soft_min_snr": False,
        "train_text_encoder": False, "freeze_encoder": True, "text_encoder_limit": 100, "lora_init_type": "default",
        "peft_lora_mode": "standard", "use_dora": False, "ema_cpu_only": False, "ema_foreach_disable": False,
        "num_validation_images": 1, "validation_randomize": False, "validation_disable": False,
        "validation_on_startup": False, "eval_timesteps": 28, "eval_dataset_pooling": False,
        "pretrained_evaluation_model_name_or_path": "openai/clip-vit-large-patch14-336",
        "data_backend_sampling": "auto-weighting", "vae_cache_scan_behaviour": "recreate", "write_batch_size": 128,
        "read_batch_size": 25, "max_workers": 32, "image_processing_batch_size": 32, "aspect_bucket_worker_count": 12,
        "torch_num_threads": 8, "metadata_update_interval": 3600, "seed_for_each_device": True, "local_rank": -1,
        "num_processes": 1, "i_know_what_i_am_doing": False, "fuse_qkv_projections": False,
        "text_encoder_3_precision": "no_change", "prediction_type": None, "timestep_bias_strategy": "none",
        "training_scheduler_timestep_spacing": "trailing", "inference_scheduler_timestep_spacing": "trailing",
        "rescale_betas_zero_snr": False, "flux_guidance_mode": "constant", "t5_padding": "unmodified",
        "push_to_hub_background": False, "model_card_private": False, "checkpointing_use_tempdir": False,
        "checkpointing_rolling_steps": 0, "checkpoints_rolling_total_limit": 1, "tracker_image_layout": "gallery",
        "musubi_block_swap_device": "cpu", "ramtorch": False, "gradient_checkpointing_backend": "torch",
        "validation_multigpu": "batch-parallel", "attention_mechanism": "diffusers", "controlnet": False,
        "quantize_via": "cpu", "ema_validation": "comparison", "delete_problematic_images": False,
        "validation_preview": False, "validation_preview_steps": 1, "layersync_enabled": False,
    }
    path = write_config(tmp_path, images, dataset={"crop": True, "crop_aspect": "square", "repeats": 10,
                                                   "resolution": 1024})
    paths = {k: v for k, v in json.loads(path.read_text()).items() if k in ("output_dir", "data_backend_config")}
    path.write_text(json.dumps({**paths, **spec, **example, **defaults}))
    cfg = load_config(path).train
    assert (cfg.model_family, cfg.checkpoint_step_interval, cfg.validation_step_interval) == ("kandinsky5-image", 500,
                                                                                               500)
    assert cfg.logit_std == 1.0 and cfg.evaluation_clip_model == "openai/clip-vit-large-patch14-336"


def test_simpletuner_nulls_and_switched_off_settings(tmp_path, dataset):
    """SimpleTuner writes null for these, names a default lycoris_config whatever lora_type is, and allows
    minimum_image_size 0 (no minimum): all load, each meaning what leaving it out means."""
    cfg = load_config(write_config(tmp_path, dataset, seed=None, max_train_steps=None, num_train_epochs=1,
                                   eval_steps_interval=None, validation_using_datasets=None, minimum_image_size=0,
                                   lycoris_config="config/lycoris_config.json", dynamo_dynamic=False,
                                   dynamo_use_regional_compilation=False)).train
    assert (cfg.seed, cfg.max_train_steps, cfg.eval_steps_interval, cfg.validation_using_datasets) == (42, 0, 0, False)
    assert cfg.minimum_image_size == 0
    # the LyCORIS file is read when it is used, and then it must exist
    text = problems(write_config(tmp_path / "ly", dataset, lora_type="lycoris", lycoris_config=str(tmp_path / "no.json")))
    assert "lycoris_config" in text


def test_simpletuner_loss_and_perturbation_keys(tmp_path, images):
    """loss_type, huber_* and input_perturbation* as SimpleTuner writes them (config/loss_keys.py): typed on the
    command line, null for the default, and its float step count; bad values name the key."""
    path = write_config(tmp_path, images)
    cfg = load_config(path, parse_overrides(["--loss_type", "smooth_l1", "--huber_schedule", "exponential",
                                             "--huber_c", "0.2", "--input_perturbation", "0.1",
                                             "--input_perturbation_steps", "100.0"])).train
    assert (cfg.loss_type, cfg.huber_schedule, cfg.huber_c) == ("smooth_l1", "exponential", 0.2)
    assert (cfg.input_perturbation, cfg.input_perturbation_steps) == (0.1, 100)
    cfg = load_config(write_config(tmp_path, images, loss_type=None, huber_schedule=None, huber_c=None,
                                   input_perturbation=None, input_perturbation_steps=None)).train
    assert (cfg.loss_type, cfg.huber_schedule, cfg.huber_c, cfg.input_perturbation, cfg.input_perturbation_steps) == (
        "l2", "snr", 0.1, 0.0, 0)
    for key, bad in (("loss_type", "l1"), ("huber_schedule", "linear"), ("huber_c", 0), ("input_perturbation", -0.1),
                     ("input_perturbation_steps", -5)):
        text = problems(path, **{key: bad})
        assert key in text and "not implemented yet" not in text, (key, text)


def test_cache_dir_text_is_the_default_text_cache_folder(tmp_path, dataset):
    """SimpleTuner's config-level cache_dir_text ("cache" by its default) was refused as not implemented; it is the
    folder of the default text cache, and with text_embeds entries it is unused, with a note."""
    path = write_config(tmp_path, dataset, cache_dir_text=str(tmp_path / "texts"))
    backend = tmp_path / "config" / "multidatabackend.json"
    entries = json.loads(backend.read_text())
    run = load_config(path)
    assert any("cache_dir_text" in n and "not used" in n for n in run.notes())
    backend.write_text(json.dumps([e for e in entries if e.get("dataset_type") != "text_embeds"]))
    run = load_config(path)
    assert run.datasets.text_cache_root(run.datasets.images[0], "lumina2") == str(tmp_path / "texts")
    assert not any("text" in n for n in run.notes())  # the folder was chosen: no note


def test_simpletuners_legacy_keys_are_read_as_it_reads_them(tmp_path, dataset):
    """save_total_limit, vae_cache_preprocess, a config-level repeats, the aspect_ratio_bucket* keys, allow_tf32 and
    enable_xformers_memory_efficient_attention (in SimpleTuner's own example configs) were "unknown key ...; check
    the spelling", though SimpleTuner's loader reads them."""
    run = load_config(write_config(tmp_path, dataset, save_total_limit=3, vae_cache_preprocess=False,
                                   allow_tf32="true", repeats=3, aspect_ratio_bucketing=True,
                                   enable_xformers_memory_efficient_attention=False))
    cfg = run.train
    assert (cfg.checkpoints_total_limit, cfg.vae_cache_ondemand, cfg.disable_tf32) == (3, True, False)
    notes = "\n".join(run.notes())
    assert "repeats 3: a config-level repeats is not read (SimpleTuner drops it too)" in notes
    assert "aspect_ratio_bucketing True: buckets are always by aspect ratio here" in notes
    text = problems(write_config(tmp_path, dataset, enable_xformers_memory_efficient_attention=True,
                                 vae_cache_preprocess=True, vae_cache_ondemand=True))
    assert "enable_xformers_memory_efficient_attention: xformers is not used by difftune" in text
    assert "vae_cache_preprocess true disagrees with vae_cache_ondemand true" in text


def test_grad_clip_method_without_max_grad_norm_is_noted(tmp_path, dataset):
    """SimpleTuner's Kandinsky 5 presets set grad_clip_method 'value' and no max_grad_norm: nothing was clipped here,
    without a word."""
    notes = "\n".join(load_config(write_config(tmp_path, dataset, grad_clip_method="value")).notes())
    assert "grad_clip_method 'value' not used: no gradient is clipped without max_grad_norm" in notes
    clipped = load_config(write_config(tmp_path, dataset, grad_clip_method="value", max_grad_norm=2.0))
    assert not [n for n in clipped.notes() if "grad_clip_method" in n]


def test_null_on_a_pending_switch_is_off(tmp_path, dataset):
    """"controlnet": null was "not implemented yet: ControlNet training": SimpleTuner skips null keys, so it is off."""
    load_config(write_config(tmp_path, dataset, controlnet=None, validation_torch_compile=None))
    assert "not implemented yet: ControlNet training" in problems(write_config(tmp_path, dataset, controlnet=True))


def test_simpletuners_web_ui_template_is_named(tmp_path, dataset):
    """Its examples/default.json wraps the settings: "unknown key 'config'; did you mean 'sla_config'?"."""
    path = write_config(tmp_path, dataset)
    path.write_text(json.dumps({"_metadata": {"name": "default"}, "config": json.loads(path.read_text())}))
    text = problems(path)
    assert "this is SimpleTuner's web UI template" in text and "move the keys of \"config\" to the top level" in text


def test_a_disabled_entry_is_not_read(tmp_path, dataset):
    """An old entry kept switched off blocked the run with a key not implemented here, or an id an enabled entry
    reuses; SimpleTuner does not read it either."""
    old = {"id": "train", "type": "local", "instance_data_dir": str(tmp_path / "gone"), "crop_style": "face",
           "disabled": True}
    run = load_config(write_config(tmp_path, dataset, extra_datasets=[old]))
    assert [ds.id for ds in run.datasets.images] == ["train"]
    for off in ({"disabled": "yes"}, {"disabled": 1}, {"disable": "true"}):  # as the schema reads them
        entry = {k: v for k, v in old.items() if k != "disabled"} | off
        assert [ds.id for ds in load_config(write_config(tmp_path, dataset, extra_datasets=[entry])).datasets.images] \
            == ["train"]
