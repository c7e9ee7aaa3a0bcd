"""Read-ahead of batches (train/prefetch.py), device-side noise and the one-sync step (train/loop.py).

Read-ahead must change nothing but speed: the same batches in the same order, the same losses, and a
checkpoint that resumes after the batches consumed, not after those still in the queue."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from conftest import write_config
from difftune.config import load_config
from difftune.demo import make_dataset
from difftune.train import loop
from difftune.train.loop import train
from difftune.train.prefetch import Prefetcher
from difftune.train.setup import build_run


def losses(output_dir):
    lines = (output_dir / "events.jsonl").read_text().splitlines()
    return {e["step"]: e["loss"] for e in map(json.loads, lines) if e["event"] == "step"}


def events(output_dir, kind):
    lines = (output_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prefetch") / "images"
    make_dataset(folder, count=6)
    return folder


def test_read_ahead_yields_the_same_batches(tmp_path, images):
    run = build_run(load_config(write_config(tmp_path, images, train_batch_size=2, max_train_steps=1)))
    start = run.data.sampler.state_dict()
    plain = iter(run.data)
    expected = [next(plain) for _ in range(7)]  # more than an epoch (3 batches): crosses the epoch boundary
    run.data.sampler.load_state_dict(start)
    ahead = Prefetcher(run.data, torch.device("cpu"), depth=3)
    got = [next(ahead) for _ in range(7)]
    ahead.close()
    assert not any(t.name == "difftune-prefetch" and t.is_alive() for t in threading.enumerate())
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a.latents, b.latents)
        assert torch.equal(a.text["prompt_embeds"], b.text["prompt_embeds"])
        assert a.captions == b.captions and a.paths == b.paths and a.position == b.position
    # The sampler itself ran ahead of what was consumed: that is why batches carry their position.
    assert run.data.sampler.state_dict() != got[-1].position


def test_an_error_while_reading_ahead_reaches_the_loop():
    class Damaged(RuntimeError):
        pass

    def source():
        yield from ()
        raise Damaged("every training item was left out")

    ahead = Prefetcher(source(), torch.device("cpu"), depth=2)
    with pytest.raises(Damaged, match="left out"):
        next(ahead)


def test_same_losses_with_and_without_read_ahead(tmp_path, images):
    common = dict(max_train_steps=5, train_batch_size=2, gradient_accumulation_steps=2)
    train(build_run(load_config(write_config(tmp_path / "a", images, dataloader_prefetch=False, **common))))
    train(build_run(load_config(write_config(tmp_path / "b", images, dataloader_prefetch_qlen=8, **common))))
    assert losses(tmp_path / "a" / "output") == losses(tmp_path / "b" / "output")


def test_checkpoint_saves_the_position_consumed_not_read(tmp_path, images):
    """Depth 8 reads far past the checkpoint at step 2; the resumed run must still see every batch."""
    config = write_config(tmp_path, images, max_train_steps=6, checkpoint_step_interval=2, train_batch_size=2,
                          dataloader_prefetch_qlen=8, resume_from_checkpoint="latest")
    reference = write_config(tmp_path / "ref", images, max_train_steps=6, train_batch_size=2)
    train(build_run(load_config(reference)))
    real = loop.optimizer_step

    def dying(run, batches):
        if run.state.step == 3:
            raise RuntimeError("killed")
        return real(run, batches)

    loop.optimizer_step = dying
    try:
        with pytest.raises(RuntimeError, match="killed"):
            train(build_run(load_config(config)))
    finally:
        loop.optimizer_step = real
    state = json.loads((tmp_path / "output" / "checkpoints" / "checkpoint-0000002" / "training_state.json").read_text())
    fresh = iter(build_run(load_config(reference)).data)
    second = [next(fresh) for _ in range(2)][-1]
    assert state["sampler"] == second.position  # after the 2 batches trained on, not the 8 read ahead
    train(build_run(load_config(config)))
    assert losses(tmp_path / "output") == losses(tmp_path / "ref" / "output")


def test_noise_generator_from_another_device_is_reseeded_with_a_warning(tmp_path, images):
    config = write_config(tmp_path, images, max_train_steps=2, checkpoint_step_interval=1,
                          resume_from_checkpoint="latest")
    train(build_run(load_config(config)))
    ckpt = tmp_path / "output" / "checkpoints" / "checkpoint-0000002"
    rng = torch.load(ckpt / "rng.pt", weights_only=True)
    rng["generator_device"] = "cuda"  # as a GPU run writes it (a CUDA generator's state)
    rng["generator"] = torch.zeros(16, dtype=torch.uint8)
    torch.save(rng, ckpt / "rng.pt")
    path = write_config(tmp_path, images, max_train_steps=3, checkpoint_step_interval=1,
                        resume_from_checkpoint="latest")
    train(build_run(load_config(path)))
    warnings = [e["message"] for e in events(tmp_path / "output", "warning")]
    assert any("saved by a run on cuda" in m and "will not match" in m for m in warnings), warnings
    assert max(losses(tmp_path / "output")) == 3
