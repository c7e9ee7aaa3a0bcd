"""Prodigy under FSDP2 (train/prodigy_fsdp.py): its step-size estimate sums over every trainable element, and the
`.item()` of a sum over a sharded DTensor is this process's part only, so each process estimated its own step
size. Two processes (gloo, CPU) must step as one process with the same global batch: the same d on every process,
the same losses and weights. Uneven shards, which Prodigy cannot flatten, are refused with the fix."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from conftest import write_config
from difftune.demo import make_dataset
from difftune.train.optimizers import build_optimizer, setting_problem

BETAS = (0.9, 0.999)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toy(rows: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, rows), torch.nn.Tanh(), torch.nn.Linear(rows, 2))
    with torch.no_grad():
        model[2].weight.zero_()  # all zero, like a LoRA's B: Prodigy keeps no p0 copy of it (its `p.any()`)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def prodigy_steps(model, whole: torch.nn.Parameter, x, y, settings: dict, steps: int = 5) -> dict:
    """`steps` Prodigy steps on the mean squared error of (x, y) plus a term on `whole` (a parameter every process
    holds whole, like the CREPA projector); the losses, d after each step, and the weights."""
    optimizer = build_optimizer("prodigy", [*model.parameters(), whole], 1.0, BETAS, 0.0, 1e-8, settings)
    losses, ds = [], []
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean() + 0.01 * (whole ** 2).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        ds.append(optimizer.param_groups[0]["d"])
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist() for k, v in model.state_dict().items()}
    return {"losses": losses, "d": ds, "weights": weights, "class": type(optimizer).__name__}


def worker(rank: int, world: int, port: int, out: str, settings: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    from difftune.train.prodigy_fsdp import GlobalScalars

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result: dict = {}
        model = toy()
        for layer in (model[0], model[2], model):
            fully_shard(layer)
        weight = model[0].weight  # [4, 6] sharded by rows: 2 on each process
        total = (weight.full_tensor() ** 2).sum().item()
        square = (weight * weight).sum()  # a Partial DTensor: each process holds its rows' part
        assert square.placements == (Partial("sum"),)
        result["local_item"], result["total"] = square.item(), total
        rows = distribute_tensor(torch.tensor([[0.0, 0.0], [1.0, 1.0]]), weight.device_mesh, [Shard(0)])
        # process 0 holds the zero row: Prodigy's `if p.any()` over it alone is False (torch 2.13 answered so for
        # the DTensor itself; torch 2.15's any() of a sharded tensor already answers for the whole)
        result["local_any"] = bool(rows.to_local().any())
        with GlobalScalars():
            result["global_item"], result["global_any"] = square.item(), bool(rows.any())
        x, y = batch()
        result |= prodigy_steps(model, torch.nn.Parameter(torch.ones(3)), x.chunk(world)[rank], y.chunk(world)[rank],
                                settings)
        uneven = toy(rows=5)
        for layer in (uneven[0], uneven[2], uneven):
            fully_shard(layer)
        try:
            build_optimizer("prodigy", list(uneven.parameters()), 1.0, BETAS, 0.0, 1e-8)
        except ValueError as e:
            result["uneven"] = str(e)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("settings", [{"d0": 1e-3}, {"d0": 1e-3, "slice_p": 2}])
def test_two_shards_estimate_the_step_size_of_one_process(tmp_path, settings):
    import torch.multiprocessing as mp

    x, y = batch()
    one = prodigy_steps(toy(), torch.nn.Parameter(torch.ones(3)), x, y, settings)
    assert one["class"] == "Prodigy"  # one process: prodigyopt's class itself, unchanged
    out = str(tmp_path / "result")
    mp.spawn(worker, args=(2, free_port(), out, settings), nprocs=2)
    ranks = [json.loads(open(f"{out}.{rank}").read()) for rank in range(2)]
    for rank in ranks:
        # what Prodigy reads without the fix: one process's part of the sum
        assert rank["local_item"] != pytest.approx(rank["total"], rel=1e-3)
        assert rank["global_item"] == pytest.approx(rank["total"], rel=1e-6)
        assert rank["global_any"] is True
        assert rank["class"] == "ShardedProdigy"
        assert rank["d"] == ranks[0]["d"]  # every process steps with the same size
        assert rank["d"] == pytest.approx(one["d"], rel=1e-5) and rank["d"][-1] > 10 * one["d"][0]  # d grew
        for key, value in one["weights"].items():
            torch.testing.assert_close(torch.tensor(rank["weights"][key]), torch.tensor(value), rtol=1e-5, atol=1e-7)
        assert "tensor of shape [5, 6] splits its 5 rows unevenly" in rank["uneven"]
        assert "Use a number of processes that divides 5" in rank["uneven"]
    assert [rank["local_any"] for rank in ranks] == [False, True]
    # the mean of the two halves' losses is the whole batch's loss, at every step
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    assert mean == pytest.approx(one["losses"], rel=1e-5)


def test_fsdp_in_use_is_refused_with_the_reason():
    problem = setting_problem("prodigy", "fsdp_in_use", True)
    assert problem and "train/prodigy_fsdp.py" in problem and "once per process" in problem


@pytest.mark.slow  # 20-33 s on 2 cores (two runs of the trainer)
def test_training_with_fsdp_equals_one_process(tmp_path):
    """The trainer end to end: LoRA on the tiny Lumina2, 2 FSDP2 processes with a batch of 1 against 1 process with
    a batch of 2. d starts at 1e-3 so that Prodigy's steps move the losses. Measured before the fix: the loss of
    step 4 1.1e-4 apart (relative) and the LoRA weights 1.3e-2 (relative norm of the difference); after it, within
    fp32 summation order (2e-5)."""
    from safetensors.torch import load_file

    from test_distributed import finish, launch
    from test_train import losses

    images = tmp_path / "images"
    make_dataset(images, count=8)
    settings = dict(optimizer="prodigy", learning_rate=1.0, max_train_steps=4, optimizer_config="d0=1e-3")
    finish(launch(write_config(tmp_path / "two", images, train_batch_size=1, fsdp_enable=True, **settings),
                  free_port()))
    finish(launch(write_config(tmp_path / "one", images, train_batch_size=2, **settings), 0, processes=1))
    one, two = tmp_path / "one" / "output", tmp_path / "two" / "output"
    la, lb = losses(one), losses(two)
    assert la.keys() == lb.keys() == {1, 2, 3, 4} and all(la[k] == pytest.approx(lb[k], rel=1e-5) for k in la)
    a, b = load_file(one / "pytorch_lora_weights.safetensors"), load_file(two / "pytorch_lora_weights.safetensors")
    # Adam-like steps divide near-zero gradients by their own size, so single elements carry fp32 summation-order
    # differences (a batch of 2 against 1 + 1); the tensors as a whole agree
    assert a.keys() == b.keys() and max(((b[k] - a[k]).norm() / a[k].norm()).item() for k in a) < 1e-4


@pytest.mark.slow  # 35-50 s each on 2 cores (three two-process runs)
@pytest.mark.parametrize("layout", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_a_resumed_fsdp_run_repeats_the_uninterrupted_one(tmp_path, layout):
    """Prodigy's state under FSDP2 survives a checkpoint: before, the resume failed (SHARDED: the saved scalar p0
    of the all-zero LoRA B against the [192] one a first step on the loaded weights makes; FULL: the group keys
    d_denom and d_hat that a fresh optimizer lacks)."""
    from test_distributed import finish, launch
    from test_train import losses

    images = tmp_path / "images"
    make_dataset(images, count=8)
    common = dict(optimizer="prodigy", learning_rate=1.0, optimizer_config="d0=1e-3", train_batch_size=1,
                  fsdp_enable=True, fsdp_state_dict_type=layout, checkpoint_step_interval=2,
                  resume_from_checkpoint="latest")
    finish(launch(write_config(tmp_path / "ref", images, max_train_steps=6, **common), free_port()))
    finish(launch(write_config(tmp_path / "cut", images, max_train_steps=4, **common), free_port()))
    finish(launch(write_config(tmp_path / "cut", images, max_train_steps=6, **common), free_port()))
    log = [json.loads(line) for line in (tmp_path / "cut" / "output" / "events.jsonl").read_text().splitlines()]
    assert [e["message"] for e in log if e["event"] == "info" and "resumed" in e["message"]][-1].endswith("at step 4")
    assert [e["step"] for e in log if e["event"] == "step"] == [1, 2, 3, 4, 5, 6]
    assert losses(tmp_path / "ref" / "output") == losses(tmp_path / "cut" / "output")  # bit for bit
