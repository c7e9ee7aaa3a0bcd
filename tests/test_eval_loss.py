"""Eval datasets (`dataset_type: "eval"`) and the evaluation loss (train/eval_loss.py, config/eval_keys.py): the
config's checks, the loss against one computed by hand, its triggers, its reporting (event log, console,
TensorBoard, web UI), and training that stays bit for bit the same with it on."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import config_problems as problems
from conftest import write_config
from difftune.config import load_config
from difftune.config.eval_keys import EVAL_SEED
from difftune.demo import make_dataset
from difftune.train import eval_loss, objective
from difftune.train.loop import train
from difftune.train.setup import build_run
from families import CASES, case_data
from test_train import losses


def eval_entry(folder, root, ident="held", **extra):
    return {"id": ident, "type": "local", "dataset_type": "eval", "instance_data_dir": str(folder),
            "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel_area",
            "cache_dir_vae": str(root / "cache" / f"vae-{ident}")} | extra


def with_eval(root, images, entries, **config):
    """write_config's training dataset plus the eval `entries`."""
    return write_config(root, images, extra_datasets=entries, **config)


@pytest.fixture
def held(tmp_path):
    folder = tmp_path / "held"
    make_dataset(folder, count=2, seed=9)
    return folder



def events(output_dir, kind):
    return [e for e in map(json.loads, (output_dir / "events.jsonl").read_text().splitlines()) if e["event"] == kind]


# --- config -------------------------------------------------------------------------------------------------


def test_an_eval_entry_is_held_out_of_training(tmp_path, dataset, held):
    run_cfg = load_config(with_eval(tmp_path, dataset, [eval_entry(held, tmp_path)]))
    plan, cfg = run_cfg.datasets, run_cfg.train
    assert [ds.id for ds in plan.images] == ["train"] and [ds.id for ds in plan.evaluation] == ["held"]
    assert [ds.id for ds in plan.discovered()] == ["train", "held"]
    assert (cfg.eval_timesteps, cfg.eval_loss_disable, cfg.eval_dataset_pooling) == (28, False, False)
    # SimpleTuner's nulls mean the defaults
    nulls = dict(eval_timesteps=None, eval_loss_disable=None, eval_dataset_pooling=None)
    cfg = load_config(with_eval(tmp_path, dataset, [eval_entry(held, tmp_path)], **nulls)).train
    assert (cfg.eval_timesteps, cfg.eval_loss_disable, cfg.eval_dataset_pooling) == (28, False, False)
    # an eval entry alone trains nothing
    path = write_config(tmp_path, dataset)
    backend = tmp_path / "config" / "multidatabackend.json"
    listed = json.loads(backend.read_text())
    backend.write_text(json.dumps([eval_entry(held, tmp_path), listed[1]]))
    assert "no enabled image or video dataset" in problems(path)


def test_eval_steps_interval_alone_is_said_to_schedule_nothing(tmp_path, dataset, held):
    """SimpleTuner's presets set eval_steps_interval alone: accepted, with a note that it does nothing here."""
    notes = "\n".join(load_config(write_config(tmp_path, dataset, eval_steps_interval=50)).notes())
    assert "eval_steps_interval 50 schedules nothing" in notes and "add an eval dataset" in notes
    for config in ({"evaluation_type": "clip", "validation_prompt": "a cat"}, {}):  # CLIP, or an eval dataset
        entries = [] if config else [eval_entry(held, tmp_path)]
        path = with_eval(tmp_path, dataset, entries, eval_steps_interval=50, **config)
        assert "schedules nothing" not in "\n".join(load_config(path).notes())


def test_the_report_labels_eval_datasets_and_the_planner_ignores_them(tmp_path, dataset):
    """An eval dataset of larger images shows in the data report as eval, and does not raise the planner's
    largest bucket: it is measured without gradients."""
    from difftune.data.report import DataReport
    from difftune.memory_plan.predict import largest_bucket
    from difftune.train.plan import discover_all

    big = tmp_path / "big"
    make_dataset(big, count=2, seed=3, size=(128, 128))
    run_cfg = load_config(with_eval(tmp_path, dataset, [eval_entry(big, tmp_path, resolution=128)]))
    found = discover_all(run_cfg)
    assert [d.held_out for d in found] == [False, True]
    report = DataReport(found, [], {}).render()
    assert "held" in report and "(eval: measured, never trained on)" in report.split("held", 1)[1].splitlines()[0]
    trained = max(s.group for s in found[0].samples)
    assert largest_bucket(found, run_cfg.train) == trained != max(s.group for s in found[1].samples)
    # but its latents are cached as the trained ones are: the VAE's phase encodes its larger images
    from difftune.memory_plan.predict import predict

    caching = next(p for p in predict(run_cfg.train, found).phases if p.name == "caching: latents")
    assert any(line.label.startswith("VAE encode (128x128") for line in caching.lines), caching.lines


