"""Small differences a SimpleTuner config runs into: numbers and "not set" spelled its way, its tracker lists, its
other config files, its optimizer and scheduler names without an equivalent here, and the messages about them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import config_problems as problems
from conftest import write_config
from difftune.config import ConfigError, load_config


def test_a_json_number_is_a_validation_resolution(tmp_path, dataset):
    assert load_config(write_config(tmp_path, dataset, validation_resolution=64)).train.validation_sizes() == [(64, 64)]


def test_a_json_list_or_whole_float_is_a_validation_resolution(tmp_path, dataset):
    sizes = load_config(write_config(tmp_path, dataset, validation_resolution=["64x48", 32])).train.validation_sizes()
    assert sizes == [(64, 48), (32, 32)]
    assert load_config(write_config(tmp_path, dataset, validation_resolution=64.0)).train.validation_sizes() == [
        (64, 64)]
    for megapixels in (1.0, 0.5):
        text = problems(write_config(tmp_path, dataset, validation_resolution=megapixels))
        assert f"validation_resolution: {megapixels!r} is not a size in pixels" in text and "WIDTHxHEIGHT" in text


@pytest.mark.parametrize("key", ["max_grad_norm", "lora_alpha", "validation_seed", "validation_guidance",
                                 "gradient_checkpointing_interval", "checkpoints_total_limit", "tokenizer_max_length",
                                 "base_model_default_dtype", "crop"])
def test_empty_and_none_mean_unset_for_optional_keys(tmp_path, dataset, key):
    """Their help says "Empty ..."; the file's "" and the command line's none both mean the key is not set."""
    path = write_config(tmp_path, dataset, **{key: ""})
    assert getattr(load_config(path).train, key) is None
    assert getattr(load_config(path, {key: "none"}).train, key) is None


def test_max_grad_norm_zero_is_no_clipping(tmp_path, dataset):
    """0 switches clipping off in SimpleTuner and most trainers; a negative limit is still refused."""
    path = write_config(tmp_path, dataset, max_grad_norm=0)
    assert load_config(path).train.max_grad_norm is None
    assert load_config(path, {"max_grad_norm": "0"}).train.max_grad_norm is None
    assert "max_grad_norm" in problems(write_config(tmp_path, dataset, max_grad_norm=-1))


def test_none_for_a_file_key_on_the_command_line(tmp_path, dataset):
    library = tmp_path / "library.json"
    library.write_text('{"cat": "a cat"}')
    path = write_config(tmp_path, dataset, user_prompt_library=str(library), validation_prompt="a dog")
    assert load_config(path, {"user_prompt_library": "none"}).train.user_prompt_library is None
    # free text keeps the word: a prompt may be "none"
    assert load_config(path, {"validation_prompt": "none"}).train.validation_prompt == "none"


def test_empty_and_none_mean_unset_in_dataset_entries(tmp_path, dataset):
    """The dataset list takes SimpleTuner's "not set" spellings as config.json does; a prompt keeps the word."""
    path = write_config(tmp_path, dataset, dataset={"minimum_image_size": "", "probability": "none",
                                                    "maximum_aspect_ratio": "None", "crop_aspect_buckets": "",
                                                    "instance_prompt": "none"})
    entry = load_config(path).datasets.images[0]
    assert (entry.minimum_image_size, entry.probability, entry.maximum_aspect_ratio,
            entry.crop_aspect_buckets) == (None, None, None, None)
    assert entry.instance_prompt == "none"


@pytest.mark.parametrize("key", ["seed", "num_train_epochs", "checkpoint_step_interval", "validation_step_interval",
                                 "eval_steps_interval", "validation_using_datasets", "lr_num_cycles", "huber_c",
                                 "masked_loss_probability", "flow_beta_schedule_alpha"])
def test_empty_and_none_mean_the_default_where_null_does(tmp_path, dataset, key):
    """Keys whose null is their default took null but refused "" and none, which the README says mean null."""
    from difftune.config.schema import TrainConfig

    default = TrainConfig.model_fields[key].default
    for spelling in ("", "none", "None"):
        assert getattr(load_config(write_config(tmp_path, dataset, **{key: spelling})).train, key) == default
        assert getattr(load_config(write_config(tmp_path, dataset), {key: spelling}).train, key) == default


