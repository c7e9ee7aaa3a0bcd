"""Prodigy (prodigyopt) on FSDP2-sharded parameters (`optimizer: prodigy` with `fsdp_enable`).

Prodigy sets its step size d from two sums over every trainable element: the dot product of each gradient with
the distance travelled (p0 - p) and the magnitude of its running gradient sum s. It reads each tensor's share of
them with `.item()`. Under FSDP2 a parameter is a DTensor holding one shard per process, and the dot product or
sum of a sharded DTensor is a `Partial` DTensor: its `.item()` returns this process's own part, not the sum over
the processes (measured with torch 2.13 and 2.15: tests/test_prodigy_fsdp.py). So each process would estimate d from its
own shards only: the processes step with different sizes, and the result differs from one process with the same
global batch (the tiny Lumina2's LoRA weights 1-5% apart after 4-5 steps).

prodigyopt's own switch for sharded training, `fsdp_in_use`, was written for torch's older FSDP (flat local
tensors): it sums the two totals over the processes in a tensor it puts on `.cuda()` (so it cannot run on CPU
processes), and it would count a parameter that every process holds whole once per process. Instead,
`ShardedProdigy` runs its step under `GlobalScalars`, which reads every `Partial` scalar as its sum over the
processes (`full_tensor()`, one all-reduce per read): each total is then the single-process one, the same on every
process, and a parameter held whole counts once. The price is one small all-reduce per
parameter and sum (Prodigy already waits for the device at each `.item()`). `fsdp_in_use` stays off (and
optimizer_config may not set it).

Prodigy flattens every parameter (`p.flatten()`), which a DTensor allows only when its shards are equal: a
tensor whose sharded dimension the number of processes does not divide is refused when the optimizer is built
(`uneven_problem`), with the fix, rather than failing inside the first step.

Resuming: torch.distributed.checkpoint reads the saved state into the layout of a fresh optimizer's state, made by
a first step with zero gradients. Prodigy's state depends on the weights at that step (an all-zero tensor, a LoRA's
B at the start, gets a scalar p0), so checkpoint.load_checkpoint loads the optimizer state before the weights; and
the keys Prodigy's step adds to its parameter groups are there from the start (`ShardedProdigy.__init__`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _partial(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor) and any(p.is_partial() for p in value.placements)


class GlobalScalars(TorchFunctionMode):
    """While active, `.item()` and `bool()` of a DTensor holding per-process parts (`Partial`) read the whole
    value: the sum over the processes, the same on every process. Every process must run the same reads in the
    same order (each is a collective), as the processes of one optimizer step do."""

    READS = (torch.Tensor.item, torch.Tensor.__bool__)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.READS and args and _partial(args[0]):
            return func(args[0].full_tensor(), *args[1:], **kwargs)
        return func(*args, **kwargs)


def sharded(params: list) -> bool:
    """Whether any of `params` is an FSDP2 shard (a DTensor)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def uneven_problem(params: list) -> str | None:
    """Why Prodigy cannot flatten one of these sharded parameters (a sharded dimension that the processes do not
    divide evenly), or None."""
    from torch.distributed.tensor import DTensor, Shard

    for p in params:
        if not isinstance(p, DTensor) or p.dim() < 2:  # a 1-D tensor flattens to itself
            continue
        for mesh_dim, placement in enumerate(p.placements):
            if isinstance(placement, Shard) and p.shape[placement.dim] % p.device_mesh.size(mesh_dim):
                count, size = p.device_mesh.size(mesh_dim), p.shape[placement.dim]
                return (f"optimizer 'prodigy' with fsdp_enable flattens each trainable tensor, which FSDP2 allows only "
                        f"when the {count} processes hold equal shards; a tensor of shape {list(p.shape)} splits its "
                        f"{size} rows unevenly. Use a number of processes that divides {size} (with LoRA: a lora_rank "
                        "that it divides), or another optimizer")
    return None


def sharded_class(prodigy: type) -> type:
    """A subclass of prodigyopt's Prodigy whose step runs under `GlobalScalars` (its state and state_dict are
    Prodigy's own, so checkpoints are unchanged)."""

    class ShardedProdigy(prodigy):
        def __init__(self, params: Any, **kwargs: Any) -> None:
            super().__init__(params, **kwargs)
            for group in self.param_groups:  # what Prodigy's step adds to its groups (read by nothing), there from
                group.setdefault("d_denom", 0.0)  # the start: a checkpoint's state is read into a fresh optimizer's
                group.setdefault("d_hat", group["d"])  # layout, which must name every key (FULL_STATE_DICT)

        def step(self, closure: Any = None) -> Any:
            with GlobalScalars():
                return super().step(closure)

    return ShardedProdigy
