"""gradient_checkpointing_interval: every n-th block is checkpointed, the others keep their activations,
and the numbers do not change: the same losses as without checkpointing."""

from __future__ import annotations

import pytest

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.train import checkpointing
from difftune.train.loop import train
from difftune.train.setup import build_run
from test_train import losses


def counted(monkeypatch) -> list[int]:
    """Replace the checkpoint function by one that records the id of each checkpointed block."""
    calls: list[int] = []
    real = checkpointing.checkpoint

    def spy(function, *args, **kwargs):
        calls.append(id(function.__self__))
        return real(function, *args, **kwargs)

    monkeypatch.setattr(checkpointing, "checkpoint", spy)
    return calls


@pytest.mark.parametrize("interval, expected", [(None, {0, 1, 2, 3}), (2, {0, 2})])
def test_interval_checkpoints_every_nth_block_with_the_same_losses(tmp_path, dataset, monkeypatch, interval, expected):
    common = dict(max_train_steps=2, lora_rank=4, model_family="kandinsky5-image", model_flavour="tiny-random")
    plain = build_run(load_config(write_config(tmp_path / "plain", dataset, **common)))
    train(plain)
    calls = counted(monkeypatch)
    run = build_run(load_config(write_config(tmp_path / "ckpt", dataset, gradient_checkpointing=True,
                                             gradient_checkpointing_interval=interval, **common)))
    train(run)
    positions = checkpointing.block_positions(run.accelerator.unwrap_model(run.transformer))
    calls = [positions[c] for c in calls]
    # The tiny Kandinsky 5 has 4 visual blocks (and fewer text blocks): with interval 2, blocks 0 and 2 of
    # each list are checkpointed.
    assert calls and set(calls) == expected
    assert losses(run.output_dir) == losses(plain.output_dir)


def test_interval_without_checkpointing_is_a_config_error(tmp_path, dataset):
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, gradient_checkpointing_interval=2))
    assert "gradient_checkpointing_interval only acts with gradient_checkpointing" in "\n".join(info.value.problems)
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, gradient_checkpointing=True, gradient_checkpointing_interval=0))
    assert "gradient_checkpointing_interval" in "\n".join(info.value.problems)