@pytest.mark.parametrize("key", ["logging_dir", "snr_gamma", "aspect_bucket_rounding"])
def test_empty_is_the_off_value_of_keys_not_implemented(tmp_path, dataset, key):
    """Their off value is null; "" (the web UI's empty box) was refused as 'not implemented yet'."""
    assert load_config(write_config(tmp_path, dataset, **{key: ""}))


@pytest.mark.parametrize("key", ["num_train_epochs", "checkpoint_step_interval", "validation_step_interval"])
def test_null_is_the_off_value_of_epochs_and_intervals(tmp_path, dataset, key):
    assert getattr(load_config(write_config(tmp_path, dataset, **{key: None})).train, key) == 0


@pytest.mark.parametrize("given,value", [("wandb,tensorboard", "all"), (" tensorboard , wandb", "all"),
                                         ("tensorboard,none", "tensorboard"), ("TensorBoard", "tensorboard"),
                                         (None, "none"), ("", "none")])
def test_report_to_as_simpletuner_writes_it(tmp_path, dataset, given, value):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    assert load_config(write_config(tmp_path, dataset, report_to=given)).train.report_to == value


@pytest.mark.parametrize("given", ["comet_ml", "wandb,comet_ml", "mlflow"])
def test_report_to_other_trackers_are_not_implemented(tmp_path, dataset, given):
    text = problems(write_config(tmp_path, dataset, report_to=given))
    assert "report_to:" in text and "not implemented yet" in text and "use 'wandb' or 'tensorboard'" in text


TOML = 'model_family = "lumina2"\nmodel_flavour = "tiny-random"\n'


@pytest.mark.parametrize("name,text,kind", [("config.toml", TOML, "a TOML"), ("config.env", "MODEL_TYPE=lora\n",
                                             "an ENV"), ("config.json", TOML, "a TOML")])
def test_simpletuner_toml_and_env_configs_are_named(tmp_path, name, text, kind):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}: this is {kind} config, not JSON" in info.value.problems[0]
    assert "write its keys as a JSON object in" in info.value.problems[0]


def test_json_is_read_whatever_the_name(tmp_path, dataset):
    path = write_config(tmp_path, dataset)
    toml = path.with_suffix(".toml")
    toml.write_text(path.read_text())  # JSON in a .toml: read as JSON
    assert load_config(toml).train.model_family == "lumina2"


@pytest.mark.parametrize("name", ["config.toml", "config.env"])
def test_a_missing_config_json_beside_a_toml_or_env_one(tmp_path, name):
    (tmp_path / name).write_text(TOML)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "config.json")
    assert f"not found, but {tmp_path / name} is there" in info.value.problems[0]


def test_train_sh_warns_that_config_env_is_not_read(tmp_path, dataset):
    script = Path(__file__).resolve().parents[1] / "train.sh"
    write_config(tmp_path, dataset, lora_rank="many")  # a bad value: exits 2 before any model loads
    (tmp_path / "config" / "config.env").write_text("TRAINING_NUM_PROCESSES=2\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ENV", "CONFIG_PATH")}
    done = subprocess.run([str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "note: config/config.env is not read" in done.stderr and "TRAINING_NUM_PROCESSES" in done.stderr
    # and by difftune itself (SimpleTuner's loader reads it too), with CONFIG_PATH naming the config, as there
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, "-m", "difftune.cli", "check"], cwd=elsewhere, capture_output=True,
                          text=True, timeout=120, env={**env, "CONFIG_PATH": str(tmp_path / "config" / "config.json")})
    assert done.returncode == 2 and f"note: CONFIG_PATH={tmp_path / 'config' / 'config.json'}: reading it" in \
        done.stderr and f"note: {tmp_path / 'config' / 'config.env'} is not read" in done.stderr, done.stderr


@pytest.mark.parametrize("key,value,closest", [
    ("optimizer", "torch-sparseadam", "'torch-adam'"), ("optimizer", "adamw_schedulefree+aggressive", "'adamw_schedulefree'"),
    ("optimizer", "adamw_schedulefree+no_kahan", "'adamw_schedulefree'"),
    ("mixed_precision", "fp8", "'bf16'")])
