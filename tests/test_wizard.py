"""`difftune configure` driven in a pseudo-terminal (pexpect), from the first question to written files
that `difftune check` accepts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_config
from difftune.config import load_config
from difftune.demo import make_dataset

pexpect = pytest.importorskip("pexpect", reason="pexpect is in the test extras: pip install -e '.[test]'")

PROMPT = r"\n(\w+)(?: \[[^\r\n]*\])?: "
OTHER = [r"GPU memory available, in GB \(0: no GPU\) \[24\]: ", r"Use these settings\? \[Y/n\]: ",
         r"Write these files\? \[Y/n\]: ", r"Go through the questions again .*\[Y/n\]: "]


def drive(cwd: Path, args: list[str], answers: dict[str, list[str]], gpu: str, use_offer: str,
          transcript: Path) -> tuple[int, str]:
    """Answer each question by its key (a list: one answer per time it is asked; Enter when none)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    child = pexpect.spawn(sys.executable, ["-m", "difftune.cli", "configure", *args], cwd=str(cwd), env=env,
                          encoding="utf-8", timeout=180)  # the memory offer runs the planner
    log = open(transcript, "w")  # noqa: SIM115 - closed below
    child.logfile_read = log
    asked: list[str] = []
    try:
        while True:
            i = child.expect([PROMPT, *OTHER, pexpect.EOF])
            if i == 0:
                key = child.match.group(1)
                asked.append(key)
                queue = answers.get(key, [])
                child.sendline(queue.pop(0) if queue else "")
            elif i == 1:
                child.sendline(gpu)
            elif i == 2:
                child.sendline(use_offer)
            elif i == 3:
                child.sendline("y")
            elif i == 4:
                child.sendline("n")
            else:
                break
        child.close()
    finally:
        log.close()
    return child.exitstatus, " ".join(asked)


def check(cwd: Path, config: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "difftune.cli", "check", "--config", config], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_new_config_from_first_question_to_files_that_pass_check(tmp_path, dataset):
    assert dataset == tmp_path / "images"  # answered as a path relative to where the wizard runs
    answers = {
        "model_family": ["9", "1"],  # out of range, then lumina2
        "model_flavour": ["tiny-random"],
        "lora_rank": ["-3", "4"],  # the schema says why -3 is refused, and asks again
        "instance_data_dir": ["nope", "images"],
        "resolution": ["64"],
        "max_train_steps": ["20"],
        "learning_rate": ["abc", "1e-3"],
        "validation_prompt": ["a red circle"],
    }
    code, asked = drive(tmp_path, [], answers, gpu="0", use_offer="",
                        transcript=tmp_path / "transcript.txt")
    transcript = (tmp_path / "transcript.txt").read_text()
    assert code == 0, transcript
    assert "choose a number from 1 to 3" in transcript
    assert "lora_rank: -3: Input should be greater than 0" in transcript  # the text `difftune check` prints
    assert "learning_rate: 'abc': Input should be a valid number" in transcript
    assert "'nope' is not a folder" in transcript and "4 images found" in transcript
    assert "Peak learning rate" in transcript  # descriptions come from the schema
    # LoRA or full: asked when the schema offers both, told when it offers one
    assert "model_type" in asked.split() or "-> lora (the only choice)" in transcript
    assert "mixed_precision: no" in transcript  # the memory offer for a machine without a GPU
    assert "difftune check accepts this configuration." in transcript
    config = json.loads((tmp_path / "config" / "config.json").read_text())
    datasets = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert config["model_flavour"] == "tiny-random" and config["learning_rate"] == 1e-3
    assert config["max_train_steps"] == 20 and config["mixed_precision"] == "no"
    assert config["validation_resolution"] == "64x64" and config["validation_prompt"] == "a red circle"
    assert [d["dataset_type"] for d in datasets] == ["image", "text_embeds"]
    assert datasets[0]["instance_data_dir"] == "images" and datasets[0]["resolution"] == 64
    result = check(tmp_path, "config/config.json")
    assert result.returncode == 0, result.stderr
    os.chdir(tmp_path)
    try:
        assert load_config("config/config.json").train.lora_rank == 4
    finally:
        os.chdir(Path(__file__).parent.parent)


