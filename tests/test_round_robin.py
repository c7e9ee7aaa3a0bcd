"""flow_timesteps_mode 'round-robin' (train/noise_levels.py cycle_levels / cycle_start): flow_custom_timesteps taken
in turn, sample after sample of the global batch, from a position computed from the run's progress alone."""

import pytest
import torch

from conftest import write_config
from difftune.config import load_config
from difftune.train import noise_levels, objective
from difftune.train.loop import train
from difftune.train.objective import TimestepSampling, sample_sigmas
from difftune.train.setup import build_run


def test_levels_in_turn_by_hand():
    levels = (0.9, 0.6, 0.3)
    assert noise_levels.cycle_levels(5, levels, 0).tolist() == pytest.approx([0.9, 0.6, 0.3, 0.9, 0.6])
    assert noise_levels.cycle_levels(2, levels, 7).tolist() == pytest.approx([0.6, 0.3])  # 7 % 3 = 1
    # step 2 of accumulation 2, micro-batch 1, global batch 4: sample number (2 * 2 + 1) * 4 = 20
    assert noise_levels.cycle_start(2, 2, 1, 4) == 20
    g = torch.Generator().manual_seed(0)
    before = g.get_state()
    cycle = TimestepSampling("cycle", levels=levels)
    assert sample_sigmas(4, 3.0, g, cycle, start=2).tolist() == pytest.approx([0.3, 0.9, 0.6, 0.3])  # no shift
    assert torch.equal(g.get_state(), before)  # nothing drawn from the run's generator


def test_config_picks_the_cycle(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, flow_custom_timesteps="900,600,300",
                                   flow_timesteps_mode="round-robin")).train
    assert TimestepSampling.of(cfg).distribution == "cycle"
    fixed = load_config(write_config(tmp_path, dataset, flow_custom_timesteps="900,600,300")).train
    assert TimestepSampling.of(fixed).distribution == "list"


def test_processes_take_their_slices():
    """2 processes, each taking its half of the global batch at its offset, see what 1 process training the whole
    global batch sees, step after step (the loop slices [lo : lo + local] of the global draw)."""
    levels, accum, local = (0.1, 0.2, 0.3, 0.4, 0.5), 2, 3
    one, two = [], []
    for step in range(3):
        for micro in range(accum):
            start = noise_levels.cycle_start(step, accum, micro, 2 * local)
            whole = noise_levels.cycle_levels(2 * local, levels, start)
            one += whole.tolist()
            two += torch.cat([whole[lo : lo + local] for lo in (0, local)]).tolist()
    assert one == two
    expected = [levels[i % 5] for i in range(3 * accum * 2 * local)]
    assert one == pytest.approx(expected)


def test_training_takes_the_levels_in_order(tmp_path, dataset, monkeypatch):
    """A real run, batch 2, accumulation 2, 3 steps: the global batches' levels are the list in order."""
    seen = []
    real = objective.sample_sigmas
    monkeypatch.setattr(objective, "sample_sigmas", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    train(build_run(load_config(write_config(tmp_path, dataset, train_batch_size=2, gradient_accumulation_steps=2,
                                             max_train_steps=3, flow_custom_timesteps="1000,500,250",
                                             flow_timesteps_mode="round-robin"))))
    assert len(seen) == 6
    assert torch.cat(seen).tolist() == pytest.approx([[1.0, 0.5, 0.25][i % 3] for i in range(12)])
