"""Config errors fail before any model loads, name the key, and say the fix."""

import json

import pytest

from conftest import config_problems as problems
from conftest import write_config
from difftune.cli import main
from difftune.config import ConfigError, load_config


def test_valid_config_and_coercion(tmp_path, dataset):
    path = write_config(tmp_path, dataset, train_batch_size="2")
    data = json.loads(path.read_text())
    data["--learning_rate"] = str(data.pop("learning_rate") / 20)  # SimpleTuner's dashed spelling, as a string
    path.write_text(json.dumps(data))
    cfg = load_config(path).train
    assert cfg.learning_rate == 5e-5 and cfg.train_batch_size == 2
    assert load_config(path, {"lora_rank": "32"}).train.lora_rank == 32  # CLI override wins


def test_unknown_key_suggests(tmp_path, dataset):
    text = problems(write_config(tmp_path, dataset, learning_rat=1e-4))
    assert "learning_rat" in text and "did you mean 'learning_rate'" in text


def test_wrong_type_names_key(tmp_path, dataset):
    text = problems(write_config(tmp_path, dataset, train_batch_size="lots"))
    assert "train_batch_size" in text and "'lots'" in text


def test_pending_feature_is_rejected_not_ignored(tmp_path, dataset):
    text = problems(write_config(tmp_path, dataset, base_model_precision="int4-torchao", peft_lora_mode="singlora"))
    assert "base_model_precision" in text and "not implemented yet" in text
    assert "peft_lora_mode" in text
    assert "optimizer" in problems(write_config(tmp_path, dataset, optimizer="sgd-with-vibes"))
    # The "off" value of a pending key is accepted: it changes nothing.
    load_config(write_config(tmp_path, dataset, peft_lora_mode="standard", base_model_precision="no_change"))


def test_missing_dataset_folder(tmp_path):
    text = problems(write_config(tmp_path, tmp_path / "nowhere"))
    assert "instance_data_dir" in text and "nowhere" in text and "'train'" in text


def test_unreadable_dataset_list(tmp_path, dataset):
    path = write_config(tmp_path, dataset)
    backend = tmp_path / "config" / "multidatabackend.json"
    backend.write_text("[{not json")
    text = problems(path)
    assert str(backend) in text and "not valid JSON" in text
    backend.unlink()
    assert "not found" in problems(path)


def test_bad_dataset_key(tmp_path, dataset):
    text = problems(write_config(tmp_path, dataset, dataset={"resolution_typ": "pixel"}))
    assert "did you mean 'resolution_type'" in text


def test_missing_config_file(tmp_path):
    text = problems(tmp_path / "config.json")
    assert "config.json" in text and "config.json.example" in text


def test_validation_sizes_keep_their_orientation_and_come_once(tmp_path, dataset):
    """40x24 snapped to 32x32 (round() half to even: a landscape turned square); a size named twice, or twice
    after snapping, was sampled twice into the same files."""
    run = load_config(write_config(tmp_path, dataset, validation_resolution="40x24,32x32,40x40,32x32"))
    assert run.train.validation_sizes() == [(48, 32), (32, 32), (48, 48)]
    assert any("names a size twice (after snapping): each is sampled once (48x32, 32x32, 48x48)" in n
               for n in run.notes())


def test_validation_resolution_snapped_to_multiple_of_16(tmp_path, dataset):
    run = load_config(write_config(tmp_path, dataset, validation_resolution="100x100,480x854,64x64"))
    assert run.train.validation_sizes() == [(96, 96), (480, 848), (64, 64)]
    assert run.train.validation_resolution == "100x100,480x854,64x64"  # the file's value is kept as written
    notes = run.notes()
    assert any("100x100" in n and "96x96" in n for n in notes)
    assert any("480x854" in n and "480x848" in n for n in notes)
    assert not any("64x64" in n for n in notes)
    assert "validation_resolution" in problems(write_config(tmp_path, dataset, validation_resolution="0x64"))
    assert "validation_resolution" in problems(write_config(tmp_path, dataset, validation_resolution="big"))


def test_cli_exits_2_before_loading_any_model(tmp_path, dataset, monkeypatch, capsys):
    from difftune.models.lumina2 import Lumina2Family

    def boom(*a, **k):
        raise AssertionError("a model was loaded for a bad config")

    monkeypatch.setattr(Lumina2Family, "load", boom)
    monkeypatch.setattr(Lumina2Family, "build_tiny", boom)
    path = write_config(tmp_path, dataset, lora_rnk=4)
    assert main(["train", "--config", str(path)]) == 2
    assert "lora_rnk" in capsys.readouterr().err
    # An override on the command line is checked the same way.
    good = write_config(tmp_path, dataset)
    assert main(["train", "--config", str(good), "--max_train_steps", "many"]) == 2
    assert "max_train_steps" in capsys.readouterr().err


