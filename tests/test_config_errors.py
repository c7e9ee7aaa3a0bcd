"""Config errors that used to surface late (after loading a model, or as a traceback) fail in `check`,
exit 2, and name the file, the key and the fix."""

import json

import pytest

from conftest import config_problems as problems
from conftest import write_config
from difftune.cli import main
from difftune.config import ConfigError, load_config
from difftune.config.datasets import ImageDataset, TextEmbedsDataset
from difftune.config.schema import TrainConfig


def check(path, capsys, *extra) -> str:
    assert main(["check", "--config", str(path), *extra]) == 2
    return capsys.readouterr().err


def test_resume_from_missing_checkpoint(tmp_path, dataset, capsys, no_model_loads):
    path = write_config(tmp_path, dataset, resume_from_checkpoint=str(tmp_path / "output" / "checkpoint-99"))
    err = check(path, capsys)
    assert "resume_from_checkpoint" in err and "does not exist" in err and "latest" in err
    load_config(write_config(tmp_path, dataset, resume_from_checkpoint="latest"))
    incomplete = tmp_path / "half"
    incomplete.mkdir()
    assert "not a difftune checkpoint" in problems(write_config(tmp_path, dataset, resume_from_checkpoint=str(incomplete)))
    (incomplete / "rng.pt").write_bytes(b"x")  # one of difftune's files, without the state file
    assert "not a complete checkpoint" in problems(write_config(tmp_path, dataset, resume_from_checkpoint=str(incomplete)))
    (incomplete / "training_state.json").write_text("{}")
    load_config(write_config(tmp_path, dataset, resume_from_checkpoint=str(incomplete)))


@pytest.mark.parametrize("source,ok", [
    ("/nowhere/models/lumina", False), ("./models/lumina", False), ("~/no-such-model-dir", False),
    ("models/lumina/v2", False), ("Alpha-VLLM/Lumina-Image-2.0", True), ("owner/name", True),
    ("just-a-name", False), ("owner/", False),
])
def test_model_source_local_or_hub(tmp_path, dataset, source, ok):
    path = write_config(tmp_path, dataset, pretrained_model_name_or_path=source)
    if ok:
        assert load_config(path).train.pretrained_model_name_or_path == source
    else:
        assert "pretrained_model_name_or_path" in problems(path)


def test_model_source_existing_folder_is_local(tmp_path, dataset, monkeypatch):
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    load_config(write_config(tmp_path, dataset, pretrained_model_name_or_path="owner/name"))
    (tmp_path / "weights.safetensors").write_text("")
    assert "is a file" in problems(write_config(tmp_path, dataset, pretrained_model_name_or_path="weights.safetensors"))


def test_output_dir_that_is_a_file(tmp_path, dataset, capsys, no_model_loads):
    (tmp_path / "taken").write_text("a file")
    err = check(write_config(tmp_path, dataset, output_dir=str(tmp_path / "taken")), capsys)
    assert "output_dir" in err and "is a file" in err
    assert "output_dir" in problems(write_config(tmp_path, dataset, output_dir=str(tmp_path / "taken" / "sub")))


def test_cache_dir_that_is_a_file(tmp_path, dataset):
    (tmp_path / "taken").write_text("a file")
    text = problems(write_config(tmp_path, dataset, dataset={"cache_dir_vae": str(tmp_path / "taken")}))
    assert "cache_dir_vae" in text and "'train'" in text


def test_key_twice_in_a_file(tmp_path, dataset, capsys, no_model_loads):
    path = write_config(tmp_path, dataset)
    path.write_text(path.read_text()[:-1] + ', "lora_rank": 8, "lora_rank": 16}')
    err = check(path, capsys)
    assert str(path) in err and "lora_rank" in err and "twice" in err
    path = write_config(tmp_path, dataset)
    backend = tmp_path / "config" / "multidatabackend.json"
    backend.write_text(backend.read_text().replace('"repeats"', '"x"').replace(
        '"caption_strategy": "textfile"', '"caption_strategy": "textfile", "caption_strategy": "filename"', 1))
    text = problems(path)
    assert str(backend) in text and "'train'" in text and "caption_strategy" in text and "twice" in text


