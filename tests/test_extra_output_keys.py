"""SimpleTuner's smaller validation and output keys (config/extra_output_keys.py): validation_randomize draws fresh
seeds that the events record, validation_lycoris_strength changes the samples and not training, rolling checkpoints
are a second series pruned apart that 'latest' resumes from, and post_checkpoint_script / post_upload_script run
real commands in the background whose failures are warnings. Each is refused where it would do nothing."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.train import scripts
from difftune.train.checkpoint import complete, prune_checkpoints
from difftune.train.loop import train
from difftune.train.setup import build_run
from difftune.train.validation import sample_requests
from test_hub import FakeHub
from test_train import crash_then_resume, losses

SAMPLES = dict(validation_prompt="a red circle", validation_resolution="64x48", validation_num_inference_steps=2,
               validation_disable_unconditional=True)


def events(output) -> list[dict]:
    return [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()]


def pixels(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB")).astype(int)


def problems(tmp_path, dataset, **keys) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, **keys))
    return "\n".join(info.value.problems)


# --- validation_randomize


def test_randomized_seeds_are_logged_and_reproduce_the_sample(tmp_path, dataset):
    run = build_run(load_config(write_config(tmp_path, dataset, **SAMPLES, max_train_steps=2,
                                             validation_step_interval=1, disable_benchmark=False,
                                             validation_randomize=True)))
    train(run)
    folder = run.output_dir / "validation"
    assert not list(folder.glob("*-vs-base.png"))  # their base sample had another seed
    seeds = {Path(e["path"]).name: e["seed"] for e in events(run.output_dir) if e["event"] == "sample"}
    assert sorted(seeds) == ["base-model-64x48.png", "final-step-000002-64x48.png", "step-000001-64x48.png"]
    assert len(set(seeds.values())) == 3  # a fresh seed at each validation
    # the final weights and the logged seed give the final sample again
    (request,) = run.validation
    (_, image), = sample_requests(run, [replace(request, seed=seeds["final-step-000002-64x48.png"])])
    assert (np.asarray(image.convert("RGB")).astype(int) == pixels(folder / "final-step-000002-64x48.png")).all()


# --- validation_lycoris_strength


def lycoris_run(tmp_path, dataset, name: str, **keys):
    (tmp_path / "lycoris.json").write_text(json.dumps({"algo": "lokr", "linear_dim": 8, "linear_alpha": 4,
                                                       "factor": 4}))
    run = build_run(load_config(write_config(tmp_path / name, dataset, **SAMPLES, max_train_steps=2,
                                             learning_rate=5e-2, lora_type="lycoris",
                                             lycoris_config=str(tmp_path / "lycoris.json"),
                                             validation_on_startup=True, **keys)))
    train(run)
    return run


def test_lycoris_strength_acts_on_samples_only(tmp_path, dataset):
    """Strength 0 samples the base model (the startup sample, bit for bit); unset or 1.0, the trained network. The
    training losses are the same bit for bit, and training's multiplier is back after each validation."""
    runs = {name: lycoris_run(tmp_path, dataset, name, **keys) for name, keys in
            [("unset", {}), ("one", {"validation_lycoris_strength": 1.0}),
             ("zero", {"validation_lycoris_strength": 0.0})]}
    final = {name: pixels(run.output_dir / "validation" / "final-step-000002-64x48.png") for name, run in runs.items()}
    base = pixels(runs["zero"].output_dir / "validation" / "base-model-64x48.png")
    assert (final["zero"] == base).all()
    assert (final["one"] == final["unset"]).all()
    assert np.abs(final["unset"] - base).max() > 0  # the trained network changes the sample
    trained = [losses(run.output_dir) for run in runs.values()]
    assert trained[0] == trained[1] == trained[2]
    assert all(run.adapter.network.multiplier == 1.0 for run in runs.values())


# --- validation_stitch_input_location


def test_image_to_image_samples_are_stitched_beside_their_input(tmp_path, dataset):
    """SimpleTuner's web UI writes 'left' for every model; it was refused. The sample stays as it is; the stitched
    copy has the input on the side asked for, scaled to the sample's height (the input as the sample saw it: fitted
    to 64x48, as a training input is to its bucket)."""
    run = build_run(load_config(write_config(
        tmp_path, dataset, model_family="kandinsky5-image", model_flavour="tiny-random-i2i", max_train_steps=1,
        dataset={"conditioning": [{"type": "canny", "instance_data_dir": str(tmp_path / "edges")}]},
        **SAMPLES | {"validation_resolution": "64x48"}, validation_stitch_input_location="Left")))
    train(run)
    folder = run.output_dir / "validation"
    sample = pixels(folder / "final-step-000001-64x48.png")
    both = pixels(folder / "final-step-000001-64x48-with-input.png")
    given = run.validation[0].image.convert("RGB")
    assert given.size == (64, 48) and sample.shape == (48, 64, 3) and both.shape == (48, 128, 3)
    assert (both[:, :64] == np.asarray(given)).all()  # the canny input
    assert (both[:, 64:] == sample).all()
    sampled = [Path(e["path"]).name for e in events(run.output_dir) if e["event"] == "sample"]
    assert sampled == ["final-step-000001-64x48.png"]  # trackers and the web UI get the sample alone


