"""Video configuration and frame math: pure functions and config errors, no model loaded."""

import json

import pytest

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.data.frames import FrameRule, bucket_name, frame_times, plan_clip, resampled_count, vae_frames


def problems(path) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path)
    return "\n".join(e.value.problems)


def video_config(tmp_path, folder, video=None, **overrides):
    dataset = {"dataset_type": "video", "instance_data_dir": str(folder), "resolution": 32}
    if video is not None:
        dataset["video"] = video
    overrides.setdefault("model_family", "kandinsky5-video")
    overrides.setdefault("model_flavour", "tiny-random")
    return write_config(tmp_path, folder, dataset=dataset, **overrides)


def test_resampled_count():
    assert resampled_count(48, 47 / 24, 24.0, 24.0) == 48  # same rate: unchanged
    assert resampled_count(100, 99 / 30, 30.0, 24.0) == 80  # 3.3 s at 24 fps: frames at 0, 1/24, ... 79/24
    assert resampled_count(25, 24 / 12, 12.0, 24.0) == 50  # upsampling holds frames; the last plays 1/12 s
    assert resampled_count(12, 11 / 12, 12.0, 24.0) == 24  # 1 s: 24 frames at 24 fps, not 23
    assert resampled_count(30, 29 / 25, 25.0, 24.0) == 29  # 1.2 s
    assert resampled_count(20, 19 * 0.04, 25.0, 24.0) == 20  # a GIF of 40 ms frames: 0.8 s
    assert resampled_count(12, 11 / 12, 12.0, 24.0, variable=True) == 23  # variable: to the last stamp only
    assert resampled_count(1, 0.0, 24.0, 24.0) == 1
    assert resampled_count(0, 0.0, 24.0, 24.0) == 0
    assert frame_times(3, 24.0) == [0.0, 1 / 24, 2 / 24]


def test_vae_frames_are_4k_plus_1():
    assert [vae_frames(n) for n in (0, 1, 4, 5, 8, 9, 60, 61, 62)] == [0, 1, 1, 5, 5, 9, 57, 61, 61]
    assert vae_frames(60, 16) == 49 and vae_frames(48, 16) == 33  # 1 + multiples of lcm(4, 16)
    assert vae_frames(30, 6) == 25  # lcm(4, 6) = 12


def test_plan_aspect_ratio_trims_and_reports_short_clips():
    rule = FrameRule(num_frames=33, frame_rate=24.0)
    assert plan_clip(33, 24.0, rule).frames == 33 and plan_clip(33, 24.0, rule).note is None
    long = plan_clip(80, 30.0, rule)
    assert long.frames == 33 and "trimmed to the first 33 of 80" in long.note and "30 to 24 fps" in long.note
    short = plan_clip(20, 24.0, rule)
    assert short.frames is None and "shorter than num_frames 33" in short.problem and "resolution_frames" in short.problem
    assert "below min_frames 40" in plan_clip(35, 24.0, FrameRule(33, 24.0, min_frames=40)).problem
    assert "above max_frames 50" in plan_clip(60, 24.0, FrameRule(33, 24.0, max_frames=50)).problem


def test_plan_resolution_frames():
    rule = FrameRule(num_frames=61, frame_rate=24.0, bucket_strategy="resolution_frames", frame_interval=8)
    assert plan_clip(30, 24.0, rule).frames == 25  # 1 + 3 * 8
    assert plan_clip(30, 24.0, rule).note == "trimmed to the first 25 of 30 frames (frame_interval 8)"
    assert plan_clip(62, 24.0, rule).note == "trimmed to the first 57 of 62 frames (num_frames 61, frame_interval 8)"
    four = FrameRule(num_frames=17, frame_rate=24.0, bucket_strategy="resolution_frames")
    assert plan_clip(24, 24.0, four).note == "trimmed to the first 17 of 24 frames (num_frames 17)"
    assert plan_clip(12, 24.0, four).note == "trimmed to the first 9 of 12 frames (4k+1)"
    assert plan_clip(200, 24.0, rule).frames == 57  # capped by num_frames, then rounded down to 1 + 8k
    assert plan_clip(9, 24.0, rule).frames == 9 and plan_clip(9, 24.0, rule).note is None
    too_short = plan_clip(12, 24.0, FrameRule(61, 24.0, "resolution_frames", min_frames=10, frame_interval=8))
    assert too_short.frames is None and "below min_frames 10" in too_short.problem  # 12 rounds down to 9
    assert bucket_name(64, 32, 25) == "64x32@25" and bucket_name(64, 32) == "64x32"


