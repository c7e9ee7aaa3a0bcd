"""Trackers (report_to), CLIP evaluation plumbing and the config checks of both.

One 2-step run with `report_to: all` (TensorBoard and W&B offline) and CLIP evaluation with each validation
(a tiny random CLIP saved to a folder): the tracker files are read back and compared with the event log,
and the CLIP scores with a fresh scoring of the written samples.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.config.reporting_keys import PIPELINES
from difftune.models.tiny_clip import build_tiny_clip
from difftune.prompt_library import BUILTIN_PROMPTS
from difftune.train.loop import train
from difftune.train.setup import build_run


def events(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> Path:
    return build_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


def wandb_records(run_dir: Path, wait_s: float = 60.0) -> list:
    """The records of an offline W&B run, read from its .wandb file once wandb's own process has written the run's
    exit record (it writes the file after `finish()` returns; on a loaded machine, later)."""
    deadline = time.monotonic() + wait_s
    while True:
        records = _read_wandb(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _read_wandb(run_dir: Path) -> list:
    """The .wandb file is a LevelDB-style log of protobuf records: 7-byte file header, 32 KiB blocks, each record
    chunk with a 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (length == 0 and kind == 0) or pos + 7 + length > len(data):  # the end, or a record still being written
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    return [flat({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
            for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "history"]


def flat(row: dict) -> dict:
    """An image's fields as keys of their own (newer W&B writes them so; 0.17 nests them in one value)."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out |= {f"{key}/{k}": v for k, v in value.items()}
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny_clip):
    """2 steps, validation at step 1 and at the end, CLIP-scored; TensorBoard and W&B (offline)."""
    root = tmp_path_factory.mktemp("tracked")
    from difftune.demo import make_dataset

    make_dataset(root / "images", count=2)
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    path = write_config(root, root / "images", max_train_steps=2, report_to="all", tracker_project_name="proj",
                        tracker_run_name="run-a", validation_prompt="a red circle", validation_resolution="32x32",
                        validation_num_inference_steps=1, validation_step_interval=1,
                        validation_disable_unconditional=True, evaluation_type="clip",
                        evaluation_clip_model=str(tiny_clip), layersync_enabled=True, layersync_student_block=1,
                        layersync_teacher_block=2)
    try:
        run = build_run(load_config(path))
        train(run)
    finally:
        mp.undo()
    return run.output_dir


def test_tensorboard_has_the_event_log_values(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = events(tracked_run)
    acc = EventAccumulator(str(tracked_run / "tensorboard" / "proj"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert loss == pytest.approx({e["step"]: e["loss"] for e in log if e["event"] == "step"}, rel=1e-6)
    assert [e.step for e in acc.Scalars("train/lr")] == [1, 2]
    assert [e.step for e in acc.Scalars("train/step_time_s")] == [1, 2]
    synced = {e.step: e.value for e in acc.Scalars("train/layersync_similarity")}  # a regularizer's figure
    assert synced == pytest.approx({e["step"]: e["layersync_similarity"] for e in log if e["event"] == "step"})
    phases = {e["phase"].replace(" ", "_") for e in log if e["event"] == "memory"}
    assert phases >= {"model_load", "caching", "first_optimizer_step"}
    assert {f"memory/{p}/rss_peak_gib" for p in phases} <= set(tags["scalars"])
    scores = {e["step"]: e["value"] for e in log if e["event"] == "evaluation"}
    assert sorted(scores) == [1, 2]  # validation at step 1, and the final one
    assert {e.step: e.value for e in acc.Scalars("eval/clip_score")} == pytest.approx(scores, rel=1e-6)
    images = [t for t in tags["images"] if t.startswith("validation/")]
    assert "validation/32x32" in images, images  # the main prompt: its size right under validation/
    assert {e.step for e in acc.Images("validation/32x32")} == {1, 2}


def test_wandb_offline_has_the_event_log_values(tracked_run):
    log = events(tracked_run)
    rows = wandb_history(tracked_run)
    loss = {r["_step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert loss == pytest.approx({e["step"]: e["loss"] for e in log if e["event"] == "step"}, rel=1e-6)
    scores = {r["_step"]: r["eval/clip_score"] for r in rows if "eval/clip_score" in r}
    assert scores == pytest.approx({e["step"]: e["value"] for e in log if e["event"] == "evaluation"}, rel=1e-6)
    images = [r["validation/32x32/filenames"][0] for r in rows if "validation/32x32/_type" in r]
    files = next(tracked_run.glob("wandb/offline-run-*/files"))
    assert len(images) == 2 and all((files / image).is_file() for image in images), images
    config = {i.key: json.loads(i.value_json) for r in wandb_records(tracked_run)
              if r.WhichOneof("record_type") == "config" for i in r.config.update}
    assert config.get("validation_prompt") == "a red circle" and config.get("lora_rank") == 4, config


def test_clip_scores_are_the_samples_scores(tracked_run, tiny_clip):
    """Each evaluation event's score is CLIP's score of the sample written at that step, against its prompt."""
    import torch

    from difftune.train.evaluation import ClipScorer

    log = events(tracked_run)
    scorer = ClipScorer(str(tiny_clip))
    for event in (e for e in log if e["event"] == "evaluation"):
        (sample,) = [e["path"] for e in log if e["event"] == "sample" and e["step"] == event["step"]]
        expected = scorer([Image.open(sample)], ["a red circle"], torch.device("cpu"))[0]
        assert event["scores"] == pytest.approx({"validation-32x32": expected}, abs=1e-4)
        assert event["value"] == pytest.approx(expected, abs=1e-4)
    # the other direction: a different prompt scores differently (the text is used)
    other = scorer([Image.open(sample)], ["a green car on a road"], torch.device("cpu"))[0]
    assert other != pytest.approx(expected, abs=1e-4)


def test_eval_steps_interval_and_num_eval_images(tmp_path, dataset, tiny_clip):
    """eval_steps_interval 1 over 2 steps: evaluations at steps 1 and 2, of the first num_eval_images prompts,
    and no validation files beyond the final validation's."""
    path = write_config(tmp_path, dataset, max_train_steps=2, validation_prompt="a red circle",
                        validation_prompt_library=True, validation_resolution="32x32",
                        validation_num_inference_steps=1, validation_disable_unconditional=True,
                        evaluation_type="clip", eval_steps_interval=1, num_eval_images=2,
                        evaluation_clip_model=str(tiny_clip))
    run = build_run(load_config(path))
    # validation_prompt_library: the built-in prompts follow validation_prompt
    assert [r.prompt for r in run.validation] == ["a red circle", *BUILTIN_PROMPTS.values()]
    run.validation = run.validation[:3]  # sampling all nine takes long on a shared CPU; three show the limit
    train(run)
    log = events(run.output_dir)
    evaluations = [e for e in log if e["event"] == "evaluation"]
    assert [e["step"] for e in evaluations] == [1, 2]
    assert all(list(e["scores"]) == ["validation-32x32", "portrait-32x32"] for e in evaluations)
    samples = [e for e in log if e["event"] == "sample"]
    assert {e["step"] for e in samples} == {2} and len(samples) == 3
    # `prompt` names each prompt, `text` is the prompt itself (the web UI's captions show it)
    assert [(e["prompt"], e["text"]) for e in samples] == [(r.name or "validation", r.prompt) for r in run.validation]
    assert len(list((run.output_dir / "validation").glob("*.png"))) == 3


def test_an_evaluation_at_a_validation_step_scores_its_samples(tmp_path, dataset, tiny_clip, monkeypatch):
    """An evaluation due at a validation's step scores that validation's live samples (same weights, same seeds)
    instead of sampling them again: at step 1 the interval's validation, at the last step the final one (the
    evaluation waits for it). With validation_randomize (other seeds) it samples its own."""
    from difftune.train import validation

    calls = []
    real = validation._sample_requests
    monkeypatch.setattr(validation, "_sample_requests", lambda run, *a, **k: calls.append(run.state.step) or real(run, *a, **k))
    for randomize, expected in ((False, [1, 2]), (True, [1, 1, 2, 2])):
        calls.clear()
        path = write_config(tmp_path / str(randomize), dataset, max_train_steps=2, validation_prompt="a red circle",
                            validation_resolution="32x32", validation_num_inference_steps=1,
                            validation_disable_unconditional=True, validation_step_interval=1,
                            validation_randomize=randomize, evaluation_type="clip", eval_steps_interval=1,
                            evaluation_clip_model=str(tiny_clip))
        run = build_run(load_config(path))
        train(run)
        log = events(run.output_dir)
        assert [e["step"] for e in log if e["event"] == "evaluation"] == [1, 2]
        assert calls == expected, randomize
        assert run.validated is None  # the samples are not kept past their evaluation


def test_ui_summary_charts_clip_scores(tracked_run, tmp_path):
    """The web UI's run detail carries the CLIP scores its chart draws."""
    from difftune.ui.runs import Run as UIRun

    (tmp_path / "run.json").write_text(json.dumps({"id": "r", "output_dir": str(tracked_run)}))
    ui_run = UIRun(tmp_path)
    ui_run.read_events()
    scores = [[e["step"], e["value"]] for e in events(tracked_run) if e["event"] == "evaluation"]
    assert len(scores) == 2 and ui_run.summary(detail=True)["evaluations"] == scores


# --- config checks ---------------------------------------------------------------------------------


def test_missing_tracker_package_is_a_config_error(tmp_path, dataset, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"report_to 'wandb' needs the wandb package.*pip install"):
        load_config(write_config(tmp_path, dataset, report_to="wandb"))
    load_config(write_config(tmp_path, dataset, report_to="tensorboard"))


def test_guidance_rescale_is_refused_naming_the_pipeline(tmp_path, dataset):
    with pytest.raises(ConfigError, match=r"validation_guidance_rescale 0.7: lumina2 samples with diffusers' "
                                          r"Lumina2Pipeline, whose __call__ takes no guidance_rescale"):
        load_config(write_config(tmp_path, dataset, validation_guidance_rescale=0.7))
    assert load_config(write_config(tmp_path, dataset, validation_guidance_rescale=0.0))


def test_the_named_pipelines_take_no_guidance_rescale():
    """The refusal's reason is true of the installed diffusers (a version that adds it fails here)."""
    import diffusers

    for names in PIPELINES.values():
        for name in names:
            params = inspect.signature(getattr(diffusers, name).__call__).parameters
            assert "guidance_scale" in params and "guidance_rescale" not in params, name


@pytest.mark.parametrize("keys, message", [
    ({"push_to_hub": True}, "push_to_hub needs hub_model_id"),
    ({"push_checkpoints_to_hub": True, "hub_model_id": "me/x"}, "set push_to_hub to true"),
    ({"evaluation_type": "clip", "validation_prompt": None}, "evaluation_type 'clip' scores validation samples"),
])
def test_hub_and_evaluation_checks(tmp_path, dataset, keys, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(tmp_path, dataset, **keys))


def test_a_missing_clip_folder_fails_at_check_time(tmp_path, dataset, tiny_clip):
    keys = dict(evaluation_type="clip", validation_prompt="a red circle")
    with pytest.raises(ConfigError, match="evaluation_clip_model: the folder '/nowhere/clip' does not exist"):
        load_config(write_config(tmp_path, dataset, evaluation_clip_model="/nowhere/clip", **keys))
    load_config(write_config(tmp_path, dataset, evaluation_clip_model=str(tiny_clip), **keys))
    load_config(write_config(tmp_path, dataset, **keys))  # the default: a hub id, downloaded at the first evaluation
    load_config(write_config(tmp_path, dataset, evaluation_clip_model="/nowhere/clip"))  # evaluation off: unused


def test_prompt_library_names_are_kept_and_varied():
    assert 6 <= len(BUILTIN_PROMPTS) <= 8 and len(set(BUILTIN_PROMPTS.values())) == len(BUILTIN_PROMPTS)
    assert {"portrait", "landscape", "lettering", "animal", "closeup", "architecture"} <= set(BUILTIN_PROMPTS)


# --- units ------------------------------------------------------------------------------------------


class FakeTracker:
    def __init__(self, name):
        self.name, self.logged, self.images = name, [], []

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, values))

    def log_images(self, values, step=None, **kwargs):
        self.images.append((step, {k: np.shape(v) for k, v in values.items()}, kwargs))


