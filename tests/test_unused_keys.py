"""Keys whose combination with another key leaves them unused: refused where the user narrowed what trains
(lora_target_modules with LyCORIS), a note before the run where SimpleTuner's own configs carry them."""

from __future__ import annotations

import json

import pytest

from conftest import config_problems, write_config
from difftune.config import load_config


def lycoris_file(tmp_path) -> str:
    path = tmp_path / "lycoris_config.json"
    path.write_text(json.dumps({"algo": "lokr", "linear_dim": 4, "linear_alpha": 1, "factor": 4}))
    return str(path)


def notes(path, **overrides) -> str:
    return "\n".join(load_config(path, overrides).notes())


def test_lora_target_modules_with_lycoris_is_refused(tmp_path, dataset):
    lycoris = dict(lora_type="lycoris", lycoris_config=lycoris_file(tmp_path))
    text = config_problems(write_config(tmp_path, dataset, lora_target_modules=["to_q"], **lycoris))
    assert "lora_target_modules" in text and "apply_preset target_name" in text
    for alias in ("peft_lora_target_modules",):  # SimpleTuner's name for the same key
        assert "apply_preset target_name" in config_problems(write_config(tmp_path, dataset, **{alias: "to_q"},
                                                                          **lycoris))
    load_config(write_config(tmp_path, dataset, lora_target_modules=["to_q"]))  # standard LoRA: used


@pytest.mark.parametrize("kind", [dict(lora_type="lycoris"), dict(model_type="full")])
def test_lora_size_keys_unused_by_the_adapter_get_a_note(tmp_path, dataset, kind):
    if "lora_type" in kind:
        kind = {**kind, "lycoris_config": lycoris_file(tmp_path)}
    path = write_config(tmp_path, dataset, lora_alpha=8, lora_dropout=0.1, **kind)  # lora_rank: written by conftest
    text = notes(path)
    assert "lora_rank, lora_alpha, lora_dropout not used" in text
    assert "not used" not in notes(write_config(tmp_path, dataset, lora_alpha=8, lora_dropout=0.1))  # standard


def test_flow_shift_beside_auto_shift_gets_a_note(tmp_path, dataset):
    path = write_config(tmp_path, dataset, flow_schedule_auto_shift=True, flow_schedule_shift=3.0)
    assert "flow_schedule_shift 3 not used: flow_schedule_auto_shift" in notes(path)
    # The Kandinsky 5 guides: copy the example (auto shift on) and set flow_schedule_shift 1.0, the default value
    explicit_one = write_config(tmp_path, dataset, flow_schedule_auto_shift=True, flow_schedule_shift=1.0)
    assert "flow_schedule_shift 1 not used: flow_schedule_auto_shift" in notes(explicit_one)
    quiet = write_config(tmp_path, dataset, flow_schedule_auto_shift=True, flow_schedule_shift=0)  # ST: "none"
    assert "flow_schedule_shift" not in notes(quiet)
    assert "flow_schedule_shift" not in notes(write_config(tmp_path, dataset, flow_schedule_auto_shift=True))
    assert "flow_schedule_shift" not in notes(write_config(tmp_path, dataset, flow_schedule_shift=3.0))


@pytest.mark.parametrize("optimizer", ["lion", "optimi-lion"])
def test_adam_epsilon_with_lion_gets_a_note(tmp_path, dataset, optimizer):
    path = write_config(tmp_path, dataset, optimizer=optimizer, adam_epsilon=1e-6)
    assert f"adam_epsilon 1e-06 not used: optimizer {optimizer!r} has no epsilon" in notes(path)
    assert "adam_epsilon" not in notes(write_config(tmp_path, dataset, optimizer=optimizer))
    assert "adam_epsilon" not in notes(write_config(tmp_path, dataset, adam_epsilon=1e-6))  # adamw uses it


@pytest.mark.parametrize("entry,config,expected", [
    (dict(crop=True, crop_aspect="square", crop_aspect_buckets=[1.0, 0.75]), {},
     "crop_aspect_buckets not used: crop_aspect 'square'"),
    (dict(crop=False, crop_aspect="closest", crop_aspect_buckets=[1.0, 0.75]), {},
     "crop_aspect and crop_aspect_buckets not used: crop is false"),
    ({}, dict(crop=False, crop_style="random", crop_aspect="preserve"), "crop_aspect not used: crop is false"),
])
def test_crop_keys_the_crop_leaves_unused_get_a_note(tmp_path, dataset, entry, config, expected):
    text = notes(write_config(tmp_path, dataset, dataset=entry, **config))
    assert expected in text and "dataset 'train'" in text.split(expected)[0].splitlines()[-1]
    assert "crop_style" not in text  # it still places the trim to the bucket without crop


def test_simpletuners_crop_defaults_without_crop_get_no_note(tmp_path, dataset):
    """Its tools and examples write crop_aspect 'square' (and crop_aspect_buckets []) on every entry: a note on
    nearly every SimpleTuner dataset list said nothing the user chose."""
    entry = dict(crop=False, crop_aspect="square", crop_aspect_buckets=[], crop_style="random")
    assert "not used" not in notes(write_config(tmp_path, dataset, dataset=entry))


def test_used_crop_keys_get_no_note(tmp_path, dataset):
    entry = dict(crop=True, crop_aspect="closest", crop_aspect_buckets=[1.0, 0.75], crop_style="random")
    assert "not used" not in notes(write_config(tmp_path, dataset, dataset=entry))