def test_eval_loss_disable_leaves_the_eval_datasets_out(tmp_path, dataset, held):
    run_cfg = load_config(with_eval(tmp_path, dataset, [eval_entry(held, tmp_path)], eval_loss_disable=True))
    assert run_cfg.datasets.evaluation == [] and run_cfg.datasets.discovered() == run_cfg.datasets.images
    assert any("eval_loss_disable: the eval dataset(s) 'held' are left out" in n for n in run_cfg.notes())
    load_config(write_config(tmp_path, dataset, eval_loss_disable=True))  # no eval dataset: nothing to turn off
    # the switch off: its settings are accepted (and change nothing), as settings of switched-off features are
    load_config(write_config(tmp_path, dataset, eval_loss_disable=True, eval_timesteps=10, eval_dataset_pooling=True))


@pytest.mark.parametrize("entry,config,message", [
    ({"repeats": 2}, {}, "dataset 'held': repeats: an eval dataset is never trained on"),
    ({"probability": 0.5}, {}, "dataset 'held': probability: an eval dataset is never trained on"),
    ({"is_regularisation_data": True}, {}, "dataset 'held': is_regularisation_data: an eval dataset is never"),
    ({"video": {"num_frames": 5}}, {}, "dataset 'held': video: lumina2 trains on images"),
    ({"conditioning_data": "nope"}, {}, "conditioning_data 'nope' names no enabled dataset"),
    (None, {"eval_timesteps": 10}, "eval_timesteps: sets the noise levels of the evaluation loss, which this run "
                                   "does not measure (the dataset list has no entry of dataset_type 'eval')"),
    (None, {"eval_dataset_pooling": True}, "eval_dataset_pooling: pools the evaluation losses"),
    (None, {"eval_epoch_interval": 0.5}, "eval_epoch_interval schedules CLIP evaluations; set evaluation_type"),
    ({}, {"eval_loss_disable": True, "eval_epoch_interval": 1}, "(it schedules the evaluation loss of eval datasets "
                                                                "too: set eval_loss_disable to false)"),
    ({"dataset_type": "evaluation"}, {}, "dataset_type 'evaluation' is unknown; use 'image', 'video', 'eval'"),
])
def test_misuse_is_refused_with_the_fix(tmp_path, dataset, held, entry, config, message):
    entries = [] if entry is None else [eval_entry(held, tmp_path, **entry)]
    assert message in problems(with_eval(tmp_path, dataset, entries, **config))


def test_image_to_video_evaluates_clips(tmp_path, dataset, held):
    clips = {"dataset": {"dataset_type": "video", "video": {"num_frames": 9}}, "model_family": "kandinsky5-video",
             "model_flavour": "tiny-random-i2v"}
    text = problems(with_eval(tmp_path, dataset, [eval_entry(held, tmp_path)], **clips))
    assert "dataset 'held': image-to-video flavour 'tiny-random-i2v' is evaluated on clips" in text
    assert "add a video block" in text
    load_config(with_eval(tmp_path, dataset, [eval_entry(held, tmp_path, video={"num_frames": 9})], **clips))


def test_eval_epoch_interval_schedules_the_eval_loss(tmp_path, dataset, held):
    cfg = load_config(with_eval(tmp_path, dataset, [eval_entry(held, tmp_path)], eval_epoch_interval=0.5)).train
    assert cfg.eval_epoch_interval == 0.5


# --- the loss -----------------------------------------------------------------------------------------------


def by_hand(run, levels: int) -> dict[str, list[torch.Tensor]]:
    """Each eval dataset's per-sample squared errors at each level [levels], in the eval batches' order, with each
    sample's noise seeded by the eval seed and its file name, the levels (k + 0.5) / N shifted, the model in eval
    mode."""
    import hashlib
    u = (torch.arange(levels, dtype=torch.float32) + 0.5) / levels
    sigmas = objective.shift_sigmas(u, run.cfg.flow_schedule_shift)
    model = run.comps.transformer
    model.eval()
    out = {}
    with torch.no_grad():
        for ident, data in run.eval_set.data.items():
            errors = []
            for batch in data:
                x0 = batch.latents
                seeds = [int.from_bytes(hashlib.sha256(f"{EVAL_SEED}:{p.name}".encode()).digest()[:8], "little") >> 1
                         for p in batch.paths]  # the files lie at the top of their folders: name = file name
                noise = torch.stack([torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(seed))
                                     for seed in seeds])
                per_level = []
                for s in sigmas:
                    x = (1 - s) * x0 + s * noise
                    pred = run.family.predict(model, x, s.repeat(x0.shape[0]), batch.text)
                    per_level.append(((pred - (noise - x0)) ** 2).flatten(1).mean(1))
                errors += list(torch.stack(per_level, dim=1))  # one [levels] row per sample
            out[ident] = errors
    model.train()
    return out