def test_videos_go_to_wandb_as_video_and_everywhere_as_the_contact_sheet(tmp_path):
    """A video sample: the MP4 to W&B as a wandb.Video, to TensorBoard nothing (its contact sheet PNG is a
    sample event of its own, logged as an image by every tracker)."""
    import wandb

    from difftune.data.video import write_mp4
    from difftune.train.trackers import TrackerForwarder

    frames = [Image.new("RGB", (16, 16), (i * 40, 0, 0)) for i in range(5)]
    write_mp4(frames, tmp_path / "v.mp4", 8.0)
    frames[0].save(tmp_path / "v.png")
    trackers = [FakeTracker("tensorboard"), FakeTracker("wandb")]

    class Accelerator:
        def __init__(self):
            self.trackers = trackers

        def init_trackers(self, *a, **k):
            pass

    from difftune.config.schema import TrainConfig

    forward = TrackerForwarder(TrainConfig(model_family="kandinsky5-video", max_train_steps=1), Accelerator(), tmp_path)
    base = {"step": 3, "prompt": "validation", "size": "16x16@5", "ema": False}
    forward("sample", {**base, "path": str(tmp_path / "v.mp4")})
    assert trackers[0].logged == [] and trackers[0].images == []
    ((step, values),) = trackers[1].logged
    assert step == 3 and isinstance(values["validation/16x16_5/video"], wandb.Video)
    forward("sample", {**base, "path": str(tmp_path / "v.png")})
    assert trackers[0].images == [(3, {"validation/16x16_5": (1, 16, 16, 3)}, {"dataformats": "NHWC"})]
    assert trackers[1].images == [(3, {"validation/16x16_5": (1, 16, 16, 3)}, {})]