def test_trailing_comma_named_at_its_line(tmp_path, dataset):
    path = write_config(tmp_path, dataset)
    path.write_text('{\n  "model_family": "lumina2",\n  "max_train_steps": 4,\n}\n')
    text = problems(path)
    assert "trailing comma at line 3" in text and str(path) in text
    backend = tmp_path / "config" / "multidatabackend.json"
    write_config(tmp_path, dataset)
    backend.write_text(json.dumps(json.loads(backend.read_text()), indent=1)[:-2] + ",\n]")
    assert "trailing comma" in problems(path)


def test_empty_files(tmp_path, dataset):
    path = write_config(tmp_path, dataset)
    path.write_text("  \n")
    assert "empty" in problems(path)
    write_config(tmp_path, dataset)
    (tmp_path / "config" / "multidatabackend.json").write_text("")
    text = problems(path)
    assert "multidatabackend.json" in text and "empty" in text


def test_missing_model_family_lists_families(tmp_path, dataset):
    path = write_config(tmp_path, dataset)
    data = json.loads(path.read_text())
    del data["model_family"]
    path.write_text(json.dumps(data))
    text = problems(path)
    assert "model_family" in text and "lumina2" in text and "kandinsky5-image" in text and "kandinsky5-video" in text


def test_command_line_mistake_is_blamed_on_the_command_line(tmp_path, dataset, capsys, no_model_loads):
    path = write_config(tmp_path, dataset)
    err = check(path, capsys, "--max_train_steps", "many", "--lora_rnk", "4")
    assert "command line: max_train_steps" in err and "command line: unknown key 'lora_rnk'" in err
    assert f"{path}: max_train_steps" not in err
    bad_file = write_config(tmp_path, dataset, lora_rank="many")
    err = check(bad_file, capsys, "--seed", "3")
    assert f"{bad_file}: lora_rank" in err and "command line" not in err


def test_a_problem_between_keys_names_where_they_were_set(tmp_path, dataset, capsys, no_model_loads):
    """A cross-key check (a model validator, no single key) names the source of the keys it is about: the command
    line, the file, or both."""
    path = write_config(tmp_path, dataset)
    err = check(path, capsys, "--checkpoints_rolling_total_limit", "3")
    assert "command line: checkpoints_rolling_total_limit prunes the rolling checkpoints" in err
    assert f"{path}: checkpoints_rolling_total_limit" not in err
    mixed = write_config(tmp_path, dataset, checkpointing_rolling_steps=4)
    err = check(mixed, capsys, "--checkpoint_step_interval", "2")
    assert f"{mixed} and command line: checkpointing_rolling_steps 4 is a multiple of checkpoint_step_interval" in err
    in_file = write_config(tmp_path, dataset, checkpoints_rolling_total_limit=3)
    err = check(in_file, capsys, "--seed", "3")
    assert f"{in_file}: checkpoints_rolling_total_limit prunes" in err and "command line" not in err


def test_missing_text_embeds_entry_says_where_the_cache_goes(tmp_path, dataset, capsys):
    path = write_config(tmp_path, dataset)
    backend = tmp_path / "config" / "multidatabackend.json"
    backend.write_text(json.dumps(json.loads(backend.read_text())[:1]))
    run = load_config(path)
    assert run.datasets.text_embeds.cache_dir == "cache/text/lumina2"
    assert run.datasets.text_embeds_for(run.datasets.images[0]).cache_dir == "cache/text/lumina2"
    assert any("cache/text/lumina2" in n and "text_embeds" in n for n in run.notes())
    assert main(["check", "--config", str(path)]) == 0
    assert "note:" in capsys.readouterr().out


def test_an_empty_text_cache_dir_is_the_default_folder_and_an_empty_data_dir_is_refused(tmp_path, dataset):
    """SimpleTuner's multidatabackend.json.example writes "cache_dir": "" on its text_embeds entry: it filled the
    working folder with hash folders. An empty instance_data_dir read the working folder's images."""
    path = write_config(tmp_path, dataset)
    backend = tmp_path / "config" / "multidatabackend.json"
    entries = json.loads(backend.read_text())
    text_entry = next(e for e in entries if e.get("dataset_type") == "text_embeds")
    backend.write_text(json.dumps([e if e is not text_entry else {**e, "cache_dir": ""} for e in entries]))
    run = load_config(path)
    assert run.datasets.text_cache_root(run.datasets.images[0], "lumina2") == "cache/text/lumina2"
    for entry in ({"instance_data_dir": ""}, {"instance_data_dir": "  "}):
        text = problems(write_config(tmp_path / "empty", dataset, dataset=entry))
        assert "instance_data_dir is empty" in text and "give the folder of the images" in text


