"""Cross-feature regressions found by trying the features together the way a user writes a config by hand
(config.json + multidatabackend.json): what a user reaches for first must either work or be refused with a
message that says what to do."""

from __future__ import annotations

from conftest import config_problems, write_config
from difftune.config import load_config


def test_optimizer_config_as_a_json_object_means_the_same_as_the_string(tmp_path, dataset):
    """A JSON object is the first thing a user writes in config.json; it reads as SimpleTuner's string would,
    and its mistakes are the string's mistakes (naming optimizer_config and the keyword)."""
    as_object = load_config(write_config(tmp_path / "o", dataset, optimizer_config={"amsgrad": True, "foreach": None}))
    as_text = load_config(write_config(tmp_path / "t", dataset, optimizer_config="amsgrad=true,foreach=none"))
    assert as_object.train.optimizer_settings() == as_text.train.optimizer_settings() == {"amsgrad": True,
                                                                                          "foreach": None}
    path = write_config(tmp_path / "bad", dataset)
    text = config_problems(path, optimizer_config={"weight_decay": 0.01})
    assert "optimizer_config weight_decay=0.01" in text and "adam_weight_decay" in text
    text = config_problems(path, optimizer_config={"betas": [0.9, 0.99]})
    assert "optimizer_config betas: [0.9, 0.99] is not a single value" in text and "adam_beta1" in text
    text = config_problems(path, optimizer="adamw_schedulefree", lr_scheduler="constant",
                           optimizer_config={"warmup_steps": 1})
    assert "warmup_steps is set by lr_warmup_steps" in text


def test_a_config_key_in_a_dataset_entry_says_where_it_belongs(tmp_path, dataset):
    """caption_dropout_probability (and every other config.json key) written into a dataset entry is not just an
    'unknown key': the message says to move it to config.json. A true typo still gets its suggestion."""
    text = config_problems(write_config(tmp_path, dataset, dataset={"caption_dropout_probability": 0.5}))
    assert ("dataset 'train': caption_dropout_probability is a config.json key (it applies to every dataset), not a "
            "dataset entry's; move it to config.json") in text
    text = config_problems(write_config(tmp_path, dataset, dataset={"resolutoin": 64}))
    assert "unknown key 'resolutoin'" in text and "resolution" in text


def test_plan_of_an_image_to_image_config(tmp_path, dataset, capsys):
    """`difftune plan` measures the i2i network with its input-image channels (it failed with a shape error)."""
    from difftune.cli import main
    from families import make_pairs

    make_pairs(dataset, tmp_path / "inputs")
    path = write_config(tmp_path, dataset, model_family="kandinsky5-image", model_flavour="tiny-random-i2i",
                        conditioning_dir=tmp_path / "inputs", dataset={"conditioning_data": "inputs"})
    assert main(["plan", "--config", str(path)]) == 0
    assert "predicted peak" in capsys.readouterr().out


def test_flow_custom_timesteps_as_a_bracketed_list_on_the_command_line(tmp_path, dataset):
    """`--flow_custom_timesteps "[900, 300]"` (a JSON list typed on the command line) reads as '900, 300' does."""
    path = write_config(tmp_path, dataset)
    for text in ("[900, 300]", "900,300", " [900,300] "):
        assert load_config(path, {"flow_custom_timesteps": text}).train.flow_custom_timesteps == [900.0, 300.0]


def test_check_labels_the_regularisation_and_eval_datasets(tmp_path, dataset, capsys):
    """`difftune check`'s data report says which entry is regularisation data, as it says which is held out."""
    from difftune.cli import main
    from difftune.demo import make_dataset

    make_dataset(tmp_path / "reg", count=2, seed=5)
    make_dataset(tmp_path / "held", count=2, seed=9)
    entry = {"type": "local", "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel_area"}
    extra = [entry | {"id": "reg", "instance_data_dir": str(tmp_path / "reg"), "is_regularisation_data": True,
                      "cache_dir_vae": str(tmp_path / "cache" / "reg")},
             entry | {"id": "held", "dataset_type": "eval", "instance_data_dir": str(tmp_path / "held"),
                      "cache_dir_vae": str(tmp_path / "cache" / "held")}]
    assert main(["check", "--config", str(write_config(tmp_path, dataset, extra_datasets=extra))]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert rows["reg"].endswith("(regularisation: trained towards the base model)")
    assert rows["held"].endswith("(eval: measured, never trained on)") and rows["train"].endswith("0")