def test_an_image_to_video_contact_sheet_gets_its_input_on_the_right(tmp_path, dataset):
    from families import make_clips

    clips = make_clips(tmp_path / "clips", count=1, frames=9)
    run = build_run(load_config(write_config(
        tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random-i2v", max_train_steps=1,
        dataset={"dataset_type": "video", "resolution": 32, "video": {"num_frames": 9}},
        validation_prompt="a square", validation_resolution="32x32", validation_num_video_frames=17,
        validation_num_inference_steps=1, validation_stitch_input_location="right")))
    train(run)
    folder = run.output_dir / "validation"
    sheet = pixels(folder / "final-step-000001-32x32@17.png")
    both = pixels(folder / "final-step-000001-32x32@17-with-input.png")
    assert both.shape == (sheet.shape[0], sheet.shape[1] + 32, 3)
    assert (both[:, :sheet.shape[1]] == sheet).all()
    assert (both[:32, sheet.shape[1]:] == np.asarray(run.validation[0].image.convert("RGB"))).all()
    assert (both[32:, sheet.shape[1]:] == 255).all()  # beside the first row only; white below


def test_stitching_without_an_input_image_or_a_prompt_is_a_note(tmp_path, dataset):
    t2i = load_config(write_config(tmp_path / "t2i", dataset, **SAMPLES, validation_stitch_input_location="left"))
    assert [n for n in t2i.notes() if n.startswith("validation_stitch_input_location not used: flavour")]
    quiet = load_config(write_config(tmp_path / "quiet", dataset, validation_stitch_input_location="left"))
    assert [n for n in quiet.notes() if "validation_stitch_input_location" in n and "no validation prompt" in n]
    assert load_config(write_config(tmp_path / "empty", dataset, validation_stitch_input_location="")).train \
        .validation_stitch_input_location is None
    assert "validation_stitch_input_location" in problems(tmp_path / "up", dataset, validation_stitch_input_location="up")


# --- rolling checkpoints


ROLLING = dict(max_train_steps=9, checkpoint_step_interval=3, checkpoints_total_limit=1, checkpointing_rolling_steps=2,
               checkpoints_rolling_total_limit=2, resume_from_checkpoint="latest")


def test_rolling_checkpoints_are_a_series_of_their_own(tmp_path, dataset, monkeypatch):
    """Regular at 3, 6 (and 9, the end), kept 1; rolling at 2, 4, 8 (6 is regular), kept 2: neither pruning touches
    the other series. A run that dies after step 5 resumes from the newest of both (rolling step 4) with the
    losses of the uninterrupted run."""
    train(build_run(load_config(write_config(tmp_path / "a", dataset, **ROLLING))))
    names = [p.name for p in complete(tmp_path / "a" / "output")]
    assert names == ["checkpoint-0000004-rolling", "checkpoint-0000008-rolling", "checkpoint-0000009"]
    saved = [(e["step"], e.get("rolling", False)) for e in events(tmp_path / "a" / "output")
             if e["event"] == "checkpoint"]
    assert saved == [(2, True), (3, False), (4, True), (6, False), (8, True), (9, False)]
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", dataset, **ROLLING), at_step=5)
    resumed = [e["message"] for e in events(tmp_path / "b" / "output") if e["event"] == "info"
               and e["message"].startswith("resumed from")]
    assert resumed == [f"resumed from {tmp_path / 'b' / 'output' / 'checkpoints' / 'checkpoint-0000004-rolling'} "
                       "at step 4"]
    assert losses(tmp_path / "b" / "output") == losses(tmp_path / "a" / "output")