def test_the_loss_is_the_loss_by_hand_and_repeats_exactly(tmp_path, dataset, held):
    """Two eval datasets (2 and 1 images, batches of one), 3 levels, shift 3: each dataset's mean and the pooled
    mean equal a computation by hand; measuring again gives the same numbers; nothing the run draws from moves."""
    one = tmp_path / "one"
    make_dataset(one, count=1, seed=4)
    entries = [eval_entry(held, tmp_path), eval_entry(one, tmp_path, ident="one")]
    run = build_run(load_config(with_eval(tmp_path, dataset, entries, eval_timesteps=3, flow_schedule_shift=3.0)))
    generator, rng, mode = run.generator.get_state(), torch.get_rng_state(), run.comps.transformer.training
    sums = eval_loss.measure(run)
    first = eval_loss.report(run, sums)
    assert run.generator.get_state().equal(generator) and torch.get_rng_state().equal(rng)
    assert run.comps.transformer.training == mode
    assert eval_loss.report(run, eval_loss.measure(run)) | {"time": 0} == first | {"time": 0}  # bit for bit
    expected = by_hand(run, 3)
    assert first["samples"] == 3 and set(first["datasets"]) == {"held", "one"}
    for ident, rows in expected.items():
        assert first["datasets"][ident] == pytest.approx(float(torch.stack(rows).mean()), rel=1e-5)
    every = torch.stack(expected["held"] + expected["one"])  # [samples, levels]
    assert first["loss"] == pytest.approx(float(every.mean()), rel=1e-5)
    assert first["by_level"] == pytest.approx(every.mean(0).tolist(), rel=1e-5)
    assert first["sigmas"] == pytest.approx(objective.shift_sigmas(torch.tensor([1 / 6, 3 / 6, 5 / 6]), 3.0).tolist())
    # eval_dataset_pooling: the same pooled loss, no dataset of its own
    run.eval_set.pooled = True
    pooled = eval_loss.report(run, sums)
    assert pooled["loss"] == first["loss"] and pooled["datasets"] == {} and pooled["pooled"]


def test_a_datasets_loss_does_not_depend_on_the_other_eval_datasets(tmp_path, dataset, held):
    """Two eval datasets of the same files measured 1.26 and 1.43 (one noise stream ran through every dataset in
    turn), and removing the first moved the second's number: each sample's noise is its own now."""
    twice = [eval_entry(held, tmp_path, ident="ev"), eval_entry(held, tmp_path, ident="ev2")]
    run = build_run(load_config(with_eval(tmp_path / "a", dataset, twice, eval_timesteps=2)))
    both = eval_loss.report(run, eval_loss.measure(run))["datasets"]
    assert both["ev"] == both["ev2"]
    alone = build_run(load_config(with_eval(tmp_path / "b", dataset, twice[1:], eval_timesteps=2,
                                            train_batch_size=2)))
    assert eval_loss.report(alone, eval_loss.measure(alone))["datasets"]["ev2"] == pytest.approx(both["ev2"], rel=1e-6)


# --- a run --------------------------------------------------------------------------------------------------