def test_empty_dataset_fails_before_model_load(tmp_path, monkeypatch, capsys):
    from difftune.models.lumina2 import Lumina2Family

    monkeypatch.setattr(Lumina2Family, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    path = write_config(tmp_path, empty)
    assert main(["train", "--config", str(path)]) == 2
    assert "'train'" in capsys.readouterr().err


def test_check_command_reports(tmp_path, dataset, capsys):
    path = write_config(tmp_path, dataset)
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "OK" in out


def test_json_schema_has_groups_and_descriptions():
    from difftune.config import TrainConfig

    schema = TrainConfig.model_json_schema()
    for name, prop in schema["properties"].items():
        assert prop.get("description"), name
        assert prop.get("group") in ("model", "data", "training", "validation", "memory", "output"), name
    json.dumps(schema)


def test_user_prompt_library(tmp_path, dataset):
    library = tmp_path / "library.json"
    library.write_text('{"portrait": "a face", "landscape": "hills"}')
    cfg = load_config(write_config(tmp_path, dataset, validation_prompt="main", user_prompt_library=str(library))).train
    assert cfg.validation_prompts() == [(None, "main"), ("portrait", "a face"), ("landscape", "hills")]
    library.write_text('["not", "an", "object"]')
    assert "user_prompt_library" in problems(write_config(tmp_path, dataset, user_prompt_library=str(library)))
    assert "cannot read" in problems(write_config(tmp_path, dataset, user_prompt_library=str(tmp_path / "no.json")))


def test_a_path_with_a_name_too_long_for_the_file_system_is_named(tmp_path, dataset):
    """A folder name of 300 characters ended in a traceback (OSError: File name too long) from exists()."""
    long = "a" * 300
    text = problems(write_config(tmp_path, dataset, output_dir=str(tmp_path / long),
                                        dataset={"cache_dir_vae": str(tmp_path / long / "vae")}))
    assert "output_dir: a name in this path is 300 bytes long" in text and "shorten it" in text
    assert "dataset 'train': cache_dir_vae: a name in this path is 300 bytes long" in text
    assert "prompt" not in text  # a long prompt is no path
    load_config(write_config(tmp_path, dataset, validation_prompt="a " * 200))


def test_a_device_named_as_a_settings_file_is_not_read(tmp_path, dataset):
    """user_prompt_library /dev/zero filled the memory until the process was killed."""
    text = problems(write_config(tmp_path, dataset, user_prompt_library="/dev/zero"))
    assert "/dev/zero is not a regular file" in text
    with pytest.raises(ConfigError, match="/dev/zero is not a regular file"):
        load_config("/dev/zero")


def test_a_bad_value_of_a_simpletuner_spelling_is_named_as_written(tmp_path, dataset):
    """validation_steps: "abc" was reported as validation_step_interval, a key the file does not have."""
    text = problems(write_config(tmp_path, dataset, validation_steps="abc", checkpointing_steps="x"))
    assert "validation_steps (difftune's validation_step_interval): 'abc'" in text
    assert "checkpointing_steps (difftune's checkpoint_step_interval): 'x'" in text


def test_a_resolution_written_as_a_decimal(tmp_path, dataset):
    """validation_resolution "64.0" was "not a resolution; ... or one number", although it is one number."""
    from difftune.config.values import parse_resolutions

    assert parse_resolutions("64.0") == [(64, 64)] and parse_resolutions("512.00x256") == [(512, 256)]
    assert "a whole number of pixels" in problems(write_config(tmp_path, dataset, validation_prompt="a cat",
                                                                validation_resolution="64.5"))


def test_a_config_level_dataset_key_every_dataset_overrides_is_noted(tmp_path, dataset):
    """resolution_type 'area' in config.json with every dataset setting its own was accepted without a word."""
    run = load_config(write_config(tmp_path, dataset, resolution_type="area", resolution=0.004))
    (note,) = [n for n in run.notes() if "applies to no dataset" in n or "apply to no dataset" in n]
    assert note.startswith("config.json's resolution, resolution_type apply to no dataset: every image or video")
    kept = load_config(write_config(tmp_path, dataset, minimum_image_size=8))  # the entry sets none: it applies
    assert not [n for n in kept.notes() if "no dataset" in n]
    given = load_config(write_config(tmp_path, dataset), {"resolution": 96})  # `difftune cache --resolution 96`
    (note,) = [n for n in given.notes() if "to no dataset" in n]
    assert note.startswith("the command line's resolution applies to no dataset") and "from the command line" in note
