"""allow_dataset_oversubscription: a dataset smaller than one optimizer step gets its repeats raised (SimpleTuner's
rule: every bucket at least train_batch_size x processes x gradient_accumulation_steps samples), never lowered, and
only where its entry leaves repeats out; the data report says so; the run trains and resumes exactly."""

import json

import pytest
import torch

from conftest import write_config
from difftune.cli import parse_overrides
from difftune.config import load_config
from difftune.config.schema import TrainConfig
from difftune.data.repeats import StepSize, needed_repeats, plan_repeats
from difftune.demo import make_dataset
from difftune.train import setup
from difftune.train.distributed import Ranks
from difftune.train.events import Events
from difftune.train.loop import train
from difftune.train.plan import DataError
from difftune.train.setup import build_run, prepare_data
from test_train import crash_then_resume, losses


def counts(dataset="train", **sizes):
    return {(dataset, (i, i)): n for i, n in enumerate(sizes.values())}


# ----------------------------------------------------------------- the rule (pure functions, no model)


@pytest.mark.parametrize(("batch", "processes", "accumulation", "expected"), [
    (4, 1, 1, 1),  # 2 images x 2 = 4
    (4, 1, 2, 3),  # 8 samples per step
    (4, 2, 1, 3),  # a global batch of 8
    (4, 2, 2, 7),  # 16
    (1, 1, 1, 0),  # already enough: unchanged
])
def test_two_images_get_the_repeats_of_one_optimizer_step(batch, processes, accumulation, expected):
    step = StepSize(batch, processes, accumulation)
    plan = plan_repeats(counts(a=2), {"train": 0}, step, oversubscribe=True)
    assert plan.repeats == {"train": expected}
    assert 2 * (1 + expected) >= step.samples and (expected == 0 or 2 * expected < step.samples)
    assert plan.pruned == {}
    assert [(c.before, c.after, c.raised) for c in plan.changes] == ([(0, expected, True)] if expected else [])


def test_without_the_key_the_small_bucket_is_pruned():
    plan = plan_repeats(counts(a=2, b=6), {"train": 0}, StepSize(4))
    assert plan.repeats == {"train": 0} and plan.changes == []
    assert plan.pruned == {("train", (0, 0)): 2}
    assert plan_repeats(counts(a=2), {"train": 0}, StepSize(4), keep_small=True).pruned == {}


def test_the_smallest_bucket_sets_the_whole_datasets_repeats():
    """SimpleTuner's example (25 images, 8 GPUs, batch 4: repeats 1), and a dataset of a 1-image and a 9-image
    bucket: repeats 3 for both, as SimpleTuner raises the dataset's repeats to its neediest bucket's."""
    assert needed_repeats([25], StepSize(4, 8).samples) == 1
    plan = plan_repeats(counts(a=1, b=9) | counts("other", a=8), {"train": 0, "other": 0}, StepSize(4),
                        oversubscribe=True)
    assert plan.repeats == {"train": 3, "other": 0} and plan.pruned == {}
    (change,) = plan.changes
    assert (change.dataset, change.smallest) == ("train", 1)
    assert change.line() == ("repeats of train raised from 0 to 3 (allow_dataset_oversubscription): its smallest "
                             "bucket holds 1 item(s), one optimizer step draws 4 (train_batch_size 4 x 1 process(es) x "
                             "gradient_accumulation_steps 1)")


def test_repeats_an_entry_sets_are_never_changed():
    step = StepSize(4, 1, 2)  # 8 samples per step
    higher = plan_repeats(counts(a=2), {"train": 9}, step, oversubscribe=True, explicit={"train"})
    assert higher.repeats == {"train": 9} and higher.changes == [] and higher.pruned == {}
    unset_but_enough = plan_repeats(counts(a=2), {"train": 5}, step, oversubscribe=True)
    assert unset_but_enough.repeats == {"train": 5} and unset_but_enough.changes == []  # never lowered
    lower = plan_repeats(counts(a=2), {"train": 0}, step, oversubscribe=True, explicit={"train"})
    assert lower.repeats == {"train": 0} and lower.pruned == {("train", (0, 0)): 2}
    (change,) = lower.changes
    assert not change.raised and "kept at 0, set on its entry" in change.line()
    assert "set repeats to 3 or remove it" in change.line()


# ----------------------------------------------------------------- the config key


def test_config_key_from_the_file_and_the_command_line(tmp_path):
    images = tmp_path / "images"
    make_dataset(images, count=2)
    assert load_config(write_config(tmp_path / "a", images)).train.allow_dataset_oversubscription is False
    on = load_config(write_config(tmp_path / "b", images, allow_dataset_oversubscription=True)).train
    assert on.allow_dataset_oversubscription is True
    path = write_config(tmp_path / "c", images)
    cli = load_config(path, parse_overrides(["--allow_dataset_oversubscription", "true"])).train
    assert cli.allow_dataset_oversubscription is True
    assert load_config(path, parse_overrides(["--allow_dataset_oversubscription"])).train.allow_dataset_oversubscription
    # written out and read back (the web UI and the wizard save configs from the model's own dump)
    dumped = json.loads(on.model_dump_json())
    assert TrainConfig.model_validate(dumped).allow_dataset_oversubscription is True
    schema = TrainConfig.model_json_schema()["properties"]["allow_dataset_oversubscription"]
    assert schema["group"] == "data" and "gradient_accumulation_steps" in schema["description"]