# --- every key, given a value of the wrong JSON type, is a clean ConfigError ---------------------------------

WRONG = [["image"], {"a": 1}, 12345, 1.5, True, None, "x"]


def _dataset_keys():
    keys = set(ImageDataset.model_fields) | set(TextEmbedsDataset.model_fields)
    return sorted(keys | {"video", "parquet", "is_regularisation_data"})


@pytest.mark.parametrize("key", _dataset_keys())
def test_wrong_types_in_dataset_entry(tmp_path, dataset, key):
    for value in WRONG:
        for index in (0, 1):
            path = write_config(tmp_path, dataset)
            backend = tmp_path / "config" / "multidatabackend.json"
            entries = json.loads(backend.read_text())
            entries[index][key] = value
            backend.write_text(json.dumps(entries))
            try:
                load_config(path)
            except ConfigError as e:
                assert e.problems and all(isinstance(p, str) for p in e.problems)


@pytest.mark.parametrize("key", sorted(set(TrainConfig.model_fields) - {"data_backend_config"}))
def test_wrong_types_in_config(tmp_path, dataset, key):
    for value in WRONG:
        path = write_config(tmp_path, dataset, **{key: value})
        try:
            load_config(path)
        except ConfigError as e:
            assert e.problems and all(isinstance(p, str) for p in e.problems)


def test_wrong_type_dataset_type_and_list(tmp_path, dataset):
    path = write_config(tmp_path, dataset, dataset={"dataset_type": ["image"]})
    text = problems(path)
    assert "dataset_type" in text and "['image']" in text
    backend = tmp_path / "config" / "multidatabackend.json"
    for bad in ({"not": "a list"}, [1, "two"], [[]]):
        backend.write_text(json.dumps(bad))
        assert problems(path)


@pytest.mark.parametrize("bad", ["../escape", "a/b", "..", ".", "a\\b"])
def test_dataset_ids_are_folder_names(tmp_path, dataset, bad):
    """An id names its default cache folder (cache/vae/<family>/<id>): it cannot hold a path."""
    with pytest.raises(ConfigError, match="names a cache folder"):
        load_config(write_config(tmp_path, dataset, dataset={"id": bad}))


def test_files_saved_with_a_byte_order_mark_read_as_without(tmp_path, dataset):
    """Windows editors save "UTF-8 with BOM": the config, the dataset list and caption files read as if it were not
    there (the mark never becomes part of a caption's text embedding)."""
    from difftune.data.captions import from_textfile

    config = write_config(tmp_path, dataset)
    for path in (config, tmp_path / "config" / "multidatabackend.json"):
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_config(config).train.model_family == "lumina2"
    image = next(dataset.glob("*.png"))
    image.with_suffix(".txt").write_bytes(b"\xef\xbb\xbfbom caption\r\nsecond line\r\n")
    assert from_textfile(image).captions == ("bom caption", "second line")


@pytest.mark.parametrize("name", ["unconditional", "Validation"])
def test_prompt_library_names_taken_by_the_runs_own_samples_are_refused(tmp_path, dataset, name):
    """The empty prompt's sample is `...-unconditional-WxH.png` and validation_prompt's label is 'validation': a
    library entry of either name would overwrite that file or share that label."""
    (tmp_path / "prompts.json").write_text(json.dumps({"cat": "a cat", name: "a prompt of mine"}))
    found = problems(write_config(tmp_path, dataset, user_prompt_library=str(tmp_path / "prompts.json")))
    assert f"['{name}']" in found and "rename those entries" in found


def test_prompt_library_names_too_long_for_a_file_name_are_refused(tmp_path, dataset):
    """A name is part of each sample's file name: 250 characters passed check, then training died with 'File name
    too long' at its first validation."""
    (tmp_path / "prompts.json").write_text(json.dumps({"cat": "a cat", "x" * 250: "a prompt of mine"}))
    found = problems(write_config(tmp_path, dataset, user_prompt_library=str(tmp_path / "prompts.json")))
    assert "longer than 120 characters" in found and "shorten them" in found
    (tmp_path / "prompts.json").write_text(json.dumps({"x" * 120: "a prompt of mine"}))
    assert load_config(write_config(tmp_path, dataset, user_prompt_library=str(tmp_path / "prompts.json")))


