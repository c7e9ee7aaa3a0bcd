"""The wizard (`difftune configure`) editing configs it did not write, and the choices a change of family, flavour
or folder leaves: each test a case a new user met (tests/test_wizard.py has the rest and the helpers)."""

from __future__ import annotations

import json
import shutil

from conftest import write_config
from test_wizard import check, scripted, wizard_run


def test_when_nothing_fits_the_config_keeps_its_levers(tmp_path, dataset, monkeypatch):
    """A GPU too small for anything: the wizard said "Settings that fit: mixed_precision: bf16" and, accepted,
    deleted every memory setting the config had. Now it says nothing fits, offers the most frugal levers, and keeps
    the config's."""
    path = write_config(tmp_path, dataset, mixed_precision="bf16", gradient_checkpointing=True,
                        offload_during_startup=True, output_dir="out")
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {}, {"GPU memory": ["0.000001"], "Use these settings": ["y"], "Write these files": ["y"]})
    code, transcript = wizard_run(str(path))
    assert code == 0, transcript
    assert "nothing fits in 1e-06 GiB" in transcript and "(your memory settings are kept)" in transcript
    assert "Settings that fit" not in transcript
    assert "Nothing fits, so the most frugal settings, added to those the config has:" in transcript
    config = json.loads(path.read_text())
    assert config["gradient_checkpointing"] is True and config["offload_during_startup"] is True


def test_a_simpletuner_environment_edits_its_own_dataset_list(tmp_path, dataset, monkeypatch):
    """config/foo/config.json naming "foo/multidatabackend.json" (relative to the configs folder, as SimpleTuner's
    web UI writes it): the wizard wrote a bare list to ./foo/multidatabackend.json, which check then trained from."""
    path = write_config(tmp_path, dataset, output_dir="out", dataset={"repeats": 3})
    env = tmp_path / "config" / "foo"
    env.mkdir()
    (tmp_path / "config" / "multidatabackend.json").rename(env / "multidatabackend.json")
    config = json.loads(path.read_text())
    (env / "config.json").write_text(json.dumps({**config, "data_backend_config": "foo/multidatabackend.json"}))
    path.unlink()
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {}, {"GPU memory": ["24"], "Use these settings": ["y"], "Write these files": ["y"]})
    code, transcript = wizard_run("config/foo/config.json")
    assert code == 0, transcript
    assert not (tmp_path / "foo").exists()
    assert json.loads((env / "multidatabackend.json").read_text())[0]["repeats"] == 3
    assert json.loads((env / "config.json").read_text())["data_backend_config"] == "foo/multidatabackend.json"


def test_switching_from_a_video_family_to_an_image_one_offers_to_remove_what_it_refuses(tmp_path, dataset,
                                                                                     monkeypatch):
    """A Kandinsky 5 Video config edited to Lumina2: the video dataset and the video keys stayed, the review
    refused them at every pass, and no question could remove them."""
    from families import make_clips

    clips = make_clips(tmp_path / "clips", count=2, frames=9)
    path = write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random",
                        validation_num_video_frames=9, framerate=24, output_dir="out",
                        dataset={"id": "clips", "dataset_type": "video", "resolution": 32,
                                 "video": {"num_frames": 9}})
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {"model_family": ["1"], "model_flavour": ["tiny-random"],
                           "instance_data_dir": [str(dataset)], "resolution": ["64"]},
             {"Remove the dataset 'clips'": ["y"], "Remove them": ["y"], "Use these settings": ["y"],
              "Write these files": ["y"]})
    code, transcript = wizard_run(str(path))
    assert code == 0, transcript
    assert "dataset 'clips' holds clips, and lumina2 trains on images" in transcript
    assert "validation_num_video_frames, framerate: for video families only" in transcript
    config = json.loads(path.read_text())
    assert "framerate" not in config and "validation_num_video_frames" not in config
    datasets = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert [d["dataset_type"] for d in datasets] == ["image", "text_embeds"]
    assert check(tmp_path, str(path)).returncode == 0


def test_a_disabled_entry_is_not_the_one_edited_and_a_new_id_is_free(tmp_path, dataset, monkeypatch):
    """The questions edited the first image entry even when it was disabled (the answers were written and never
    trained); a folder named text-embeds gave the new dataset the text cache's id, refused with no way out."""
    path = write_config(tmp_path, dataset, output_dir="out", dataset={"disabled": True, "id": "old"})
    folder = tmp_path / "text-embeds"
    shutil.copytree(dataset, folder)
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {"instance_data_dir": [str(folder)], "resolution": ["64"]},
             {"Use these settings": ["y"], "Write these files": ["y"]})
    code, transcript = wizard_run(str(path))
    assert code == 0, transcript
    datasets = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert [(d["id"], d.get("instance_data_dir")) for d in datasets if d["dataset_type"] == "image"] == [
        ("text-embeds-2", str(folder)), ("old", str(dataset))]


def test_a_downloaded_dataset_can_be_edited(tmp_path, dataset, monkeypatch):
    """A type 'huggingface' entry: the wizard asked its instance_data_dir as a required folder of images and
    looped on "this one is required" (the folder is where the download goes, and optional)."""
    from test_source_huggingface import hub_folder

    rows = [(p.read_bytes(), p.with_suffix(".txt").read_text(), [], None) for p in sorted(dataset.glob("*.png"))]
    source = hub_folder(tmp_path / "hub", rows=rows)
    path = write_config(tmp_path, dataset, output_dir="out", dataset={
        "type": "huggingface", "dataset_name": str(source), "instance_data_dir": None, "caption_strategy": None,
        "cache_dir": str(tmp_path / "hf-cache")})
    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"resolution": ["64"]}, {"Use these settings": ["y"], "Write these files": ["y"]})
    code, transcript = wizard_run(str(path))
    assert code == 0, transcript
    assert "type 'huggingface': downloaded from its source" in transcript
    assert not any(p.startswith("instance_data_dir") for p in asked)
    assert json.loads((tmp_path / "config" / "multidatabackend.json").read_text())[0]["type"] == "huggingface"