def test_an_entry_that_writes_repeats_counts_as_setting_it(tmp_path):
    images = tmp_path / "images"
    make_dataset(images, count=2)
    for written, expected in [({}, False), ({"repeats": 0}, True), ({"repeats": None}, True), ({"repeats": 2}, True)]:
        run_cfg = load_config(write_config(tmp_path / str(len(written)) / str(expected), images, dataset=written))
        assert ("repeats" in run_cfg.datasets.images[0].model_fields_set) is expected, written


# ----------------------------------------------------------------- end to end on the tiny Lumina2


@pytest.fixture
def two_images(tmp_path):
    folder = tmp_path / "images"
    make_dataset(folder, count=2)
    return folder


def data_report(output_dir):
    lines = (output_dir / "events.jsonl").read_text().splitlines()
    return next(e["text"] for e in map(json.loads, lines) if e["event"] == "data_report")


def test_two_images_with_batch_four_need_the_key_then_train(tmp_path, two_images):
    without = write_config(tmp_path / "off", two_images, train_batch_size=4, max_train_steps=1)
    with pytest.raises(DataError, match=r"fewer images than one global batch \(4\).*allow_dataset_oversubscription"):
        build_run(load_config(without))

    config = write_config(tmp_path / "on", two_images, train_batch_size=4, max_train_steps=2,
                          allow_dataset_oversubscription=True)
    run = build_run(load_config(config))
    assert len(run.data.items) == 4 and run.data.sampler.batches_per_epoch() == 1
    train(run)
    report = data_report(tmp_path / "on" / "output")
    assert "repeats of train raised from 0 to 1 (allow_dataset_oversubscription): its smallest bucket holds 2 " \
           "item(s), one optimizer step draws 4 (train_batch_size 4 x 1 process(es) x gradient_accumulation_steps 1)" \
           in report
    assert "pruned" not in report
    steps = losses(tmp_path / "on" / "output")
    assert sorted(steps) == [1, 2] and all(torch.isfinite(torch.tensor(v)) for v in steps.values())


def test_gradient_accumulation_and_two_processes(tmp_path, two_images, monkeypatch):
    """gradient_accumulation_steps 2 with process 0 of a simulated 2 (build_data sees Ranks(0, 2), the cache is
    the one process's): 2 images must fill 4 x 2 x 2 = 16 samples per step, so repeats 7, 2 global batches of 8 per
    epoch, and this process's share of each is train_batch_size."""
    real = setup.build_data
    monkeypatch.setattr(setup, "build_data", lambda run_cfg, family, cached, events, encode=None, ranks=None:
                        real(run_cfg, family, cached, events, encode, Ranks(0, 2)))
    config = write_config(tmp_path, two_images, train_batch_size=4, gradient_accumulation_steps=2,
                          allow_dataset_oversubscription=True)
    events = Events(tmp_path / "events.jsonl", console=False)
    data = prepare_data(load_config(config), events, torch.device("cpu")).data
    events.close()
    assert len(data.items) == 16 and data.sampler.batches_per_epoch() == 2
    assert data.ranks == 2 and next(iter(data)).latents.shape[0] == 4
    report = data_report(tmp_path)
    assert "repeats of train raised from 0 to 7" in report
    assert "one optimizer step draws 16 (train_batch_size 4 x 2 process(es) x gradient_accumulation_steps 2)" in report


def test_an_entry_with_repeats_is_left_alone(tmp_path, two_images):
    """Higher than needed: trained as set, no line. Lower (even 0 written out): kept, pruned, and the error
    says what would do."""
    high = write_config(tmp_path / "high", two_images, train_batch_size=4, max_train_steps=1,
                        allow_dataset_oversubscription=True, dataset={"repeats": 5})
    run = build_run(load_config(high))
    assert len(run.data.items) == 12 and run.data.sampler.batches_per_epoch() == 3
    assert "repeats of" not in data_report(tmp_path / "high" / "output")
    low = write_config(tmp_path / "low", two_images, train_batch_size=4, allow_dataset_oversubscription=True,
                       dataset={"repeats": 0})
    with pytest.raises(DataError) as info:
        build_run(load_config(low))
    assert "raise repeats on the dataset entries (or remove it there" in str(info.value)
    assert "repeats of train kept at 0, set on its entry" in str(info.value)
    assert "set repeats to 1 or remove it" in str(info.value)


def test_a_resumed_run_trains_on_the_same_raised_repeats(tmp_path, monkeypatch):
    """Repeats raised from the cached items and the config alone: a run resumed from a checkpoint builds the same
    items, and the sampler position it saved lands on the same batches (losses equal an uninterrupted run's)."""
    images = tmp_path / "images"
    make_dataset(images, count=3, size=(64, 64))
    make_dataset(tmp_path / "wide", count=1, size=(96, 48), seed=1)  # a second, 1-image bucket
    for p in (tmp_path / "wide").iterdir():
        p.rename(images / f"wide-{p.name}")
    common = dict(train_batch_size=2, max_train_steps=5, checkpoint_step_interval=2, resume_from_checkpoint="latest",
                  allow_dataset_oversubscription=True)
    full = write_config(tmp_path / "a", images, **common)
    train(build_run(load_config(full)))
    expected = losses(tmp_path / "a" / "output")
    assert "repeats of train raised from 0 to 1" in data_report(tmp_path / "a" / "output")
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", images, **common), at_step=3)
    resumed = losses(tmp_path / "b" / "output")
    assert sorted(resumed) == sorted(expected) == [1, 2, 3, 4, 5]
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
