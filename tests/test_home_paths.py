"""`~` in a path key means the home folder, as in a shell, everywhere: the config's output_dir, dataset list, model
folder, resume path and prompt library, and the dataset entries' folders and caches. Before, `output_dir: ~/out` made a
folder literally named `~` in the working folder, a `~/model` passed `check` and crashed `train` at the hub, and a
`~/data` dataset was "not a folder" (while the wizard, which expanded it, found its images)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import load_config
from difftune.config.fields import expand_home
from difftune.models import tiny_model
from difftune.train.loop import train
from difftune.train.setup import build_run


@pytest.fixture
def home(tmp_path, monkeypatch, dataset):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    shutil.copytree(dataset, home / "data")
    shutil.copytree(tiny_model("lumina2", "tiny-random"), home / "model")
    (home / "prompts.json").write_text(json.dumps({"circle": "a red circle"}))
    return home


def test_a_run_with_every_path_under_home(tmp_path, home, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    config = write_config(tmp_path / "cfg", home / "data", output_dir="~/out", max_train_steps=2,
                          pretrained_model_name_or_path="~/model", model_flavour="2.0",
                          user_prompt_library="~/prompts.json", validation_resolution="32x32",
                          validation_num_inference_steps=1, validation_disable_unconditional=True,
                          dataset={"instance_data_dir": "~/data", "cache_dir_vae": "~/cache/vae"})
    backend = json.loads((tmp_path / "cfg" / "config" / "multidatabackend.json").read_text())
    backend[1]["cache_dir"] = "~/cache/text"
    (tmp_path / "cfg" / "config" / "multidatabackend.json").write_text(json.dumps(backend))
    raw = json.loads(config.read_text())
    raw["data_backend_config"] = "~/backend.json"
    shutil.copy(tmp_path / "cfg" / "config" / "multidatabackend.json", home / "backend.json")
    config.write_text(json.dumps(raw))

    run_cfg = load_config(config)
    assert run_cfg.train.output_dir == str(home / "out")
    assert run_cfg.train.pretrained_model_name_or_path == str(home / "model")
    train(build_run(run_cfg))
    assert load_file(home / "out" / "pytorch_lora_weights.safetensors")
    assert list((home / "out" / "validation").glob("*circle*.png"))  # the library read from ~/prompts.json
    assert (home / "cache" / "vae").is_dir() and (home / "cache" / "text").is_dir()
    assert not any(p.name == "~" for p in work.rglob("*"))  # no folder named ~ anywhere under the working folder


def test_resume_path_from_home(tmp_path, home, dataset):
    run_cfg = load_config(write_config(tmp_path, dataset, output_dir="~/out", resume_from_checkpoint="latest"))
    assert run_cfg.train.output_dir == str(home / "out") and run_cfg.train.resume_from_checkpoint == "latest"


def test_only_a_leading_tilde_is_expanded(home):
    assert expand_home("~/x") == str(home / "x") and expand_home("~") == str(home)
    assert expand_home("owner/name") == "owner/name" and expand_home("a/~/b") == "a/~/b"
    assert expand_home(None) is None and expand_home(["~/x"]) == ["~/x"]  # a list of caption filters stays as written


def test_resume_off_spellings_and_a_checkpoint_by_its_folder_name(tmp_path, dataset):
    for value in ("none", "None", "", "null", False):
        assert load_config(write_config(tmp_path / "off", dataset, resume_from_checkpoint=value)
                           ).train.resume_from_checkpoint is None
    output = tmp_path / "named" / "output"
    (output / "checkpoints" / "checkpoint-0000004").mkdir(parents=True)
    (output / "checkpoints" / "checkpoint-0000004" / "training_state.json").write_text("{}")
    (output / "checkpoints" / "checkpoint-0000004" / "rng.pt").write_bytes(b"")  # a file only difftune's have
    cfg = load_config(write_config(tmp_path / "named", dataset, resume_from_checkpoint="checkpoint-0000004")).train
    assert cfg.resume_from_checkpoint == str(output / "checkpoints" / "checkpoint-0000004")
    from conftest import config_problems

    problems = config_problems(write_config(tmp_path / "missing", dataset, resume_from_checkpoint="checkpoint-9"))
    assert "null (or 'none') to start afresh" in problems and "the path or the name" in problems


def test_an_older_runs_literal_tilde_folder_is_named(tmp_path, home, dataset, monkeypatch):
    """An older difftune wrote `output_dir: ~/out` to ./~/out: after the upgrade `latest` looked in the home folder
    and started afresh without a word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "~" / "out" / "checkpoints").mkdir(parents=True)
    notes = load_config(write_config(tmp_path, dataset, output_dir="~/out", resume_from_checkpoint="latest")).notes()
    (note,) = [n for n in notes if "literally" in n]
    assert f"wrote to {tmp_path / '~' / 'out'}; move that folder to {home / 'out'}" in note
    (tmp_path / "~" / "out" / "checkpoints").rmdir()
    (tmp_path / "~" / "out").rmdir()
    assert not [n for n in load_config(write_config(tmp_path, dataset, output_dir="~/out")).notes() if "literally" in n]