def test_the_review_shows_what_check_notes(tmp_path, dataset, monkeypatch):
    """The review said only "difftune check accepts this configuration." where check printed notes too."""
    first = sorted(dataset.glob("*.txt"))[0]
    first.write_text("")
    path = write_config(tmp_path, dataset, output_dir="out", dataset={"instance_prompt": "sks"})
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {}, {"Use these settings": ["y"], "Write these files": ["y"]})
    code, transcript = wizard_run(str(path))
    assert code == 0, transcript
    assert f"note: dataset 'train': {first.with_suffix('.png').name}: empty caption file" in transcript
    assert "multidatabackend.json: dataset 'train': instance_prompt 'sks' is in no caption" in transcript


def test_a_folder_as_the_config_path_holds_config_json(tmp_path, dataset, monkeypatch):
    """`difftune configure "my cfg/"` wrote a config file named "my cfg" (the list beside it, in the working
    folder), and the next-step line did not quote the path."""
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {"model_family": ["1"], "model_flavour": ["tiny-random"], "instance_data_dir": [str(dataset)],
                           "resolution": ["64"], "max_train_steps": ["2"]}, {"Write these files": ["y"]})
    code, transcript = wizard_run("my cfg/")
    assert code == 0, transcript
    assert (tmp_path / "my cfg" / "config.json").is_file() and (tmp_path / "my cfg" / "multidatabackend.json").is_file()
    assert "next: difftune train --config 'my cfg/config.json'" in transcript


def test_defaults_offered_for_a_full_fine_tune_and_for_clips(tmp_path, dataset, monkeypatch):
    """A full fine-tune was offered LoRA's learning rate 1e-4 (the specs: 1e-5 to 5e-6), clips the image default
    resolution 1024 (the specs' video examples train at 512)."""
    from families import make_clips

    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"model_family": ["1"], "model_flavour": ["tiny-random"], "model_type": ["full"],
                                   "instance_data_dir": [str(dataset)], "resolution": ["64"],
                                   "max_train_steps": ["2"]}, {"Write these files": ["n"]})
    wizard_run(None)
    assert "learning_rate [1e-05]: " in asked
    make_clips(tmp_path / "clips", count=1, frames=9)
    (tmp_path / "clips" / "big.mp4").unlink(missing_ok=True)
    asked = scripted(monkeypatch, {"model_family": ["3"], "model_flavour": ["tiny-random"],
                                   "instance_data_dir": [str(tmp_path / "clips")]}, {"Write these files": ["n"]})
    wizard_run(None)
    assert any(p.startswith("resolution [") for p in asked), asked
    assert "resolution [1024]: " not in asked


def test_a_model_path_beside_the_flavour_is_said(tmp_path, dataset, monkeypatch):
    """A changed flavour was taken without a word while pretrained_model_name_or_path (which wins) stayed."""
    source = str(tmp_path / "my-lumina2")  # what it holds is the review's business: the note comes before
    (tmp_path / "my-lumina2").mkdir()
    path = write_config(tmp_path, dataset, output_dir="out", pretrained_model_name_or_path=source)
    monkeypatch.chdir(tmp_path)
    scripted(monkeypatch, {}, {"Use these settings": ["y"], "Write these files": ["n"]})
    _, transcript = wizard_run(str(path))
    assert f"note: the config loads pretrained_model_name_or_path {source!r}, not the flavour's own" in transcript


def test_a_list_min_frames_above_the_clips_is_asked_too(tmp_path, monkeypatch):
    """An existing list with the spec's num_frames 61 and min_frames 61, over 12-frame clips: the wizard offered
    num_frames 9, and the review then refused every clip (below min_frames 61), which no question asked."""
    from families import make_clips

    clips = make_clips(tmp_path / "clips", count=2, frames=12)
    path = write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random",
                        output_dir="out", dataset={"id": "clips", "dataset_type": "video", "resolution": 32,
                                                   "video": {"num_frames": 61, "min_frames": 61}})
    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {}, {"Use these settings": ["y"], "Write these files": ["y"]})
    code, transcript = wizard_run(str(path))
    assert code == 0, transcript
    assert "video.num_frames [9]: " in asked and "video.min_frames [9]: " in asked
    datasets = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    assert datasets[0]["video"] == {"num_frames": 9, "min_frames": 9}


def test_image_to_video_validation_frames_are_asked_again_when_too_few(tmp_path, monkeypatch):
    """tiny-random-i2v: 9 validation frames passed the question (the wizard itself said 9 would be refused) and
    failed the review; now the question is asked again."""
    from families import make_clips

    make_clips(tmp_path / "clips", count=2, frames=24)
    monkeypatch.chdir(tmp_path)
    asked = scripted(monkeypatch, {"model_family": ["3"], "model_flavour": ["tiny-random-i2v"],
                                   "instance_data_dir": ["clips"], "resolution": ["32"], "max_train_steps": ["5"],
                                   "validation_prompt": ["a square"], "validation_num_video_frames": ["9", "17"]},
                     {"Write these files": ["y"]})
    code, transcript = wizard_run(None)
    assert code == 0, transcript
    assert sum(p.startswith("validation_num_video_frames") for p in asked) == 2
    assert json.loads((tmp_path / "config" / "config.json").read_text())["validation_num_video_frames"] == 17
