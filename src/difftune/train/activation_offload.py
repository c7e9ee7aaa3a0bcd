"""Activation offload (`gradient_checkpointing_backend: "unsloth"`, SimpleTuner's name for it): under gradient
checkpointing, what a checkpointed block keeps for the backward pass is its input (the hidden states); here that
input waits in CPU memory instead of on the accelerator, and comes back, one block ahead, when the backward pass
recomputes the block.

Why: with checkpointing, the inputs of every block are what remains of the activations, and at video sizes they
are most of the peak (K5 Video Pro 81 frames, streamed: 15.8 of 25.9 GiB on an H100). No weight lever touches
them. Offloaded, the accelerator holds about two blocks' inputs at a time.

How, from outside the model: diffusers calls our checkpoint function for each block (train/checkpointing.py);
torch's non-reentrant checkpoint saves the block's inputs through autograd's saved-tensor mechanism before it
installs its own hooks for the inside of the block, so a `saved_tensors_hooks` pair around the call sees those
inputs and nothing else. Only the first argument (the hidden states that flow from block to block) moves; the
other arguments (mask, rotary embedding, time and text embeddings) are the same tensors for every block and stay
where they are.

- Forward: the input is copied into pinned CPU memory on a side CUDA stream, after the compute stream has made it;
  `record_stream` keeps the allocator from reusing its memory before the copy has read it.
- Backward: recomputation unpacks block i's input (waiting for its copy) and starts copying block i-1's input on
  the side stream, which overlaps block i's recompute and backward.
- Without CUDA the same code runs synchronously (a copy at the original's alignment: see offload.aligned_copy),
  so CPU tests prove that losses and gradients are bit-identical with and without it. It saves nothing there.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from difftune.train.checkpointing import enable_checkpointing
from difftune.train.offload import aligned_copy


@dataclass(eq=False)
class Stored:
    """One offloaded block input: its bytes in CPU memory, and its way back."""

    host: torch.Tensor
    device: torch.device
    align: int
    previous: weakref.ReferenceType | None  # the input stored before this one (the next one the backward needs)
    back: torch.Tensor | None = None  # on the accelerator again (copy made or in flight)
    ready: Any = None  # CUDA event after the side stream's copy back (the copy out ran before it, same stream)


class ActivationOffload:
    """Moves checkpointed blocks' inputs to CPU memory and back. `device`: the accelerator."""

    def __init__(self, device: torch.device, emit: Any = None):
        self.device = torch.device(device)
        self.emit = emit  # events.emit: the bytes stored by the first training forward, once
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.last: weakref.ReferenceType | None = None  # the most recent input stored (this step's forward)
        self.stored_bytes = 0  # of the current forward: what the accelerator did not keep
        self.fetches = 0  # inputs brought back (tests: the path ran)

    def call(self, block: torch.nn.Module, *args: Any) -> Any:
        """Run `block` under non-reentrant checkpointing with its first argument offloaded."""
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is None or not torch.is_grad_enabled():
            return checkpoint(block.__call__, *args, use_reentrant=False)
        # autograd keeps the pack hook as long as the saved tensor: a closure over `first` would keep it alive
        target = weakref.ref(first)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, target()), self._unpack):
            return checkpoint(block.__call__, *args, use_reentrant=False)

    def forward_starts(self) -> None:
        """A new training forward: the chain of stored inputs starts again."""
        if self.emit is not None and self.stored_bytes:
            self._report(self.stored_bytes)
        self.last = None
        self.stored_bytes = 0

    def _report(self, stored: int) -> None:
        """Once, after the first training forward: what waits in CPU memory per micro-batch, against what the
        machine has free (a larger bucket stores proportionally more)."""
        import psutil

        emit, self.emit = self.emit, None
        free = psutil.virtual_memory().available
        message = (f"activation offload: {stored / 2**30:.2f} GiB of checkpointed block inputs in CPU memory per "
                   f"micro-batch of this size ({free / 2**30:.1f} GiB of CPU memory free)")
        emit("warning" if stored > free / 2 else "info", message=message, offloaded_bytes=stored)

    # --- the hooks

    def _pack(self, t: torch.Tensor, first: torch.Tensor | None) -> Any:
        if first is None or (t is not first and not _same(t, first)):
            return t
        align = t.data_ptr() % 64
        if self.stream is None:
            host = aligned_copy(t.detach(), align)
            stored = Stored(host, t.device, align, self.last)
        else:
            compute = torch.cuda.current_stream(self.device)
            host = torch.empty_like(t, device="cpu", pin_memory=True)  # the same strides, so the same kernels
            self.stream.wait_stream(compute)  # the block before has written t
            with torch.cuda.stream(self.stream):
                host.copy_(t.detach(), non_blocking=True)
            t.record_stream(self.stream)  # not reused by the compute stream before the copy has read it
            stored = Stored(host, t.device, align, self.last)
        self.last = weakref.ref(stored)
        self.stored_bytes += t.numel() * t.element_size()
        return stored

    def _fetch(self, stored: Stored) -> None:
        if stored.back is not None:
            return
        if self.stream is None:
            stored.back = aligned_copy(stored.host, stored.align)
            return
        with torch.cuda.stream(self.stream):  # after the copy to the host (same stream)
            stored.back = stored.host.to(stored.device, non_blocking=True)
            stored.ready = self.stream.record_event()

    def _unpack(self, stored: Any) -> torch.Tensor:
        if not isinstance(stored, Stored):
            return stored
        self._fetch(stored)
        back, stored.back = stored.back, None  # the recompute holds it from here; a second unpack copies again
        if stored.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(stored.ready)
            back.record_stream(compute)  # made on the side stream, read on the compute stream
            stored.ready = None
        self.fetches += 1
        earlier = stored.previous() if stored.previous is not None else None
        if earlier is not None:
            self._fetch(earlier)  # overlaps this block's recompute and backward
        return back


def _same(t: torch.Tensor, first: torch.Tensor) -> bool:
    """Whether autograd handed the hook another tensor object for the same data (the saved input's alias)."""
    return (t.device == first.device and t.dtype == first.dtype and t.shape == first.shape
            and t.stride() == first.stride() and t.numel() > 0 and t.data_ptr() == first.data_ptr())


def offload_activations(cfg: Any, transformer: torch.nn.Module, device: torch.device,
                        emit: Any) -> ActivationOffload | None:
    """gradient_checkpointing_backend 'unsloth': checkpoint the blocks through an ActivationOffload (None when off).
    Call after the adapter attaches (build_adapter turns checkpointing on)."""
    if getattr(cfg, "gradient_checkpointing_backend", "torch") != "unsloth":
        return None
    offload = ActivationOffload(device, emit)
    enable_checkpointing(transformer, cfg.gradient_checkpointing_interval, offload.call)

    def starts(module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            offload.forward_starts()

    transformer.register_forward_pre_hook(starts)
    where = ("pinned CPU memory, copied on a side CUDA stream" if offload.stream is not None else
             "a CPU copy made synchronously (no CUDA: this saves no memory, the path runs as on a GPU)")
    emit("info", message=f"activation offload: each checkpointed block's input waits in {where}, and comes back "
                         "one block ahead of the backward pass")
    return offload