def test_edit_an_existing_config_keeps_what_was_not_asked(tmp_path, dataset):
    """With DoRA, an eval dataset and a regularisation dataset listed before the trained one (keys the wizard does
    not ask): the questions are about the trained dataset, and everything else is kept."""
    held = {"id": "held", "type": "local", "dataset_type": "eval", "instance_data_dir": str(dataset),
            "caption_strategy": "textfile", "resolution": 64, "cache_dir_vae": str(tmp_path / "cache" / "held")}
    path = write_config(tmp_path, dataset, seed=1234, lora_rank=4, max_train_steps=4, use_dora=True,
                        extra_datasets=[held])
    entries = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    reg = entries[0] | {"id": "reg", "instance_data_dir": str(tmp_path / "reg"), "is_regularisation_data": True,
                        "cache_dir_vae": str(tmp_path / "cache" / "reg")}
    make_dataset(tmp_path / "reg", count=2, seed=5)
    (tmp_path / "config" / "multidatabackend.json").write_text(json.dumps([reg, *entries]))
    before = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    answers = {"max_train_steps": ["30"], "learning_rate": ["2e-4"], "gradient_checkpointing": ["y"]}
    code, asked = drive(tmp_path, [str(path)], answers, gpu="80", use_offer="n",
                        transcript=tmp_path / "transcript.txt")
    transcript = (tmp_path / "transcript.txt").read_text()
    assert code == 0, transcript
    assert "lora_rank [4]" in transcript and f"instance_data_dir [{dataset}]" in transcript  # current values
    assert "gradient_checkpointing" in asked.split()  # asked one by one after refusing the offer
    assert "Predicted peak as configured" in transcript  # the planner ran, and its imports said nothing
    assert not any(noise in transcript for noise in ("Failed to load", "Enum subclass", "kernels-community", "requires torchvision"))
    config = json.loads(path.read_text())
    assert config["seed"] == 1234 and config["lora_rank"] == 4 and config["use_dora"] is True  # kept
    assert config["max_train_steps"] == 30 and config["learning_rate"] == 2e-4
    assert config["gradient_checkpointing"] is True
    after = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert after == before  # nothing about the datasets changed
    result = check(tmp_path, str(path))
    assert result.returncode == 0, result.stderr


def test_nothing_is_written_when_cancelled(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # A suite started in the background by a shell without job control inherits SIGINT ignored, and so
    # would the wizard: give it the default handler a terminal user's process has.
    child = pexpect.spawn(sys.executable, ["-m", "difftune.cli", "configure"], cwd=str(tmp_path), env=env,
                          encoding="utf-8", timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.expect("model_family: ")
    child.sendcontrol("c")
    child.expect("nothing written")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    assert not (tmp_path / "config").exists()


def test_video_family_asks_for_clips(tmp_path):
    """Choosing Kandinsky 5.0 Video makes the dataset a video dataset: the folder check counts clips, and the
    written files pass `difftune check` (which probes the clips)."""
    from difftune.data.video import synthetic_clip

    clips = tmp_path / "clips"
    clips.mkdir()
    for i in range(2):
        synthetic_clip(clips / f"c{i}.mp4", frames=65, seed=i)
        (clips / f"c{i}.txt").write_text("a moving square")
    answers = {"model_family": ["3"], "model_flavour": ["tiny-random"], "instance_data_dir": ["clips"],
               "resolution": ["32"], "max_train_steps": ["5"], "validation_prompt": ["a square"]}
    code, _ = drive(tmp_path, [], answers, gpu="0", use_offer="", transcript=tmp_path / "transcript.txt")
    transcript = (tmp_path / "transcript.txt").read_text()
    assert code == 0, transcript
    assert "2 clips found" in transcript and "difftune check accepts this configuration." in transcript
    datasets = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert datasets[0]["dataset_type"] == "video"