def test_training_is_unchanged_and_the_loss_is_reported(tmp_path, dataset, held, capsys):
    """3 steps, validation every 2: the eval loss at step 2 and after the last one, in the event log, on the console,
    in TensorBoard and in the web UI's run summary. The same run with eval_loss_disable has the same losses, bit
    for bit, and no eval loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from difftune.ui.runs import Run as UIRun

    common = dict(max_train_steps=3, validation_step_interval=2, eval_timesteps=2)
    on = tmp_path / "on"
    train(build_run(load_config(with_eval(on, dataset, [eval_entry(held, on)], report_to="tensorboard",
                                          tracker_project_name="proj", **common))))
    logged = events(on / "output", "eval_loss")
    assert [e["step"] for e in logged] == [2, 3] and all(e["samples"] == 2 for e in logged)
    assert logged[0]["loss"] != logged[1]["loss"]  # the weights moved in between
    printed = capsys.readouterr()
    assert f"evaluation loss at step 2: {logged[0]['loss']:.4f} (2 held-out samples)" in printed.out + printed.err
    acc = EventAccumulator(str(on / "output" / "tensorboard" / "proj"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, values in (("eval/loss", [e["loss"] for e in logged]),
                        ("eval/loss/held", [e["datasets"]["held"] for e in logged])):
        assert {x.step: x.value for x in acc.Scalars(tag)} == pytest.approx(dict(zip([2, 3], values, strict=True)))
    (tmp_path / "ui").mkdir()
    (tmp_path / "ui" / "run.json").write_text(json.dumps({"id": "r", "output_dir": str(on / "output")}))
    ui_run = UIRun(tmp_path / "ui")
    ui_run.read_events()
    assert ui_run.summary(detail=True)["eval_losses"] == [[e["step"], e["loss"]] for e in logged]

    off = tmp_path / "off"
    disabled = load_config(with_eval(off, dataset, [eval_entry(held, off)], eval_loss_disable=True, **common))
    # eval_loss_disable drops the entry at load: the run is the run without the eval dataset
    without = load_config(write_config(off, dataset, eval_loss_disable=True, **common)).datasets
    assert disabled.datasets.model_dump(exclude={"notes"}) == without.model_dump(exclude={"notes"})
    train(build_run(disabled))
    assert events(off / "output", "eval_loss") == []
    assert losses(off / "output") == losses(on / "output")


@pytest.mark.slow
def test_eval_steps_interval_schedules_it_and_a_resume_repeats_it(tmp_path, dataset, held, monkeypatch):
    """eval_steps_interval 1: the loss after every step (not only at validations); a run killed after step 2 and
    resumed from its checkpoint gives the same training losses and evaluation losses."""
    from test_train import crash_then_resume

    config = dict(max_train_steps=4, eval_steps_interval=1, eval_timesteps=2, checkpoint_step_interval=2,
                  resume_from_checkpoint="latest")
    whole = tmp_path / "whole"
    train(build_run(load_config(with_eval(whole, dataset, [eval_entry(held, whole)], **config))))
    expected = {e["step"]: e["loss"] for e in events(whole / "output", "eval_loss")}
    assert sorted(expected) == [1, 2, 3, 4]
    resumed = tmp_path / "resumed"
    path = with_eval(resumed, dataset, [eval_entry(held, resumed)], **config)
    crash_then_resume(monkeypatch, path, at_step=3)
    assert losses(resumed / "output") == losses(whole / "output")
    again = {e["step"]: e["loss"] for e in events(resumed / "output", "eval_loss")}
    assert again == expected


@pytest.mark.parametrize("case", [c if c.i2v else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES if c.family != "lumina2"], ids=lambda c: c.id)
def test_every_family_measures_it(tmp_path, dataset, case):
    """Kandinsky 5 image (t2i; i2i, whose eval images pair with input images), video (t2v; i2v, on clips whose first
    latent frame is the input and is left out): one step, the evaluation loss after it, finite and positive."""
    folder, keys = case_data(case, tmp_path, dataset)
    entry = eval_entry(folder, tmp_path) | {k: v for k, v in keys.get("dataset", {}).items() if k != "dataset_type"}
    keys = {k: v for k, v in keys.items() if k != "validation_num_video_frames"}
    path = with_eval(tmp_path, folder, [entry], model_family=case.family, model_flavour=case.flavour,
                     max_train_steps=1, eval_timesteps=2, **keys)
    run = build_run(load_config(path))
    assert run.eval_set is not None and run.first_frame == case.i2v
    train(run)
    (logged,) = events(run.output_dir, "eval_loss")
    assert logged["step"] == 1 and logged["samples"] == len(run.eval_set.data["held"].items)
    assert 0 < logged["loss"] < 100


def test_an_eval_dataset_of_training_images_is_noted(tmp_path, dataset, held):
    """Its loss was reported as held out, yet every image was trained on."""
    overlap = load_config(with_eval(tmp_path, dataset, [eval_entry(dataset, tmp_path)]))
    assert any("its folder" in n and "holds images dataset 'train' trains on" in n for n in overlap.notes())
    apart = load_config(with_eval(tmp_path, dataset, [eval_entry(held, tmp_path)]))
    assert not any("trains on (the same folder" in n for n in apart.notes())