def test_video_scores_are_the_mean_over_spread_frames():
    from difftune.train.evaluation import VIDEO_FRAMES, frames_of

    frames = [Image.new("RGB", (4, 4), (i, 0, 0)) for i in range(17)]
    picked = [f.getpixel((0, 0))[0] for f in frames_of(frames)]
    assert VIDEO_FRAMES == 4 and picked == [0, 5, 11, 16]
    assert frames_of(frames[0]) == [frames[0]]


def test_a_failing_subscriber_is_dropped_with_a_warning(tmp_path):
    from difftune.train.events import Events

    seen = []

    def broken(kind, record):
        raise RuntimeError("tracker down")

    events = Events(tmp_path / "events.jsonl", console=False)
    events.subscribers += [broken, lambda kind, record: seen.append(kind)]
    events.emit("step", step=1, loss=1.0, lr=0.1, elapsed=0.1)
    events.emit("step", step=2, loss=1.0, lr=0.1, elapsed=0.2)
    events.close()
    log = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in log] == ["step", "warning", "step"]
    assert "tracker down" in log[1]["message"] and seen == ["step", "warning", "step"]


def test_wandb_without_a_login_is_one_line_before_any_model_loads(tmp_path, dataset):
    """No W&B key and no WANDB_MODE=offline: a wandb traceback (exit 1) came out of `difftune train`. In a child
    process: wandb keeps its settings (an earlier test's offline mode) for the life of a process."""
    pytest.importorskip("wandb")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env |= {"HOME": str(tmp_path / "home"), "WANDB_CONFIG_DIR": str(tmp_path / "home" / "wandb")}  # no ~/.netrc
    path = write_config(tmp_path, dataset, report_to="wandb", max_train_steps=1)
    done = subprocess.run([sys.executable, "-m", "difftune.cli", "train", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: report_to 'wandb': W&B did not start" in done.stderr and "WANDB_MODE=offline" in done.stderr
    assert "Traceback" not in done.stderr and "loading lumina2" not in done.stderr + done.stdout


def test_a_clip_model_that_cannot_load_fails_before_caching(tmp_path, dataset, capsys):
    """It loaded at the first evaluation: an unreachable or mistyped model ended the run there, before that step's
    checkpoint. It loads before the caches fill now, and fails in one line."""
    from difftune.cli import main

    empty = tmp_path / "not-a-clip-model"
    empty.mkdir()
    path = write_config(tmp_path, dataset, max_train_steps=2, validation_prompt="a red circle",
                        evaluation_type="clip", eval_steps_interval=1, evaluation_clip_model=str(empty))
    capsys.readouterr()
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"error: evaluation_clip_model {str(empty)!r} (SimpleTuner's pretrained_evaluation_model_name_or_path) " \
        "cannot be loaded" in err and "Traceback" not in err  # the key as either trainer spells it
    assert not [e for e in events(tmp_path / "output") if "latent cache" in e.get("message", "")]