def test_simpletuner_values_without_an_implementation_name_the_closest(tmp_path, dataset, key, value, closest):
    text = problems(write_config(tmp_path, dataset), **{key: value})
    assert f"command line: {key}: not implemented yet: {key} {value!r}" in text and closest in text


@pytest.mark.parametrize("resolution,kind,noted", [(1.0, "pixel", True), (0.5, "pixel_area", True),
                                                   (64.5, "pixel", True), (4, "pixel", True),
                                                   (32, "pixel_area", False), (64, "pixel", False),
                                                   (1.0, "area", False)])
def test_a_megapixel_resolution_with_a_pixel_type_gets_a_note(tmp_path, dataset, resolution, kind, noted):
    run = load_config(write_config(tmp_path, dataset, dataset={"resolution": resolution, "resolution_type": kind}))
    notes = [n for n in run.notes() if "did you mean resolution_type 'area'" in n]
    assert bool(notes) == noted
    if noted:
        assert f"dataset 'train': resolution {resolution:g} with resolution_type '{kind}'" in notes[0]


def test_a_pixel_resolution_with_the_area_type_is_refused(tmp_path, dataset):
    """resolution 1024 with resolution_type 'area' is 1024 megapixels: check passed it, with 32000x32000 buckets
    and a plan of thousands of GiB."""
    text = problems(write_config(tmp_path, dataset, dataset={"resolution": 1024, "resolution_type": "area"}))
    assert ("resolution 1024 with resolution_type 'area' is 1024 megapixels (about 32000x32000 pixels); for "
            "1024x1024 pixels set resolution_type 'pixel_area' (or keep 'area' with resolution 1.05)") in text


def test_caption_settings_the_strategy_does_not_read_are_noted(tmp_path, dataset):
    run = load_config(write_config(tmp_path, dataset, dataset={
        "caption_strategy": "instanceprompt", "instance_prompt": "sks", "prepend_instance_prompt": True,
        "parquet": {"path": "missing.parquet"}}))
    notes = "\n".join(run.notes())
    assert "prepend_instance_prompt not used: caption_strategy 'instanceprompt' trains instance_prompt alone" in notes
    assert "the parquet block is not read: caption_strategy is 'instanceprompt'" in notes


def test_lycoris_keys_of_a_full_fine_tune_are_noted(tmp_path, dataset):
    lycoris = tmp_path / "lycoris.json"
    lycoris.write_text('{"algo": "lokr"}')
    run = load_config(write_config(tmp_path, dataset, model_type="full", lora_type="lycoris",
                                   lycoris_config=str(lycoris)))
    assert any("lora_type, lycoris_config not used: model_type 'full'" in n for n in run.notes()), run.notes()


def test_video_keys_on_an_image_family_are_named_as_written(tmp_path, dataset):
    text = problems(write_config(tmp_path, dataset, framerate=24))
    assert "framerate (difftune's frame_rate) applies only to video families" in text and "remove it for lumina2" in text
    text = problems(write_config(tmp_path, dataset), framerate="24")  # where: the command line that wrote it
    assert "command line: framerate (difftune's frame_rate) applies only" in text
    text = problems(write_config(tmp_path, dataset, validation_num_video_frames=17))
    assert "validation_num_video_frames applies only to video families" in text


def test_config_level_caption_strategy_instance_prompt(tmp_path, dataset):
    path = write_config(tmp_path, dataset, caption_strategy="instance_prompt", instance_prompt="a photo of sks")
    backend = tmp_path / "config" / "multidatabackend.json"
    entries = json.loads(backend.read_text())
    del entries[0]["caption_strategy"]  # the config-level one applies
    backend.write_text(json.dumps(entries))
    run = load_config(path)
    assert run.train.caption_strategy == "instanceprompt"
    assert run.datasets.images[0].caption_strategy == "instanceprompt"


