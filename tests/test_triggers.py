"""Epoch intervals (validation_epoch_interval, checkpoint_epoch_interval, eval_epoch_interval) beside the step
intervals: where epochs end (the batches the loop trained on, not the read-ahead's), gradient accumulation, both
schedules at once, fractional evaluation intervals, and resumes that never fire an epoch twice."""

from __future__ import annotations

import json

import pytest

from conftest import write_config
from difftune.config import load_config
from difftune.config.load import ConfigError
from difftune.train.loop import train
from difftune.train.setup import build_run
from difftune.train.triggers import batches_done, epoch_reached

SAMPLES = dict(validation_prompt="a red circle", validation_resolution="32x32", validation_num_inference_steps=1,
               validation_disable_unconditional=True)


def at(epoch: int, index: int) -> dict:
    return {"epoch": epoch, "index": index, "streams": []}


def test_batches_done_counts_sampler_positions():
    assert batches_done(None, 4) == 0
    assert batches_done(at(0, 4), 4) == 4 and batches_done(at(2, 1), 4) == 9


@pytest.mark.parametrize("before,after,interval,expected", [
    (None, at(0, 3), 1, False), (at(0, 3), at(0, 4), 1, True),  # the step that trained on the epoch's last batch
    (at(0, 4), at(1, 1), 1, False),  # the next epoch's first batch: that epoch was already counted
    (at(0, 2), at(1, 1), 1, True),  # an epoch ending inside an accumulated step
    (at(0, 4), at(1, 3), 2, False), (at(1, 1), at(1, 4), 2, True),  # every second epoch
    (None, at(0, 2), None, False), (None, at(5, 0), 0, False),  # off
])
def test_epoch_reached(before, after, interval, expected):
    assert epoch_reached(before, after, 4, interval) is expected


def test_fractional_intervals_fire_within_an_epoch():
    """0.5 epochs of 3 batches: after batch 2 (1.5 reached), 3, 5 (4.5), 6; 0.1 of 10 batches: every batch."""
    fired = [n for n in range(1, 7) if epoch_reached(at(0, n - 1), at(0, n), 3, 0.5)]
    assert fired == [2, 3, 5, 6]
    assert all(epoch_reached(at(0, n - 1), at(0, n), 10, 0.1) for n in range(1, 11))


def test_epoch_interval_keys_validate(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, **SAMPLES, validation_epoch_interval=2,
                                   checkpoint_epoch_interval=None, eval_epoch_interval=0)).train
    assert (cfg.validation_epoch_interval, cfg.checkpoint_epoch_interval, cfg.eval_epoch_interval) == (2, None, 0)
    for key, value in [("validation_epoch_interval", -1), ("checkpoint_epoch_interval", 1.5),
                       ("eval_epoch_interval", -0.5)]:
        with pytest.raises(ConfigError, match=key):
            load_config(write_config(tmp_path / key, dataset, **{key: value}))
    with pytest.raises(ConfigError, match="eval_epoch_interval schedules CLIP evaluations; set evaluation_type"):
        load_config(write_config(tmp_path / "e", dataset, **SAMPLES, eval_epoch_interval=0.5))


def events(root) -> list[dict]:
    return [json.loads(line) for line in (root / "output" / "events.jsonl").read_text().splitlines()]


def validated(root) -> list[str]:
    return sorted(p.name.split("-32x32")[0] for p in (root / "output" / "validation").glob("*.png"))


def checkpoints(root) -> list[str]:
    return sorted(p.name for p in (root / "output" / "checkpoints").iterdir())


def test_epoch_and_step_intervals_with_gradient_accumulation(tmp_path, dataset):
    """4 batches an epoch, 3 per step: epochs end inside steps 2, 3, 4 and at the end of step 6 (the last step,
    whose validation and checkpoint are the run's final ones). validation_step_interval 5 adds step 5; every
    second epoch checkpoints (steps 3 and 6). The read-ahead (on) is two batches ahead of the loop."""
    run = build_run(load_config(write_config(
        tmp_path, dataset, **SAMPLES, max_train_steps=6, gradient_accumulation_steps=3, validation_epoch_interval=1,
        validation_step_interval=5, checkpoint_epoch_interval=2, dataloader_prefetch_qlen=2)))
    assert run.data.sampler.batches_per_epoch() == 4 and run.cfg.dataloader_prefetch
    train(run)
    assert validated(tmp_path) == ["final-step-000006", "step-000002", "step-000003", "step-000004", "step-000005"]
    assert checkpoints(tmp_path) == ["checkpoint-0000003", "checkpoint-0000006"]


def test_a_resume_never_fires_an_epoch_twice(tmp_path, dataset):
    """Epoch 1 ends at step 4 (validation, checkpoint); the run stops at step 5 and resumes there: step 5's
    position already holds epoch 1, so the next epoch trigger is epoch 2's, at step 8."""
    common = dict(SAMPLES, validation_epoch_interval=1, checkpoint_epoch_interval=1, resume_from_checkpoint="latest")
    train(build_run(load_config(write_config(tmp_path, dataset, **common, max_train_steps=5))))
    assert validated(tmp_path) == ["final-step-000005", "step-000004"]
    train(build_run(load_config(write_config(tmp_path, dataset, **common, max_train_steps=9))))
    assert validated(tmp_path) == ["final-step-000005", "final-step-000009", "step-000004", "step-000008"]
    assert checkpoints(tmp_path) == ["checkpoint-0000004", "checkpoint-0000005", "checkpoint-0000008",
                                     "checkpoint-0000009"]


def test_eval_epoch_interval_evaluates_at_each_half_epoch(tmp_path, dataset):
    """CLIP evaluation every 0.5 epochs of 4 batches: steps 2, 4, 6; the validation at the end is not scored
    (a schedule is set)."""
    from difftune.models.tiny_clip import tiny_clip

    train(build_run(load_config(write_config(tmp_path, dataset, **SAMPLES, max_train_steps=6, eval_epoch_interval=0.5,
                                             evaluation_type="clip", evaluation_clip_model=str(tiny_clip())))))
    assert [e["step"] for e in events(tmp_path) if e["event"] == "evaluation"] == [2, 4, 6]
