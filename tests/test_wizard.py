"""`difftune configure` driven in a pseudo-terminal (pexpect), from the first question to written files
that `difftune check` accepts."""

from __future__ import annotations

import io
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

PROMPT = r"\n([\w.]+)(?: \[[^\r\n]*\])?: "
OTHER = [r"GPU memory available, in GiB \(0: no GPU\) \[24\]: ", r"Use these settings\? \[Y/n\]: ",
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


# --- in-process runs: the same Wizard, its stdin answered by key (fast: no new interpreter, no planner) -------


def scripted(monkeypatch, answers: dict[str, list[str]], replies: dict[str, list[str]] | None = None) -> list[str]:
    """Answer `input()` as a terminal user would: a key's prompt from `answers` (Enter when none are left), any
    other prompt from the first pattern of `replies` it matches (Enter when none are left). Returns the prompts."""
    import re

    asked: list[str] = []
    replies = {"GPU memory": ["0"], **(replies or {})}

    def fake_input(prompt: str) -> str:
        asked.append(prompt)
        if len(asked) > 200:
            raise EOFError  # a loop that never ends: cancelled
        if m := re.fullmatch(r"([\w.]+)(?: \[.*\])?: ", prompt, re.DOTALL):
            queue = answers.get(m.group(1), [])
            return queue.pop(0) if queue else ""
        for pattern, queue in replies.items():
            if re.search(pattern, prompt):
                return queue.pop(0) if queue else ""
        return ""

    monkeypatch.setattr("builtins.input", fake_input)
    return asked


def wizard_run(path: str | None) -> tuple[int, str]:
    from difftune.ui.wizard import Wizard

    out = io.StringIO()
    return Wizard(path, out=out).run(), out.getvalue()


def test_every_image_type_the_trainer_reads_is_counted_in_sub_folders(tmp_path, dataset, monkeypatch):
    """.tif (and .gif, .avif, ...) images in a sub-folder: counted as discovery finds them (data layer's
    IMAGE_EXTENSIONS, sub-folders searched), with a cap on the count; the review accepts the folder."""
    from PIL import Image

    from difftune.ui import wizard

    sub = tmp_path / "tif" / "part"
    sub.mkdir(parents=True)
    for png in sorted(dataset.glob("*.png")):
        Image.open(png).save(sub / f"{png.stem}.tif")
        (sub / f"{png.stem}.txt").write_text(png.with_suffix(".txt").read_text())
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {"model_family": ["1"], "model_flavour": ["tiny-random"], "instance_data_dir": ["tif"],
                           "resolution": ["64"], "max_train_steps": ["5"], "validation_prompt": ["a circle"]},
             {"Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert "4 images found" in transcript and "difftune check accepts this configuration." in transcript
    monkeypatch.setattr(wizard, "COUNT_CAP", 2)
    out = io.StringIO()
    assert wizard.Wizard(None, out=out).folder_problem("tif") is None
    assert "more than 2 images found" in out.getvalue()
    (tmp_path / "empty").mkdir()
    assert ".tif" in wizard.Wizard(None, out=out).folder_problem("empty")  # the message lists what is read


def test_short_clips_get_a_num_frames_that_keeps_them(tmp_path, monkeypatch):
    """12-frame clips: the default num_frames 61 would leave them all out (and the questions never asked it).
    The wizard probes the clips, offers 9 (the largest 4k+1 they allow) and asks validation_num_video_frames."""
    from difftune.data.video import synthetic_clip

    clips = tmp_path / "clips"
    clips.mkdir()
    for i in range(2):
        synthetic_clip(clips / f"c{i}.mp4", frames=12 + 4 * i, seed=i)
        (clips / f"c{i}.txt").write_text("a moving square")
    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"model_family": ["3"], "model_flavour": ["tiny-random"],
                                   "instance_data_dir": ["clips"], "resolution": ["32"], "max_train_steps": ["5"],
                                   "validation_prompt": ["a square"]}, {"Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert "shortest of 2 clip(s) probed has 12 frame(s) at 24 fps" in transcript
    assert "video.num_frames [9]: " in asked and "video.bucket_strategy [aspect_ratio]: " in asked
    assert any(p.startswith("validation_num_video_frames") for p in asked)
    datasets = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert datasets[0]["video"] == {"num_frames": 9}  # the review (difftune check's checks and scan) accepted it


def test_small_files_get_a_resolution_that_fits_them(tmp_path, monkeypatch):
    """96x64 clips: Enter at the resolution question took 1024, and every clip was left out ("enlarged 13x"), so the
    wizard refused to write its own suggestion. It now offers what the probed files fit."""
    from difftune.data.video import synthetic_clip

    clips = tmp_path / "clips"
    clips.mkdir()
    for i in range(2):
        synthetic_clip(clips / f"c{i}.mp4", width=96, height=64, frames=17, seed=i)
        (clips / f"c{i}.txt").write_text("a moving square")
    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"model_family": ["3"], "model_flavour": ["tiny-random"],
                                   "instance_data_dir": ["clips"], "max_train_steps": ["5"]}, {"Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert "the median of 2 file(s) probed is 78.4 in pixel_area units: resolution 64 fits them" in transcript
    assert "resolution [64]: " in asked
    datasets = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert datasets[0]["resolution"] == 64


def test_a_dataset_list_of_one_object_is_wrapped_only_when_asked(tmp_path, dataset, monkeypatch):
    path = write_config(tmp_path, dataset)
    data = tmp_path / "config" / "multidatabackend.json"
    entry = json.loads(data.read_text())[0]
    data.write_text(json.dumps(entry))
    scripted(monkeypatch, {}, {"Wrap it in a list": ["n"]})
    code, transcript = wizard_run(str(path))
    assert code == 2 and "must be a JSON list of entries, got dict" in transcript
    assert json.loads(data.read_text()) == entry  # refused: the file is untouched
    scripted(monkeypatch, {}, {"Wrap it in a list": ["y"], "Use these settings": ["y"], "Write these files": ["y"]})
    code, transcript = wizard_run(str(path))
    assert code == 0, transcript
    written = json.loads(data.read_text())
    assert written[0] == entry and [e["dataset_type"] for e in written] == ["image", "text_embeds"]


def test_unreadable_files_are_named_and_never_block(tmp_path, dataset, capsys):
    from difftune.ui.wizard import run_wizard

    bad = tmp_path / "trailing.json"
    bad.write_text('{"a": 1,\n}')
    assert run_wizard(str(bad)) == 2
    err = capsys.readouterr().err
    assert f"config file {bad}: trailing comma at line 1" in err
    path = write_config(tmp_path, dataset)
    (tmp_path / "config" / "multidatabackend.json").write_text("[\n{]")
    assert run_wizard(str(path)) == 2
    assert f"dataset list {tmp_path / 'config' / 'multidatabackend.json'}: not valid JSON at line 2" in capsys.readouterr().err
    (tmp_path / "odd" / "config.json").mkdir(parents=True)  # a folder is read as its config.json
    assert run_wizard(str(tmp_path / "odd")) == 2
    assert f"{tmp_path / 'odd' / 'config.json'}: is a folder; give the path of the config file, a .json file" in \
        capsys.readouterr().err
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert run_wizard(str(fifo)) == 2  # reading it would wait for a writer forever
    assert "not a regular file" in capsys.readouterr().err


def test_unknown_keys_can_be_renamed_or_dropped_so_the_review_passes(tmp_path, dataset, monkeypatch):
    path = write_config(tmp_path, dataset, learnig_rate=2e-4, dataset={"zzz_unheard_of": 1})
    config = json.loads(path.read_text())
    del config["learning_rate"]
    path.write_text(json.dumps(config))
    asked = scripted(monkeypatch, {}, {"Use these settings": ["y"], "Rename": ["y"], "Drop": ["y"],
                                       "Write these files": ["y"]})
    code, transcript = wizard_run(str(path))
    assert code == 0, transcript
    assert "unknown key 'learnig_rate'; did you mean 'learning_rate'?" in transcript
    # the memory step's message names the user's file, not the wizard's temporary copy of it
    assert "Rename learnig_rate to learning_rate (its value kept)? [Y/n]: " in asked
    assert "Drop zzz_unheard_of (its value 1)? [Y/n]: " in asked
    assert json.loads(path.read_text())["learning_rate"] == 2e-4
    assert "zzz_unheard_of" not in json.loads((tmp_path / "config" / "multidatabackend.json").read_text())[0]


def test_only_local_caption_strategies_and_simpletuner_family_names(tmp_path, dataset, monkeypatch):
    """The wizard writes `type: local` entries: parquet, huggingface and csv captions cannot work there, so they
    are not offered; instanceprompt asks the prompt. kandinsky5_image is SimpleTuner's kandinsky5-image."""
    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"model_family": ["kandinsky5_image"], "model_flavour": ["tiny-random"],
                                   "instance_data_dir": ["images"], "caption_strategy": ["parquet", "3"],
                                   "instance_prompt": ["a photo of sks"], "resolution": ["64"],
                                   "max_train_steps": ["5"], "validation_prompt": ["a circle"]},
                     {"Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert "choose a number from 1 to 3, or one of: textfile, filename, instanceprompt" in transcript
    assert "instance_prompt: " in asked
    config = json.loads((tmp_path / "config" / "config.json").read_text())
    datasets = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert config["model_family"] == "kandinsky5-image"
    assert datasets[0]["caption_strategy"] == "instanceprompt" and datasets[0]["instance_prompt"] == "a photo of sks"


def test_a_new_config_beside_an_existing_dataset_list_edits_that_list(tmp_path, dataset, monkeypatch):
    """No config.json yet, but config/multidatabackend.json exists: its entries are kept (the questions edit its
    trained dataset), never replaced by a fresh list."""
    write_config(tmp_path, dataset, extra_datasets=[{"id": "kept", "type": "local", "dataset_type": "image",
                                                     "instance_data_dir": str(dataset), "disabled": True}])
    (tmp_path / "config" / "config.json").unlink()
    before = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {"model_family": ["1"], "model_flavour": ["tiny-random"], "validation_prompt": ["x"]},
             {"Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert "config/multidatabackend.json exists: its entries are kept" in transcript
    assert json.loads((tmp_path / "config" / "multidatabackend.json").read_text()) == before


def test_the_memory_step_names_the_users_files_when_the_planner_cannot_run(tmp_path, dataset):
    """Its message named the wizard's temporary copy (/tmp/difftune-configure-.../config.json)."""
    from difftune.ui.wizard import Wizard

    path = write_config(tmp_path, dataset, learnig_rate=2e-4)
    out = io.StringIO()
    wizard = Wizard(str(path), out=out)
    assert wizard.planned(24, {"mixed_precision": "bf16"}) is None
    said = out.getvalue()
    assert f"the memory planner could not run: the configuration cannot be used:\n  - {path}: unknown key " \
           "'learnig_rate'" in said and "difftune-configure-" not in said



def test_non_finite_and_float_integer_answers(tmp_path, dataset, monkeypatch):
    """resolution inf crashed the wizard (int(inf)); lora_rank 1e3 was written as 1000.0; GPU memory -8 or nan was
    taken as "no GPU" without a word."""
    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"model_family": ["1"], "model_flavour": ["tiny-random"], "lora_rank": ["1e3"],
                                   "instance_data_dir": ["images"], "resolution": ["inf", "64"],
                                   "max_train_steps": ["5"], "learning_rate": ["nan", "1e-3"],
                                   "validation_prompt": ["a circle"]},
                     {"GPU memory": ["-8", "nan", "0"], "Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert "resolution: inf: Input should be a finite number" in transcript
    assert "-8: give the GPU's memory as a number of GiB" in transcript
    assert "nan: give the GPU's memory as a number of GiB" in transcript
    assert sum(p.startswith("GPU memory available, in GiB") for p in asked) == 3
    config = json.loads((tmp_path / "config" / "config.json").read_text())
    assert config["lora_rank"] == 1000 and isinstance(config["lora_rank"], int)


def test_image_to_image_flavour_asks_for_the_input_folder_and_trains(tmp_path, dataset, monkeypatch):
    """No question asked for the input images of an i2i flavour, so its review could never pass."""
    from difftune.train.loop import train
    from difftune.train.setup import build_run
    from families import make_pairs

    make_pairs(dataset, tmp_path / "inputs")
    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"model_family": ["kandinsky5-image"], "model_flavour": ["tiny-random-i2i"],
                                   "lora_rank": ["4"], "instance_data_dir": ["images"], "resolution": ["64"],
                                   "conditioning.instance_data_dir": ["nope", "inputs"], "max_train_steps": ["2"],
                                   "validation_prompt": ["swap it"]},
                     {"Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert "conditioning.instance_data_dir: " in asked and "'nope' is not a folder" in transcript
    datasets = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert datasets[0]["conditioning_data"] == "images-inputs"
    assert datasets[1] == {"id": "images-inputs", "type": "local", "dataset_type": "conditioning",
                           "instance_data_dir": "inputs"}
    assert check(tmp_path, "config/config.json").returncode == 0
    config = json.loads((tmp_path / "config" / "config.json").read_text())
    config.update(validation_num_inference_steps=1, output_dir=str(tmp_path / "out"))
    (tmp_path / "config" / "config.json").write_text(json.dumps(config))
    run = build_run(load_config("config/config.json"))
    assert train(run).exists() and run.state.step == 2


def test_image_to_image_input_images_generated_from_the_training_images(tmp_path, dataset, monkeypatch):
    """The wizard offers SimpleTuner's generated conditioning beside a folder of input images; an edited config
    keeps its generator, and a text-to-image flavour offers to remove it."""
    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"model_family": ["kandinsky5-image"], "model_flavour": ["tiny-random-i2i"],
                                   "lora_rank": ["4"], "instance_data_dir": ["images"], "resolution": ["64"],
                                   "input_images": ["7", "2"], "max_train_steps": ["2"]},
                     {"Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert "choose a number from 1 to 5" in transcript and not any("conditioning." in p for p in asked)
    datasets = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert datasets[0]["conditioning"] == [{"type": "canny"}] and "conditioning_data" not in datasets[0]
    assert [d["dataset_type"] for d in datasets] == ["image", "text_embeds"]
    done = check(tmp_path, "config/config.json")
    assert done.returncode == 0, done.stdout + done.stderr
    (made,) = (tmp_path / "cache" / "conditioning_data").glob("images_conditioning_canny-*")
    assert len(list(made.glob("*.png"))) == 4

    scripted(monkeypatch, {}, {"Use these settings": ["y"], "Write these files": ["y"]})
    code, transcript = wizard_run("config/config.json")
    assert code == 0 and 'input images: generated from the training images ([{"type": "canny"}])' in transcript
    scripted(monkeypatch, {"model_flavour": ["tiny-random"]},
             {"Remove conditioning": ["y"], "Use these settings": ["y"], "Write these files": ["y"]})
    code, transcript = wizard_run("config/config.json")
    assert code == 0, transcript
    assert "generates input images for image-to-image flavours (conditioning)" in transcript
    assert "conditioning" not in json.loads((tmp_path / "config" / "multidatabackend.json").read_text())[0]


def test_review_refuses_an_output_dir_check_refuses(tmp_path, dataset, monkeypatch):
    """The wizard said "difftune check accepts this configuration" for output_dir /proc/nope, which check refuses."""
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {"model_family": ["1"], "model_flavour": ["tiny-random"], "instance_data_dir": ["images"],
                           "resolution": ["64"], "max_train_steps": ["5"], "validation_prompt": ["a circle"],
                           "output_dir": ["/proc/nope", "out"]},
             {"Write these files": ["y"], "Go through the questions again": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert "output_dir: cannot write in /proc (" in transcript  # /proc takes no new file, even for root
    assert json.loads((tmp_path / "config" / "config.json").read_text())["output_dir"] == "out"


def test_lycoris_is_offered_and_its_config_file_written(tmp_path, dataset, monkeypatch):
    """model_type lora offered no LyCORIS: lora_type is asked, then the algorithm, and a lycoris_config file for it
    is written beside config.json; check accepts the files and they train."""
    from difftune.train.loop import train
    from difftune.train.setup import build_run

    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"model_family": ["1"], "model_flavour": ["tiny-random"], "lora_type": ["lycoris"],
                                   "lycoris.algo": ["lokra", "3"], "instance_data_dir": ["images"],
                                   "resolution": ["64"], "max_train_steps": ["2"], "validation_prompt": ["a circle"]},
                     {"Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert "lycoris.algo [lokr]: " in asked and not any(p.startswith("lora_rank") for p in asked)
    assert "choose a number from 1 to 3, or one of: lokr, locon, loha" in transcript
    config = json.loads((tmp_path / "config" / "config.json").read_text())
    assert config["lora_type"] == "lycoris" and config["lycoris_config"] == "config/lycoris_config.json"
    assert json.loads((tmp_path / "config" / "lycoris_config.json").read_text())["algo"] == "loha"
    result = check(tmp_path, "config/config.json")
    assert result.returncode == 0, result.stderr
    config.update(validation_prompt=None, output_dir=str(tmp_path / "out"))
    (tmp_path / "config" / "config.json").write_text(json.dumps(config))
    run = build_run(load_config("config/config.json"))
    assert train(run).exists() and run.state.step == 2
    # the default lokr file trains too (its factor fits the tiny model)
    (tmp_path / "config" / "lycoris_config.json").write_text(json.dumps(
        __import__("difftune.ui.wizard", fromlist=["x"]).LYCORIS_DEFAULTS["lokr"]))
    config.update(output_dir=str(tmp_path / "out2"))
    (tmp_path / "config" / "config.json").write_text(json.dumps(config))
    run = build_run(load_config("config/config.json"))
    assert train(run).exists() and run.state.step == 2


def test_image_to_video_offers_enough_validation_frames(tmp_path, monkeypatch):
    """i2v with short clips: the offered num_frames (9) left validation with 9 frames, which its review refused
    (17 needed), so the first pass always failed. The wizard offers 17 and says why."""
    from difftune.data.video import synthetic_clip

    clips = tmp_path / "clips"
    clips.mkdir()
    for i in range(2):
        synthetic_clip(clips / f"c{i}.mp4", frames=12, seed=i)
        (clips / f"c{i}.txt").write_text("a moving square")
    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"model_family": ["kandinsky5-video"], "model_flavour": ["tiny-random-i2v"],
                                   "instance_data_dir": ["clips"], "resolution": ["32"], "max_train_steps": ["2"],
                                   "validation_prompt": ["a square"]}, {"Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert "video.num_frames [9]: " in asked and "validation_num_video_frames [17]: " in asked
    assert "image-to-video validation needs at least 17 frames" in transcript
    assert not any(p.startswith("Go through the questions again") for p in asked)  # the first review passed
    assert json.loads((tmp_path / "config" / "config.json").read_text())["validation_num_video_frames"] == 17


def test_full_fine_tune_offer_takes_the_optimizer_training_does_not_warn_about(tmp_path, dataset, monkeypatch):
    """The memory offer for a bf16 full fine-tune kept adamw (or added adamw8bit), and training then warned that it
    loses small updates: the offer now sets adamw_bf16, and the 2-step run says nothing of it."""
    from difftune.train.loop import train
    from difftune.train.setup import build_run

    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {"model_family": ["1"], "model_flavour": ["tiny-random"], "model_type": ["full"],
                           "instance_data_dir": ["images"], "resolution": ["64"], "max_train_steps": ["2"],
                           "learning_rate": ["1e-5"]},
             {"GPU memory": ["16"], "Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    config = json.loads((tmp_path / "config" / "config.json").read_text())
    assert config["mixed_precision"] == "bf16" and config["optimizer"] == "adamw_bf16", transcript
    config.update(output_dir=str(tmp_path / "out"))
    (tmp_path / "config" / "config.json").write_text(json.dumps(config))
    run = build_run(load_config("config/config.json"))
    assert train(run).exists() and run.state.step == 2
    assert "loses small updates" not in (run.output_dir / "events.jsonl").read_text()


def test_validation_resolution_is_written_only_with_a_validation_prompt(tmp_path, dataset, monkeypatch):
    """With the validation prompt left empty, validation_resolution was written anyway, and check then noted it
    unused."""
    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"model_family": ["1"], "model_flavour": ["tiny-random"],
                                   "instance_data_dir": ["images"], "resolution": ["64"], "max_train_steps": ["2"]},
                     {"Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert not any(p.startswith("validation_resolution") for p in asked)
    config = json.loads((tmp_path / "config" / "config.json").read_text())
    assert "validation_resolution" not in config and "validation_prompt" not in config
    result = check(tmp_path, "config/config.json")
    assert result.returncode == 0 and "validation_resolution" not in result.stdout, result.stdout


def test_a_larger_gpu_is_planned_without_the_levers_of_a_smaller_one(tmp_path, dataset, monkeypatch):
    """Rerun with 80 GiB on a config written for a small GPU: the old levers (checkpointing, 8-bit state) stayed,
    with their cost, while the wizard said only "Settings that fit: mixed_precision: bf16"."""
    path = write_config(tmp_path, dataset, model_type="full", mixed_precision="bf16", gradient_checkpointing=True,
                        optimizer="adamw8bit", offload_during_startup=True, seed=5, output_dir="out")
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {}, {"GPU memory": ["80"], "Use these settings": ["y"], "Write these files": ["y"]})
    code, transcript = wizard_run(str(path))
    assert code == 0, transcript
    assert "The config has memory levers: gradient_checkpointing True, optimizer adamw8bit, " \
           "offload_during_startup True; planned without them" in transcript
    assert "Predicted peak without them" in transcript
    config = json.loads(path.read_text())
    assert "gradient_checkpointing" not in config and "offload_during_startup" not in config
    assert config["optimizer"] == "adamw_bf16" and config["seed"] == 5  # the lossless one; the rest kept
    # its cost is in training, which is not this tiny model's peak (caching latents): said so, not "saves 0.0 GiB"
    assert "optimizer adamw_bf16: costs 0.0 GiB of training (not the peak)" in transcript


def test_switching_away_from_an_image_to_image_flavour_offers_to_remove_its_pairs(tmp_path, dataset, monkeypatch):
    """An i2i config edited to a text-to-image flavour kept conditioning_data, which that flavour refuses, and no
    question could remove it."""
    from families import make_pairs

    make_pairs(dataset, tmp_path / "inputs")
    path = write_config(tmp_path, dataset, model_family="kandinsky5-image", model_flavour="tiny-random-i2i",
                        dataset={"conditioning_data": "inputs"}, conditioning_dir=tmp_path / "inputs")
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {"model_flavour": ["tiny-random"]},
             {"Remove conditioning_data": ["y"], "Use these settings": ["y"], "Write these files": ["y"]})
    code, transcript = wizard_run(str(path))
    assert code == 0, transcript
    assert "flavour tiny-random does not train on image pairs, but dataset 'train' has conditioning_data 'inputs'" \
        in transcript
    datasets = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert "conditioning_data" not in datasets[0]
    assert [d["dataset_type"] for d in datasets] == ["image", "text_embeds"]