def test_video_block_validation(tmp_path):
    folder = tmp_path / "clips"
    folder.mkdir()
    text = problems(video_config(tmp_path, folder, {"num_frames": 60}))
    assert "num_frames 60 is not 4k+1" in text and "57 or 61" in text
    text = problems(video_config(tmp_path, folder, {"num_frames": 33, "max_frames": 20}))
    assert "max_frames 20 is below num_frames 33" in text
    assert "bucket_strategy" in problems(video_config(tmp_path, folder, {"bucket_strategy": "frames"}))
    assert "frame_interval applies to bucket_strategy 'resolution_frames'" in problems(
        video_config(tmp_path, folder, {"frame_interval": 8})
    )
    # a misspelt key inside the block gets the closest one; a block key beside the entry's keys is pointed there
    assert "video.num_frame: unknown key 'num_frame'; did you mean 'num_frames'?" in problems(
        video_config(tmp_path, folder, {"num_frame": 33}))
    flat = video_config(tmp_path, folder, {})
    backend = flat.parent / "multidatabackend.json"
    entries = json.loads(backend.read_text())
    entries[0]["num_frames"] = 33
    backend.write_text(json.dumps(entries))
    assert "num_frames belongs in the 'video' block: write \"video\": {\"num_frames\": 33}" in problems(flat)
    # 9 frames with frame_interval 3 (counts 1, 13, 25, ...): every clip trained as a still, with no error
    text = problems(video_config(tmp_path, folder, {"num_frames": 9, "frame_interval": 3,
                                                    "bucket_strategy": "resolution_frames"}))
    assert "every clip would train on 1 frame; use num_frames 13 or more, or frame_interval 2" in text
    assert "min_frames is larger than max_frames" in problems(
        video_config(tmp_path, folder, {"min_frames": 50, "max_frames": 40, "bucket_strategy": "resolution_frames"})
    )
    run = load_config(video_config(tmp_path, folder))  # the block's defaults apply when it is left out
    assert run.datasets.images[0].video.num_frames == 61


def test_video_keys_checked_before_any_model(tmp_path):
    folder = tmp_path / "clips"
    folder.mkdir()
    text = problems(video_config(tmp_path, folder, validation_num_video_frames=48))
    assert "validation_num_video_frames 48 is not 4k+1" in text and "45 or 49" in text
    run = load_config(video_config(tmp_path, folder, validation_num_video_frames=49, frame_rate=12,
                                   vae_enable_patch_conv=True, offload_during_startup=True))
    assert run.train.video_fps() == 12.0 and run.train.vae_enable_patch_conv
    assert load_config(video_config(tmp_path, folder)).train.video_fps() == 24.0  # the default
    images = tmp_path / "images"
    images.mkdir()
    text = problems(write_config(tmp_path, images, frame_rate=24, validation_num_video_frames=9))
    assert "validation_num_video_frames and frame_rate apply only to video families" in text
    text = problems(write_config(tmp_path, folder, dataset={"dataset_type": "video"}))  # lumina2 + clips
    assert "video datasets need a video family (kandinsky5-video)" in text
    assert "video block applies to dataset_type 'video'" in problems(
        write_config(tmp_path, images, dataset={"video": {"num_frames": 9}})
    )


def test_image_to_video_datasets(tmp_path):
    clips, stills = tmp_path / "clips", tmp_path / "stills"
    clips.mkdir()
    stills.mkdir()
    path = video_config(tmp_path, clips, model_flavour="tiny-random-i2v")
    backend = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    backend.append({"id": "stills", "dataset_type": "image", "instance_data_dir": str(stills)})
    (tmp_path / "config" / "multidatabackend.json").write_text(json.dumps(backend))
    text = problems(path)
    assert "'stills'" in text and "trains on clips" in text and "eval_dataset_id" in text
    cfg = json.loads(path.read_text()) | {"validation_using_datasets": True, "eval_dataset_id": "stills"}
    path.write_text(json.dumps(cfg))
    run = load_config(path)  # named as the validation input: used for that only, not trained on
    assert [ds.id for ds in run.datasets.images] == ["train"] and list(run.datasets.validation_only) == ["stills"]
    paired = write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random-i2v",
                          dataset={"dataset_type": "video", "conditioning_data": "inputs"}, conditioning_dir=stills)
    text = problems(paired)
    assert "first frame as the input image by themselves" in text and "remove conditioning_data" in text