def test_pruning_keeps_to_its_series(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ["checkpoint-0000001", "checkpoint-0000002-rolling", "checkpoint-0000003", "checkpoint-0000004-rolling",
                 "checkpoint-0000005-rolling", "checkpoint-0000005"]:
        (root / name).mkdir(parents=True)
        (root / name / "training_state.json").write_text("{}")
    assert complete(tmp_path)[-1].name == "checkpoint-0000005"  # of one step, the regular one is 'latest'
    prune_checkpoints(tmp_path, 1, rolling=True)
    prune_checkpoints(tmp_path, 2)
    assert [p.name for p in complete(tmp_path)] == ["checkpoint-0000003", "checkpoint-0000005-rolling",
                                                    "checkpoint-0000005"]


# --- post_checkpoint_script, post_upload_script


def recorder(tmp_path) -> tuple[str, Path]:
    """A command line that appends its arguments to a file, and that file."""
    log = tmp_path / "calls.jsonl"
    script = tmp_path / "record.py"
    script.write_text("import json, sys\nwith open(sys.argv[1], 'a') as f:\n    f.write(json.dumps(sys.argv[2:]) + "
                      "'\\n')\n")
    return f"'{sys.executable}' '{script}' '{log}'", log


def calls(log: Path) -> list[list[str]]:
    """The recorded command lines, sorted: the commands run in the background, side by side, so the order in which
    they write is not the order in which they started."""
    return sorted(json.loads(line) for line in log.read_text().splitlines()) if log.exists() else []


def test_post_checkpoint_script_runs_after_each_checkpoint(tmp_path, dataset):
    """Regular, rolling and final checkpoints each run the command, with SimpleTuner's placeholders filled (a value
    with a space stays one argument; unset ones are empty)."""
    head, log = recorder(tmp_path)
    run = build_run(load_config(write_config(
        tmp_path / "run", dataset, max_train_steps=3, checkpoint_step_interval=2, checkpointing_rolling_steps=1,
        tracker_run_name="my run", post_checkpoint_script=f"{head} {{local_checkpoint_path}} {{global_step}} "
        "{model_family} {lora_type} {tracker_run_name} {remote_checkpoint_path} {validation_seed}")))
    train(run)
    folder = run.output_dir / "checkpoints"
    assert calls(log) == [[str(folder / "checkpoint-0000001-rolling"), "1", "lumina2", "standard", "my run", "", ""],
                          [str(folder / "checkpoint-0000002"), "2", "lumina2", "standard", "my run", "", ""],
                          [str(folder / "checkpoint-0000003"), "3", "lumina2", "standard", "my run", "", ""]]
    assert not [e for e in events(run.output_dir) if e["event"] == "warning"]


def test_scripts_run_in_the_background(tmp_path, dataset):
    """The step-1 checkpoint's command waits until the step-2 checkpoint exists (which a blocking run would never
    write), and the end of the run waits for it."""
    waiter = tmp_path / "wait.py"
    waiter.write_text("import pathlib, sys, time\nlater = pathlib.Path(sys.argv[1]).parent / 'checkpoint-0000002'\n"
                      "end = time.time() + 60\nwhile sys.argv[2] == '1' and not later.exists() and time.time() < end:\n"
                      "    time.sleep(0.05)\nsys.exit(0 if later.exists() else 1)\n")
    run = build_run(load_config(write_config(tmp_path / "run", dataset, max_train_steps=2, checkpoint_step_interval=1,
                                             post_checkpoint_script=f"'{sys.executable}' '{waiter}' "
                                                                    "{local_checkpoint_path} {global_step}")))
    train(run)
    log = events(run.output_dir)
    order = [(e["event"], e.get("step")) for e in log]
    finished = [i for i, e in enumerate(log) if e["event"] == "info" and "post_checkpoint_script finished" in
                e["message"]]
    assert len(finished) == 2 and finished[0] > order.index(("step", 2))  # step 2 trained while it ran
    assert not [e for e in log if e["event"] == "warning"]


def test_failing_scripts_are_warnings(tmp_path, dataset):
    fails = f"'{sys.executable}' -c 'import sys; print(\"boom\"); sys.exit(3)' {{global_step}}"
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=2, post_checkpoint_script=fails,
                                             post_upload_script="/no/such/program {local_checkpoint_path}")))
    assert train(run).exists()
    log = events(run.output_dir)
    assert "done" in [e["event"] for e in log]
    warnings = sorted(e["message"] for e in log if e["event"] == "warning")  # in the order their commands ended
    assert len(warnings) == 2, warnings
    assert "post_checkpoint_script exited with status 3" in warnings[0] and "boom" in warnings[0]
    assert warnings[0].count(" 2;") == 1  # the command, filled in
    assert warnings[1].startswith("post_upload_script could not start (FileNotFoundError")


