"""When each dataset is sampled (start_epoch, start_step, end_epoch, end_step: config/dataset_window_keys.py,
data/sampler.py): curriculum runs in one dataset list, exact on resume, checked over the whole run."""

from __future__ import annotations

import json

import pytest

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.data.report import window_text
from difftune.data.sampler import BucketSampler
from difftune.demo import make_dataset
from difftune.train.loop import train
from difftune.train.plan import DataError
from difftune.train.setup import build_run


def sampler(windows, accumulation=1, sizes=(4, 4)):
    """Datasets of `sizes` items in one bucket, batch 1; item i of dataset d is 100 d + i."""
    parts = [([100 * d + i for i in range(n)], [(64, 64)] * n, None) for d, n in enumerate(sizes)]
    return BucketSampler(parts, 1, seed=3, keep_partial=False, ids=[f"d{d}" for d in range(len(sizes))],
                         windows=windows, accumulation=accumulation)


def datasets_drawn(s, count):
    it = iter(s)
    return [next(it)[0] // 100 for _ in range(count)]


def test_steps_hand_over_from_one_dataset_to_the_next():
    # SimpleTuner's curriculum: the first dataset up to step 3, the second from step 4
    windows = [(1, 0, None, 3), (1, 4, None, None)]
    assert datasets_drawn(sampler(windows), 10) == [0, 0, 0] + [1] * 7
    # with gradient accumulation a step is 2 batches: 6 batches of the first, then the second
    assert datasets_drawn(sampler(windows, accumulation=2), 12) == [0] * 6 + [1] * 6
    # by epoch: 8 batches an epoch (every dataset's), the first dataset in epoch 1, the second from epoch 2
    assert datasets_drawn(sampler([(1, 0, 1, None), (2, 0, None, None)]), 16) == [0] * 8 + [1] * 8
    # overlapping windows draw by weight from both while both are open
    both = datasets_drawn(sampler([(1, 0, None, 20), (1, 6, None, None)]), 20)
    assert set(both[:5]) == {0} and set(both[5:]) == {0, 1}
    # no windows: the unweighted epoch of every batch, as before
    assert not sampler([(1, 0, None, None)] * 2).weighted


def test_a_resumed_sampler_draws_the_same():
    windows = [(1, 0, None, 5), (1, 3, None, None)]
    whole = sampler(windows, accumulation=2)
    it = iter(whole)
    first = [next(it) for _ in range(6)]  # 3 optimizer steps: checkpoints fall on step boundaries
    state = json.loads(json.dumps(whole.state_dict()))
    rest = [next(it) for _ in range(9)]
    again = sampler(windows, accumulation=2)
    again.load_state_dict(state)
    again.start_at(3)
    it = iter(again)
    assert [next(it) for _ in range(9)] == rest and first


def test_a_resume_counts_steps_from_the_resumed_step_whatever_changed():
    """Windows were judged at epoch x batches per epoch + index, as if nothing had changed since the checkpoint: a
    dataset added at the resume, images added, or another gradient_accumulation_steps moved every window."""
    windows = [(1, 0, None, 6), (1, 7, None, None)]
    before = sampler(windows)  # accumulation 1: 4 draws are 4 steps
    it = iter(before)
    [next(it) for _ in range(4)]
    state = before.state_dict()
    # accumulation 2 now: steps 5 and 6 are 4 draws of the first dataset, then the second
    after = sampler(windows, accumulation=2)
    after.load_state_dict(state)
    after.start_at(4)
    assert datasets_drawn(after, 8) == [0, 0, 0, 0, 1, 1, 1, 1]
    # more images (12 batches an epoch instead of 8): the same hand-over at step 7
    bigger = sampler(windows, sizes=(8, 4))
    bigger.load_state_dict(state)
    bigger.start_at(4)
    assert datasets_drawn(bigger, 5) == [0, 0, 1, 1, 1]
    assert bigger.window_check(10) == (None, []) and bigger.window_check(5) == (None, ["d1"])


def test_an_epoch_bound_run_counts_its_last_steps_spill_as_the_last_epoch():
    """num_train_epochs 2 with 8 batches an epoch and accumulation 3: 6 steps draw 18 batches, the last 2 past
    epoch 2, which a window ending at epoch 2 covers (it was refused as a gap in epoch 3)."""
    s = sampler([(1, 0, 1, None), (2, 0, 2, None)], accumulation=3)
    assert s.window_check(6) == ((3, 6), [])
    s.last_epoch = 2
    assert s.window_check(6) == (None, [])


def test_the_whole_run_is_checked():
    gap = sampler([(1, 0, None, 3), (1, 6, None, None)])
    assert gap.window_check(10) == ((1, 4), [])  # steps 4 and 5 have no dataset
    assert gap.window_check(3) == (None, ["d1"])  # a 3-step run never reaches the second dataset
    assert sampler([(1, 0, None, 3), (1, 4, None, None)]).window_check(100) == (None, [])
    assert window_text((1, 0, None, 300)) == "steps 1-300" and window_text((1, 301, None, None)) == "from step 301"
    assert window_text((2, 0, 3, None)) == "epochs 2-3" and window_text((1, 0, None, None)) == "always"


def datasets_of_draws(run) -> list[str]:
    """The dataset of each batch the run's sampler draws, in order (filled as it trains)."""
    drawn: list[str] = []
    real = run.data.sampler._weighted_next

    def spy():
        batch = real()
        drawn.append(run.data.items[batch[0]].sample.dataset_id)
        return batch

    run.data.sampler._weighted_next = spy
    return drawn


def curriculum(tmp_path, first, second, **config):
    low, high = tmp_path / "low", tmp_path / "high"
    make_dataset(low, count=4)
    make_dataset(high, count=4, seed=1)
    extra = {"id": "high", "type": "local", "instance_data_dir": str(high), "caption_strategy": "textfile",
             "resolution": 64, "resolution_type": "pixel_area", "cache_dir_vae": str(tmp_path / "cache" / "high"),
             **second}
    return write_config(tmp_path, low, dataset=first, extra_datasets=[extra], **config)


def test_config_checks(tmp_path):
    for first, second, message in (
            ({"end_step": 2, "start_step": 5}, {}, "end_step 2 comes before start_step 5"),
            ({"end_epoch": 1, "start_epoch": 2}, {}, "end_epoch 1 comes before start_epoch 2"),
            ({"start_step": 10}, {"start_epoch": 2}, "no dataset is sampled from the first step")):
        with pytest.raises(ConfigError, match=message):
            load_config(curriculum(tmp_path / message[:12].replace(" ", "-"), first, second))
    images = tmp_path / "images"
    make_dataset(images, count=4)
    eval_entry = {"id": "held", "type": "local", "dataset_type": "eval", "instance_data_dir": str(images),
                  "start_step": 3}
    with pytest.raises(ConfigError, match="an eval dataset is measured at every evaluation.*start_step"):
        load_config(write_config(tmp_path / "eval", images, extra_datasets=[eval_entry]))
    # SimpleTuner's defaults are always-on, and so are its nulls and a start at step 1 (the first step, as 0 is)
    cfg = load_config(curriculum(tmp_path / "defaults", {"start_epoch": 1, "start_step": 0, "end_epoch": None,
                                                         "end_step": None}, {"start_epoch": None, "start_step": 1}))
    assert not any(ds.scheduled() for ds in cfg.datasets.images)
    assert [ds.window() for ds in cfg.datasets.images] == [(1, 0, None, None)] * 2


def test_a_curriculum_run_and_its_checks(tmp_path, capsys):
    config = curriculum(tmp_path / "run", {"end_step": 2}, {"start_step": 3}, max_train_steps=4)
    run = build_run(load_config(config))
    assert run.data.sampler.windows == [(1, 0, None, 2), (1, 3, None, None)]
    drawn = datasets_of_draws(run)
    train(run)
    assert drawn[:2] == ["train", "train"] and set(drawn[2:4]) == {"high"}
    # a gap in the run fails before the first step, naming it
    with pytest.raises(DataError, match="no dataset is sampled at step 3 .* of this 4-step run"):
        build_run(load_config(curriculum(tmp_path / "gap", {"end_step": 2}, {"start_step": 4}, max_train_steps=4)))


def test_check_says_what_training_will(tmp_path, capsys):
    from difftune.cli import main

    gap = curriculum(tmp_path / "gap", {"end_step": 2}, {"start_step": 4}, max_train_steps=6)
    assert main(["check", "--config", str(gap)]) == 2
    assert "no dataset is sampled at step 3 (epoch 1) of this 6-step run" in capsys.readouterr().err
    late = curriculum(tmp_path / "late", {}, {"start_step": 50}, max_train_steps=6)
    assert main(["check", "--config", str(late)]) == 0
    out = capsys.readouterr().out
    assert "  sampled: train always; high from step 50" in out
    assert "warning: dataset 'high' is never sampled in this run: its window lies outside the run's steps 1-6" in out


def test_a_resumed_run_hands_over_at_the_step_of_its_window(tmp_path):
    """Stage 1 trains the first dataset alone for 6 steps (an epoch and a half); stage 2 resumes over the same
    output_dir with a second dataset that starts at step 9 (the first ending at step 8): steps 7 and 8 stay the
    first's. Judged from the saved position with the new batches per epoch, they were taken as steps 11 and 12."""
    stage = dict(checkpoint_step_interval=6, resume_from_checkpoint="latest")
    low = tmp_path / "low"
    make_dataset(low, count=4)
    train(build_run(load_config(write_config(tmp_path, low, max_train_steps=6, **stage))))
    run = build_run(load_config(curriculum(tmp_path, {"end_step": 8}, {"start_step": 9}, max_train_steps=10,
                                           **stage)))
    drawn = datasets_of_draws(run)
    train(run)
    assert drawn[:4] == ["train", "train", "high", "high"]


def test_a_gap_left_by_a_pruned_dataset_is_blamed_on_its_batches_not_its_window():
    """'c' is in its window at step 1 but its 3 images fill no batch of 4: "widen a window" was the wrong fix."""
    from difftune.train.windows import WindowError, check_windows

    parts = [(list(range(6)), [(64, 64)] * 6, None), (list(range(6, 9)), [(64, 64)] * 3, None)]
    sampler = BucketSampler(parts, 4, seed=0, keep_partial=False, ids=["a", "c"],
                            windows=[(1, 3, None, None), (1, 0, None, 2)])
    with pytest.raises(WindowError, match=r"step 1 .*: 'c' is in its window there but fills no batch .* raise its "
                                          "repeats, set allow_dataset_oversubscription"):
        check_windows(sampler, 4, lambda *a, **k: None)