def test_data_pipeline_knobs_are_accepted_with_a_note(tmp_path, dataset):
    """SimpleTuner's write_batch_size, max_workers and metadata_update_interval change no result here."""
    quiet = load_config(write_config(tmp_path, dataset, write_batch_size=128, max_workers=None,
                                     metadata_update_interval=3600))
    assert not [n for n in quiet.notes() if "changes nothing here" in n]
    run = load_config(write_config(tmp_path, dataset, write_batch_size=64, max_workers=16, metadata_update_interval=65,
                                   dataset={"metadata_update_interval": 60}))
    notes = "\n".join(run.notes())
    for key, value in (("write_batch_size", 64), ("max_workers", 16), ("metadata_update_interval", 65)):
        assert f"{key} {value} changes nothing here" in notes
    assert "dataset 'train': metadata_update_interval 60 changes nothing here" in notes
    # the text_embeds entry's own write_batch_size still sets its text-encoder batch
    assert run.datasets.text_embeds.encode_batch() == 128


def test_list_and_object_keys_typed_on_the_command_line(tmp_path, dataset):
    """The command line gives text: crop_aspect_buckets refused every spelling, and optimizer_config's JSON object
    (accepted in the file, shown in the README) was split at its comma."""
    path = write_config(tmp_path, dataset)
    for text in ("[0.75, 1.0]", "0.75,1.0"):
        entry = load_config(path, {"crop_aspect_buckets": text, "crop": "true", "crop_aspect": "random"}).datasets
        assert entry.images[0].crop_aspect_buckets == [0.75, 1.0]
    train = load_config(path, {"optimizer_config": '{"amsgrad": true, "foreach": false}'}).train
    assert train.optimizer_settings() == {"amsgrad": True, "foreach": False}
    assert "starts like a JSON object but is not one" in problems(path, optimizer_config='{"amsgrad": tru}')


def test_a_negative_prompt_without_guidance_gets_a_note(tmp_path, dataset):
    """The pipelines use it only with guidance above 1 (SimpleTuner configs train distilled models at 1)."""
    notes = load_config(write_config(tmp_path, dataset, validation_prompt="a red circle", validation_guidance=1.0,
                                     validation_negative_prompt="blurry")).notes()
    assert any("validation_negative_prompt not used" in n for n in notes)
    notes = load_config(write_config(tmp_path, dataset, validation_prompt="a red circle",
                                     validation_guidance=1.0)).notes()  # the default negative prompt: no note
    assert not any("validation_negative_prompt" in n for n in notes)


def test_an_image_to_video_frame_count_gets_advice_it_can_take(tmp_path):
    """10 frames got "use 9 or 13", both then refused: image-to-video validation needs 17 or more."""
    from families import make_clips

    clips = make_clips(tmp_path / "clips", count=2, frames=9)
    text = problems(write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random-i2v",
                                 validation_num_video_frames=10,
                                 dataset={"dataset_type": "video", "resolution": 32, "video": {"num_frames": 9}}))
    assert "use 17 or more (4k+1)" in text, text


def test_int4_torchao_text_encoder_refusal_gives_its_own_reason(tmp_path, dataset):
    text = problems(write_config(tmp_path, dataset), text_encoder_1_precision="int4-torchao")
    assert "text_encoder_1_precision 'int4-torchao': torchao's int4 weights have a CUDA layout only" in text
    assert "backward" not in text  # the base model's reason: a text encoder runs forward only


def test_ema_and_eval_dataset_keys_that_change_nothing_are_noted(tmp_path, dataset):
    notes = "\n".join(load_config(write_config(tmp_path, dataset, ema_decay=0.9, ema_validation="ema_only",
                                               eval_dataset_id="train")).notes())
    assert "ema_decay, ema_validation not used: use_ema is off" in notes
    assert "eval_dataset_id 'train' not used" in notes


def test_rollouts_use_validation_num_inference_steps_without_a_prompt(tmp_path, dataset):
    """Rollouts take their step schedule from validation_num_inference_steps: the note told to remove it."""
    notes = "\n".join(load_config(write_config(tmp_path, dataset, validation_num_inference_steps=4,
                                               scheduled_sampling_max_step_offset=2,
                                               scheduled_sampling_probability=1.0)).notes())
    assert "validation_num_inference_steps" not in notes
    notes = "\n".join(load_config(write_config(tmp_path, dataset, validation_num_inference_steps=4)).notes())
    assert "validation_num_inference_steps not used: no validation prompt is set" in notes