def test_adamw8bit_stepping_on_the_cpu_gets_a_note(tmp_path, dataset):
    """bitsandbytes' 8-bit AdamW steps about 8x slower on the CPU than adamw_bf16 (BENCHMARKS.md): with the
    optimizer in CPU memory the user is told which to use instead."""
    full = {"model_type": "full", "optimizer_cpu_offload_method": "cpu"}
    assert "bitsandbytes steps about 8x slower" in notes(write_config(tmp_path, dataset, optimizer="adamw8bit", **full))
    assert "bitsandbytes" not in notes(write_config(tmp_path, dataset, optimizer="adamw_bf16", **full))
    assert "bitsandbytes" not in notes(write_config(tmp_path, dataset, optimizer="adamw8bit", model_type="full"))


def test_validation_keys_without_a_prompt_get_a_note(tmp_path, dataset):
    """An empty validation_prompt switches validation off (a SimpleTuner habit); its settings then sample nothing,
    and check says so instead of passing them silently."""
    text = notes(write_config(tmp_path, dataset, validation_prompt="", validation_steps=5,
                              validation_resolution="64x64", validation_guidance=3.0, validation_seed=7))
    assert ("validation_step_interval (validation_steps), validation_resolution, validation_guidance, "
            "validation_seed not used: no validation prompt is set") in text and "remove them" in text
    assert "no validation prompt" not in notes(write_config(tmp_path, dataset, validation_prompt="a cat",
                                                            validation_steps=5))
    assert "no validation prompt" not in notes(write_config(tmp_path, dataset))


def test_prodigy_with_an_adamw_learning_rate_gets_a_note(tmp_path, dataset):
    """It was a Python UserWarning with a source path, absent from check, events and the web UI."""
    text = notes(write_config(tmp_path, dataset, optimizer="prodigy", learning_rate=1e-4))
    assert "learning_rate 0.0001 with optimizer prodigy" in text and "about 10000x slower" in text
    assert "prodigy" not in notes(write_config(tmp_path, dataset, optimizer="prodigy", learning_rate=1.0))



def test_rollout_and_crepa_keys_their_other_keys_leave_unused_get_notes(tmp_path, dataset):
    """Rollouts asked for with prob_start/prob_end but no ramp_steps never happened (the losses were bit-identical);
    CREPA's decay keys under its constant scheduler, its threshold keys without a threshold and its between-frame
    keys on an image family changed nothing."""
    text = notes(write_config(tmp_path, dataset, scheduled_sampling_max_step_offset=2,
                              scheduled_sampling_prob_start=0.5, scheduled_sampling_prob_end=1.0,
                              scheduled_sampling_reflexflow=False))
    assert "scheduled_sampling_prob_start, scheduled_sampling_prob_end not used" in text
    assert "no sample is ever rolled out" in text
    assert "rolled out" not in notes(write_config(tmp_path, dataset, scheduled_sampling_max_step_offset=2,
                                                  scheduled_sampling_probability=0.5,
                                                  scheduled_sampling_reflexflow=False))
    text = notes(write_config(tmp_path, dataset, crepa_enabled=True, crepa_lambda_end=0.1, crepa_power=2.0,
                              crepa_threshold_mode="recoverable", crepa_adjacent_distance=3))
    for key in ("crepa_lambda_end", "crepa_power", "crepa_threshold_mode", "crepa_adjacent_distance"):
        assert f"{key} not used" in text, text
    assert "crepa" not in notes(write_config(tmp_path, dataset, crepa_lambda_end=0.1))  # CREPA off: nothing said


def test_lycoris_without_lycoris_config_reads_simpletuners_default_file(tmp_path, dataset, monkeypatch):
    """SimpleTuner reads config/lycoris_config.json (in the working folder) when lycoris_config is unset; its LyCORIS
    configs rely on that. Without the file the error names it."""
    monkeypatch.chdir(tmp_path)
    path = write_config(tmp_path, dataset, lora_type="lycoris")
    assert "lycoris_config" in config_problems(path) and "config/lycoris_config.json" in config_problems(path)
    (tmp_path / "config" / "lycoris_config.json").write_text(json.dumps({"algo": "lokr", "linear_dim": 4,
                                                                         "linear_alpha": 1, "factor": 4}))
    run_config = load_config(path)
    assert run_config.train.lycoris_config == "config/lycoris_config.json"
    assert "lycoris_config not set: the LyCORIS network is the one config/lycoris_config.json describes" \
        in "\n".join(run_config.notes())
    named = load_config(write_config(tmp_path, dataset, lora_type="lycoris",
                                     lycoris_config="config/lycoris_config.json"))
    assert "lycoris_config not set" not in "\n".join(named.notes())  # named in the file: no note
    assert "lycoris_config" not in "\n".join(load_config(write_config(tmp_path, dataset)).notes())  # standard LoRA
    (tmp_path / "config" / "lycoris_config.json").write_text("{}")
    path = write_config(tmp_path, dataset, lora_type="lycoris")
    assert "must be a JSON object with at least 'algo'" in config_problems(path)  # the default file is checked too


def test_aspect_bucket_rounding_is_accepted_with_a_note(tmp_path, dataset):
    """SimpleTuner's config.json.example (and most configs made from it) sets aspect_bucket_rounding 2: refused as
    'not implemented yet', every such config stopped at `difftune check`."""
    assert "aspect_bucket_rounding 2 not used: difftune buckets each image by its size in pixels" in \
        notes(write_config(tmp_path, dataset, aspect_bucket_rounding="2"))
    assert "aspect_bucket_rounding" not in notes(write_config(tmp_path, dataset, aspect_bucket_rounding=""))