def test_post_upload_script_runs_after_each_upload(tmp_path, dataset, monkeypatch):
    head, log = recorder(tmp_path)
    FakeHub(monkeypatch)
    run = build_run(load_config(write_config(
        tmp_path / "hub", dataset, max_train_steps=2, checkpoint_step_interval=1, push_to_hub=True,
        push_checkpoints_to_hub=True, hub_model_id="me/tiny-lora",
        post_upload_script=f"{head} {{remote_checkpoint_path}} {{local_checkpoint_path}} {{global_step}} "
                           "{huggingface_path}")))
    train(run)
    out, hub = run.output_dir, "https://huggingface.co/me/tiny-lora"
    assert calls(log) == sorted([
        [f"{hub}/tree/main/checkpoints/checkpoint-0000001", str(out / "checkpoints" / "checkpoint-0000001"), "1",
         "me/tiny-lora"],
        [f"{hub}/tree/main/checkpoints/checkpoint-0000002", str(out / "checkpoints" / "checkpoint-0000002"), "2",
         "me/tiny-lora"],
        [hub, str(out), "2", "me/tiny-lora"]])
    # without push_to_hub: once, for the saved result, with no remote path (SimpleTuner runs it without uploads too)
    (tmp_path / "local").mkdir()
    head, log = recorder(tmp_path / "local")
    run = build_run(load_config(write_config(tmp_path / "plain", dataset, max_train_steps=2,
                                             post_upload_script=f"{head} {{remote_checkpoint_path}} "
                                                                "{local_checkpoint_path}")))
    train(run)
    assert calls(log) == [["", str(run.output_dir)]]


def test_scripts_run_on_process_0_only(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, post_checkpoint_script="true")).train

    class FakeRun:
        def __init__(self, main):
            self.cfg, self.events = cfg, type("E", (), {"subscribers": []})()
            self.ranks = type("R", (), {"main": main})()

    others, first = FakeRun(False), FakeRun(True)
    scripts.attach(others)
    scripts.attach(first)
    assert others.events.subscribers == [] and len(first.events.subscribers) == 1


# --- the config


def test_simpletuner_spellings_are_accepted(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, validation_randomize=None, validation_lycoris_strength=1.0,
                                   checkpointing_rolling_steps=None, checkpoints_rolling_total_limit=None,
                                   post_checkpoint_script="", post_upload_script=None)).train
    assert (cfg.validation_randomize, cfg.checkpointing_rolling_steps, cfg.checkpoints_rolling_total_limit,
            cfg.post_checkpoint_script) == (False, 0, 1, None)


@pytest.mark.parametrize("keys, named", [
    ({"validation_randomize": True}, ["validation_randomize", "validation_prompt"]),
    ({**SAMPLES, "validation_randomize": True, "validation_seed": 3}, ["validation_randomize", "validation_seed"]),
    ({**SAMPLES, "validation_lycoris_strength": 0.5}, ["validation_lycoris_strength", "'lycoris'"]),
    ({**SAMPLES, "validation_lycoris_strength": -1}, ["validation_lycoris_strength"]),
    ({"checkpoints_rolling_total_limit": 3}, ["checkpoints_rolling_total_limit", "set checkpointing_rolling_steps"]),
    ({"checkpointing_rolling_steps": 2, "checkpoints_rolling_total_limit": 0}, ["checkpoints_rolling_total_limit"]),
    ({"checkpointing_rolling_steps": 4, "checkpoint_step_interval": 2}, ["checkpointing_rolling_steps 4",
                                                                        "no rolling checkpoint would be written"]),
    ({"post_checkpoint_script": "copy {local_path}"}, ["post_checkpoint_script", "{local_path}",
                                                       "{local_checkpoint_path}"]),
    ({"post_upload_script": "notify '{remote_checkpoint_path}"}, ["post_upload_script", "quotes"]),
    ({"post_upload_script": "notify {remote_checkpoint_path"}, ["post_upload_script", "literal brace"]),
    ({"post_upload_script": "python -c 'd = {}'"}, ["post_upload_script", "{}", "literal brace"]),
])
def test_misuse_is_a_config_error(tmp_path, dataset, keys, named):
    text = problems(tmp_path, dataset, **keys)
    for words in named:
        assert words in text, text


def test_the_web_ui_never_starts_a_run_with_a_script(tmp_path, monkeypatch):
    """A command could act outside the server's roots: the page shows the problem at the field and refuses to
    start the run (nothing is spawned)."""
    from fastapi.testclient import TestClient

    from difftune.demo import make_dataset
    from difftune.ui.server import create_app

    root = tmp_path / "root"
    make_dataset(root / "images", count=2)
    write_config(root, root / "images", max_train_steps=2, post_checkpoint_script="rm -rf /elsewhere",
                 post_upload_script="notify {remote_checkpoint_path}")
    monkeypatch.chdir(root)
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")
    body = {"path": str(root / "config" / "config.json"),
            "config": json.loads((root / "config" / "config.json").read_text()),
            "datasets": json.loads((root / "config" / "multidatabackend.json").read_text()),
            "overwrite": True}  # a save replaces the files write_config wrote
    answer = client.post("/api/config/check", json=body).json()
    assert {(p["key"], "does not start runs that run commands" in p["message"]) for p in answer["problems"]} == {
        ("post_checkpoint_script", True), ("post_upload_script", True)}
    assert client.put("/api/config", json=body).status_code == 200
    assert client.post("/api/runs", json={"path": body["path"]}).status_code == 422
    assert client.get("/api/runs").json()["runs"] == []
