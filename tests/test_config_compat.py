"""SimpleTuner configs as users bring them: spellings, aliases, placeholders, pending keys, typed values."""

import json
import math

import pytest

from conftest import write_config
from difftune.cli import parse_overrides
from difftune.config import ConfigError, load_config
from difftune.config.compat import suggest
from difftune.config.schema import TrainConfig


def problems(path, **overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return "\n".join(info.value.problems)


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
    # On the command line an alias overrides the file's own spelling.
    path = write_config(tmp_path, dataset, validation_step_interval=50)
    assert load_config(path, {"validation_steps": "5"}).train.validation_step_interval == 5


@pytest.mark.parametrize("name,canonical", [("torch-adamw", "adamw"), ("bnb-adamw8bit", "adamw8bit"),
                                            ("optimi-lion", "optimi-lion"), ("optimi-adamw", "optimi-adamw")])
def test_optimizer_names(tmp_path, dataset, name, canonical):
    assert load_config(write_config(tmp_path, dataset, optimizer=name)).train.optimizer == canonical


def test_schedulefree_is_refused_as_not_implemented(tmp_path, dataset):
    text = problems(write_config(tmp_path, dataset, optimizer="adamw_schedulefree"))
    assert "optimizer" in text and "not implemented yet" in text and "unknown" not in text


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


def test_vae_and_runtime_keys(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, vae_enable_tiling=True, vae_enable_slicing="true",
                                   grad_clip_method="value", disable_benchmark=False)).train
    assert cfg.vae_enable_tiling and cfg.vae_enable_slicing and cfg.grad_clip_method == "value"
    assert cfg.disable_benchmark is False
    assert "grad_clip_method" in problems(write_config(tmp_path, dataset, grad_clip_method="percentile"))
    load_config(write_config(tmp_path, dataset, compress_disk_cache=False))
    text = problems(write_config(tmp_path, dataset, compress_disk_cache=True))
    assert "compress_disk_cache" in text and "not implemented yet" in text


def test_apply_torch_options():
    import torch
    from diffusers import AutoencoderKL

    from difftune.train.torch_options import apply_torch_options

    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4, sample_size=32)
    cfg = TrainConfig(model_family="lumina2", max_train_steps=1, vae_enable_tiling=True, vae_enable_slicing=True,
                      disable_benchmark=False)
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
    ("compress_disk_cache", True), ("optimizer", "adamw_schedulefree"),
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


def test_regularisation_and_hub_datasets_are_pending(tmp_path, dataset):
    text = problems(write_config(tmp_path, dataset, dataset={"is_regularisation_data": True}))
    assert "is_regularisation_data" in text and "not implemented yet" in text
    load_config(write_config(tmp_path, dataset, dataset={"is_regularisation_data": False}))
    text = problems(write_config(tmp_path, dataset, dataset={"type": "huggingface"}))
    assert "huggingface" in text and "not implemented yet" in text


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


@pytest.mark.parametrize("key", ["gradient_checkpointing_steps", "validation_seeds_list", "num_eval_batches",
                                 "vae_dtype", "lora_init_type", "max_workers", "snr_gamma", "data_loader_workers"])
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