@pytest.mark.parametrize("key,value,said", [
    ("seed", -1, "greater than or equal to 0"), ("seed", 2**64, "less than or equal to"),
    ("learning_rate", "inf", "finite number"), ("tracker_project_name", "../../elsewhere", "is a path"),
    ("tracker_project_name", "/tmp/logs", "is a path"),
    ("tracker_project_name", "run#2: 50%?", "has # % : ?, which W&B does not take")])
def test_values_that_failed_after_loading_or_wrote_elsewhere_are_config_errors(tmp_path, dataset, key, value, said):
    """A negative seed crashed the sampler after caching; learning_rate inf trained every weight to NaN and exited
    0; a tracker_project_name path put TensorBoard's logs outside output_dir (past the web UI's roots)."""
    assert said in problems(write_config(tmp_path, dataset, **{key: value}))


def test_a_relative_dataset_list_not_found_says_where_it_was_looked_for(tmp_path, dataset, monkeypatch):
    """SimpleTuner's "data_backend_config": "config/multidatabackend.json", run from another folder: the message
    asked to create a file that was there, beside the config."""
    path = write_config(tmp_path / "project", dataset, data_backend_config="config/multidatabackend.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    text = problems(path)
    assert f"data_backend_config is read from the folder difftune runs in ({elsewhere})" in text
    assert "run from the folder that holds config/multidatabackend.json" in text


def test_a_dataset_resolution_of_inf_or_nan_is_refused(tmp_path, dataset):
    """`--resolution inf` (or a hand-written one) passed gt=0 and failed only when the buckets were made."""
    for value in ("inf", "nan"):
        text = problems(write_config(tmp_path, dataset, dataset={"resolution": value}))
        assert "resolution" in text and "finite" in text


def test_fp16_full_finetune_message_follows_what_made_the_weights_fp16(tmp_path, dataset):
    """With base_model_default_dtype 'fp16' and mixed_precision 'no', the message said to keep mixed_precision
    'fp16', which the config did not have."""
    text = problems(write_config(tmp_path, dataset, model_type="full", mixed_precision="no",
                                        base_model_default_dtype="fp16"))
    assert "base_model_default_dtype 'fp16'" in text and "mixed_precision 'fp16'" not in text
    assert "keep mixed_precision 'fp16' with base_model_default_dtype 'fp32'" in problems(
        write_config(tmp_path, dataset, model_type="full", mixed_precision="fp16"))


def test_null_for_a_key_that_needs_a_value_says_remove_it_for_its_default(tmp_path, dataset):
    said = problems(write_config(tmp_path, dataset, lr_warmup_steps=None, gradient_accumulation_steps=None))
    assert "lr_warmup_steps: null: Input should be a valid integer; remove the key for its default (0)" in said
    assert "gradient_accumulation_steps: null:" in said and "default (1)" in said
    assert "None" not in said
    required = problems(write_config(tmp_path, dataset, dataset={"id": None}))
    assert "id: null: Input should be a valid string; give it a value" in required, required


def test_probability_zero_says_how_to_leave_a_dataset_out(tmp_path, dataset):
    said = problems(write_config(tmp_path, dataset, dataset={"probability": 0}))
    assert "probability: 0: Input should be greater than 0; disabled: true leaves a dataset out" in said


def test_init_lora_on_a_full_fine_tune_or_lycoris_is_refused(tmp_path, dataset):
    """It was accepted and read by nothing: the run trained from the plain base (losses bit-identical)."""
    lora = tmp_path / "start.safetensors"
    lora.write_bytes(b"")
    said = problems(write_config(tmp_path, dataset, model_type="full", init_lora=str(lora)))
    assert "init_lora is read by a standard LoRA only; a full fine-tune would train from the base without it" in said
    lycoris = tmp_path / "lyco.json"
    lycoris.write_text('{"algo": "lokr"}')
    said = problems(write_config(tmp_path, dataset, lora_type="lycoris", lycoris_config=str(lycoris),
                                 init_lora=str(lora)))
    assert "lora_type 'lycoris' would train from the base without it" in said and "resume_from_checkpoint" in said