def test_i2v_validation_needs_17_frames(tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    text = problems(video_config(tmp_path, clips, model_flavour="tiny-random-i2v", validation_prompt="a cat",
                                 validation_num_video_frames=9))
    assert "config.json: validation_num_video_frames: 9 is too few for image-to-video" in text
    text = problems(video_config(tmp_path, clips, {"num_frames": 9}, model_flavour="tiny-random-i2v",
                                 validation_prompt="a cat"))
    assert "9 (from the first video dataset's num_frames)" in text
    load_config(video_config(tmp_path, clips, {"num_frames": 9}, model_flavour="tiny-random-i2v",
                             validation_prompt="a cat", validation_num_video_frames=17))
    load_config(video_config(tmp_path, clips, {"num_frames": 9}, model_flavour="tiny-random"))  # t2v: fine


def test_i2v_clips_need_five_frames(tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    text = problems(video_config(tmp_path, clips, {"num_frames": 1}, model_flavour="tiny-random-i2v"))
    assert "video.num_frames 1: image-to-video trains the frames after the first latent frame" in text
    load_config(video_config(tmp_path, clips, {"num_frames": 1}))  # text-to-video: one-frame clips are fine
    from difftune.train.plan import frame_rule

    run = load_config(video_config(tmp_path, clips, {"num_frames": 9, "bucket_strategy": "resolution_frames"},
                                   model_flavour="tiny-random-i2v"))
    assert frame_rule(run, run.datasets.images[0]).min_frames == 5


def test_crepa_keys_of_the_spec(tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    cfg = load_config(video_config(tmp_path, clips, crepa_enabled=True, crepa_block_index=8, crepa_lambda=0.5,
                                   crepa_adjacent_distance=1, crepa_adjacent_tau=1.0)).train
    assert cfg.crepa_enabled and cfg.crepa_block_index == 8
    load_config(video_config(tmp_path, clips, crepa_enabled=True, crepa_drop_vae_encoder=True))  # t2v: decoding only
    load_config(video_config(tmp_path, clips, crepa_enabled=False, crepa_drop_vae_encoder=True))


def test_validation_videos_play_at_the_rate_the_clips_trained_at(tmp_path):
    """The dataset's video.frame_rate when the config sets none: a validation MP4 of clips trained at 12 fps was
    written at 24 fps (played twice as fast), and the model card's export_to_video said 24."""
    from difftune.config.dataset_entry_keys import validation_video_fps

    clips = tmp_path / "clips"
    clips.mkdir()
    run = load_config(video_config(tmp_path, clips, {"num_frames": 9, "frame_rate": 12}))
    assert validation_video_fps(run.train, run.datasets) == 12
    run = load_config(video_config(tmp_path / "set", clips, {"num_frames": 9, "frame_rate": 12}, frame_rate=30))
    assert validation_video_fps(run.train, run.datasets) == 30  # the config's own wins
    run = load_config(video_config(tmp_path / "none", clips, {"num_frames": 9}))
    assert validation_video_fps(run.train, run.datasets) == 24


def test_a_validation_rate_other_than_the_clips_is_noted(tmp_path):
    """The config's frame_rate 24 with a dataset trained at 12 fps wrote samples that played twice as fast, without
    a word; without a prompt nothing is written, so nothing is said."""
    clips = tmp_path / "clips"
    clips.mkdir()
    run = load_config(video_config(tmp_path, clips, {"num_frames": 9, "frame_rate": 12}, frame_rate=24,
                                   validation_prompt="a cat"))
    (note,) = [n for n in run.notes() if "video.frame_rate" in n]
    assert "dataset 'train': its clips train at 12 fps" in note and "written at 24 fps (the config's frame_rate)" in note
    assert "2x as fast" in note and "set frame_rate to 12" in note
    same = load_config(video_config(tmp_path / "same", clips, {"num_frames": 9, "frame_rate": 12}, frame_rate=12,
                                    validation_prompt="a cat"))
    unprompted = load_config(video_config(tmp_path / "quiet", clips, {"num_frames": 9, "frame_rate": 12},
                                          frame_rate=24))
    assert not [n for r in (same, unprompted) for n in r.notes() if "video.frame_rate" in n]
