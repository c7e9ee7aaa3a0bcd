"""Gradient checkpointing of the transformer's blocks, all of them or every n-th one
(`gradient_checkpointing`, `gradient_checkpointing_interval`).

diffusers' transformers call `self._gradient_checkpointing_func(block, *args)` for each block while
checkpointing is on, and `enable_gradient_checkpointing` takes that function as an argument: the only
hook we need. With an interval n, blocks 0, n, 2n, ... of each block list are checkpointed (their
activations recomputed in the backward pass) and the others keep their activations: memory between
"none" and "all", speed too. Interval 1 is diffusers' own behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def block_positions(transformer: torch.nn.Module) -> dict[int, int]:
    """id(block) -> its index in the ModuleList that holds it, for every ModuleList of the model."""
    return {id(block): index for module in transformer.modules() if isinstance(module, torch.nn.ModuleList)
            for index, block in enumerate(module)}


def checkpointed(block: torch.nn.Module, *args: Any) -> Any:
    return checkpoint(block.__call__, *args, use_reentrant=False)


def enable_checkpointing(transformer: Any, interval: int | None,
                         run_checkpointed: Callable[..., Any] = checkpointed) -> None:
    """Turn on checkpointing of every `interval`-th block (None or 1: every block). `run_checkpointed(block,
    *args)` runs one checkpointed block (train/activation_offload.py offers another)."""
    every = interval or 1
    positions = block_positions(transformer)

    def checkpoint_some(block: torch.nn.Module, *args: Any) -> Any:
        if positions.get(id(block), 0) % every:
            return block(*args)  # keeps its activations
        return run_checkpointed(block, *args)

    transformer.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint_some)
