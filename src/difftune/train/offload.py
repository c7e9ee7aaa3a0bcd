"""Block streaming (`enable_group_offload`, `musubi_blocks_to_swap`): the frozen weights of the transformer's
block stacks live in CPU memory and visit the accelerator one group of blocks at a time.

Our own hooks on diffusers' modules, from outside (diffusers' group-offload hooks do not replay safely under
gradient checkpointing with streams). What streams is the bytes of each frozen parameter of a streamed block
(`requires_grad` False: the base weights under LoRA / LyCORIS); a quantized weight (optimum-quanto, torchao:
tensor subclasses) streams the plain tensors it is made of. Trainable parameters, buffers and everything outside
the streamed blocks (embedders, norms, final layer) stay resident.

- Offloaded is a real state: the tensor's `.data` is an empty tensor on the accelerator; loading copies the
  stored CPU bytes back (pinned memory with CUDA). A forgotten load crashes, it cannot go unnoticed.
- Forward: entering a block of group g installs g (waiting for its copy), drops every other group but g+1, and
  prefetches g+1. So at most two groups hold their weights: the running one and the next. Inference (no grad)
  drops everything when the forward ends; training keeps the last group, where the backward pass begins.
- Backward, with gradient checkpointing: recomputation re-enters each block, last to first; the same hook then
  prefetches g-1 instead of g+1 (the direction is "outside the transformer's forward").
- Backward, without checkpointing: autograd would keep every weight it saved (a view such as W.t() holds the
  storage) alive until backward. A `saved_tensors_hooks` pair packs a saved tensor that lies in a streamed
  storage as a handle (group, slot, view geometry) and re-fetches it on unpack, prefetching g-1. A tensor derived
  from a weight by a copy (an autocast cast, a dequantized weight) is not recognisable and is kept by autograd,
  as activations are: correct, but memory is only bounded as promised with gradient checkpointing.
- With `group_offload_use_stream` on CUDA the prefetch copies run on a side stream; the compute stream waits on
  the copy's event before it installs the tensors, and `record_stream` tells the caching allocator that the
  compute stream uses them, so a dropped group's memory is not reused before the kernels reading it are done.
  Without CUDA the same code runs synchronously (the prefetch is a plain copy); without the stream there is no
  prefetch: a group is copied on the compute stream when it is entered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass
class Slot:
    """One plain tensor whose bytes stream: a frozen parameter of a streamed block, or a plain tensor inside a
    quantized one (`inner`: the attribute path). Found again by its path on every use: a module's `.to()` may
    replace a tensor subclass's inner objects."""

    module: torch.nn.Module
    name: str
    inner: tuple[str, ...]
    stored: torch.Tensor  # the bytes, in CPU memory (pinned with CUDA)
    align: int = 0  # the original tensor's address modulo 64 (see `aligned_copy`)

    def top(self) -> torch.Tensor:
        return self.module._parameters[self.name]

    def tensor(self) -> torch.Tensor:
        t = self.top()
        for attribute in self.inner:
            t = getattr(t, attribute)
        return t


@dataclass
class Group:
    index: int
    blocks: list[int]  # indices in the streamed order
    slots: list[Slot] = field(default_factory=list)
    state: str = "away"  # "away" (offloaded), "coming" (copy made or in flight), "here" (installed)
    copies: list[torch.Tensor] | None = None
    ready: Any = None  # CUDA event recorded after the side stream's copies

    def nbytes(self) -> int:
        return sum(s.stored.numel() * s.stored.element_size() for s in self.slots)


@dataclass(frozen=True)
class Packed:
    """A saved tensor that lies in a streamed storage, as autograd keeps it between forward and backward."""

    group: int
    slot: int
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None  # size, stride, offset in the slot; None: the top


def aligned_copy(stored: torch.Tensor, align: int) -> torch.Tensor:
    """A CPU copy of `stored` at an address with the original's remainder modulo 64. CPU BLAS (MKL) can round
    differently at other alignments (weights loaded from safetensors sit at 8-byte offsets, fresh copies at
    64), and a streamed run must give the resident run's numbers bit for bit."""
    size = stored.element_size()
    if align % size or stored.numel() == 0:
        return stored.clone()
    spare = torch.empty(stored.numel() + 64 // size, dtype=stored.dtype)
    shift = (align - spare.data_ptr() % 64) % 64 // size
    copy = spare.as_strided(stored.size(), stored.stride(), shift)
    copy.copy_(stored)
    return copy


def plain_paths(t: torch.Tensor, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Attribute paths of the plain tensors a (possibly quantized) tensor is made of. A parameter subclass that
    holds its own storage (bitsandbytes' Params4bit: packed bytes, with a small quantization state beside them
    that stays resident) streams as a plain tensor."""
    if type(t) in PLAIN or (isinstance(t, torch.nn.Parameter) and not hasattr(t, "__tensor_flatten__")):
        yield path
        return
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        raise ValueError(f"cannot stream a {type(t).__name__} weight (it does not say which tensors it holds)")
    for name in flatten()[0]:
        yield from plain_paths(getattr(t, name), path + (name,))


class BlockStreamer:
    """The streamed blocks' weights and the hooks that move them. `blocks`: in execution order."""

    def __init__(self, transformer: torch.nn.Module, blocks: list[torch.nn.Module], per_group: int,
                 device: torch.device, prefetch: bool):
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.stream = torch.cuda.Stream(self.device) if prefetch and self.device.type == "cuda" else None
        self.groups = [Group(i, list(range(start, min(start + per_group, len(blocks)))))
                       for i, start in enumerate(range(0, len(blocks), per_group))]
        self.group_of = {id(b): i // per_group for i, b in enumerate(blocks)}
        self.index_of = {id(b): i for i, b in enumerate(blocks)}
        self.by_ptr: dict[int, tuple[int, int]] = {}  # storage address of an installed slot -> (group, slot)
        self.by_id: dict[int, tuple[int, int]] = {}  # id of an installed quantized parameter -> (group, slot)
        self.in_forward = False
        self.saving: Any = None
        self.peak = 0  # most groups holding weights at once, since the start
        self.trace: list[tuple[int, int | None, int, int]] | None = None  # (group, block, direction, groups holding)
        for group in self.groups:
            for i in group.blocks:
                group.slots += self._take(blocks[i])
        self.handles = [
            transformer.register_forward_pre_hook(self._forward_starts),
            transformer.register_forward_hook(self._forward_ends, always_call=True),
            *(b.register_forward_pre_hook(self._block_starts) for b in blocks),
        ]

    # --- setup

    def _take(self, block: torch.nn.Module) -> list[Slot]:
        """Store a block's frozen weights in CPU memory and leave empty tensors on the accelerator. The block
        visits the accelerator first, so a quantized weight is stored in the layout it has there."""
        block.to(self.device)
        slots, seen = [], set()
        for module in block.modules():
            for name, p in module._parameters.items():
                if p is None or p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                for path in plain_paths(p):
                    t = p
                    for attribute in path:
                        t = getattr(t, attribute)
                    # pinned with CUDA: asynchronous copies to the device need page-locked memory
                    stored = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu",
                                                 pin_memory=self.device.type == "cuda")
                    stored.copy_(t.detach())
                    slots.append(Slot(module, name, path, stored, t.data_ptr() % 64))
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        return slots

    # --- state

    def holding(self) -> int:
        """Groups whose weights occupy accelerator memory (installed or on their way)."""
        return sum(g.state != "away" for g in self.groups)

    def streamed_bytes(self) -> int:
        return sum(g.nbytes() for g in self.groups)

    def _fetch(self, group: Group, side: bool) -> None:
        """Copy a group's stored bytes to the accelerator (on the side stream when `side`)."""
        if self.device.type != "cuda":
            group.copies = [aligned_copy(s.stored, s.align) for s in group.slots]  # synchronous on the CPU
        elif side and self.stream is not None:
            with torch.cuda.stream(self.stream):
                group.copies = [s.stored.to(self.device, non_blocking=True) for s in group.slots]
                group.ready = self.stream.record_event()
        else:  # on the compute stream: ordered before the block's kernels, no event needed
            group.copies = [s.stored.to(self.device, non_blocking=True) for s in group.slots]
        group.state = "coming"

    def _install(self, index: int) -> None:
        group = self.groups[index]
        if group.state == "here":
            return
        if group.state == "away":
            self._fetch(group, side=False)
        if group.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(group.ready)
        for i, (slot, copy) in enumerate(zip(group.slots, group.copies or [], strict=True)):
            if group.ready is not None:
                copy.record_stream(compute)  # allocated on the side stream, read on the compute stream
            t = slot.tensor()
            t.data = copy
            if copy.numel():
                self.by_ptr[copy.untyped_storage().data_ptr()] = (index, i)
            if slot.inner:
                self.by_id[id(slot.top())] = (index, i)
        group.copies, group.ready, group.state = None, None, "here"

    def _drop(self, group: Group) -> None:
        if group.state == "here":
            for slot in group.slots:
                t = slot.tensor()
                if t.numel():
                    self.by_ptr.pop(t.untyped_storage().data_ptr(), None)
                self.by_id.pop(id(slot.top()), None)
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        group.copies, group.ready, group.state = None, None, "away"

    def _keep(self, keep: set[int]) -> None:
        for group in self.groups:
            if group.state != "away" and group.index not in keep:
                self._drop(group)

    def _enter(self, index: int, direction: int, block: int | None) -> None:
        """Group `index` is about to run (direction +1: forward, -1: backward): install it, drop the others,
        prefetch the next one in that direction."""
        upcoming = index + direction
        if not (self.prefetch and 0 <= upcoming < len(self.groups)):
            upcoming = None
        self._keep({index} if upcoming is None else {index, upcoming})  # first: never a third group
        self._install(index)
        if upcoming is not None and self.groups[upcoming].state == "away":
            self._fetch(self.groups[upcoming], side=True)
        held = self.holding()
        self.peak = max(self.peak, held)
        if self.trace is not None:
            self.trace.append((index, block, direction, held))

    # --- hooks

    def _forward_starts(self, module: torch.nn.Module, args: Any) -> None:
        self.in_forward = True
        if torch.is_grad_enabled():
            self.saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self.saving.__enter__()
        self._keep({0})
        if self.prefetch and self.groups[0].state == "away":
            self._fetch(self.groups[0], side=True)  # overlaps the embedders

    def _forward_ends(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.in_forward = False
        if self.saving is not None:
            saving, self.saving = self.saving, None
            saving.__exit__(None, None, None)
        if not torch.is_grad_enabled():
            self._keep(set())  # inference: nothing stays; training keeps the last group for the backward pass

    def _block_starts(self, module: torch.nn.Module, args: Any) -> None:
        # Outside the transformer's forward, a block runs only when checkpointing recomputes it in backward.
        self._enter(self.group_of[id(module)], 1 if self.in_forward else -1, self.index_of[id(module)])

    def _pack(self, t: torch.Tensor) -> Any:
        if type(t) in PLAIN:
            if not self.by_ptr or t.device.type != self.device.type or t.numel() == 0 or t.is_sparse:
                return t
            hit = self.by_ptr.get(t.untyped_storage().data_ptr())
            if hit is None or self.groups[hit[0]].slots[hit[1]].stored.dtype != t.dtype:
                return t
            start = self.groups[hit[0]].slots[hit[1]].tensor().storage_offset()
            return Packed(*hit, (tuple(t.size()), tuple(t.stride()), t.storage_offset() - start))
        hit = self.by_id.get(id(t))
        if hit is not None and self.groups[hit[0]].slots[hit[1]].top() is t:
            return Packed(*hit, None)
        return t

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, Packed):
            return packed
        self._enter(packed.group, -1, None)
        slot = self.groups[packed.group].slots[packed.slot]
        if packed.view is None:
            return slot.top()
        size, stride, offset = packed.view
        t = slot.tensor().detach()
        return t.as_strided(size, stride, t.storage_offset() + offset)


# --- which blocks stream


def streamed_blocks(transformer: torch.nn.Module, stacks: tuple[str, ...], last: int | None) -> list[torch.nn.Module]:
    """Every block of the family's stacks in execution order; `last`: only the last `last` of the main (final)
    stack (musubi_blocks_to_swap)."""
    if last is not None:
        return list(getattr(transformer, stacks[-1]))[-last:] if last else []
    return [block for name in stacks for block in getattr(transformer, name)]


def stream_blocks(
    cfg: Any, stacks: tuple[str, ...], transformer: torch.nn.Module, params: list[torch.nn.Parameter],
    device: torch.device, emit: Callable[..., Any],
) -> BlockStreamer | None:
    """Apply block streaming as the config asks (None when it does not), then move the rest of the transformer
    and the adapter's parameters to `device`. Call after the adapter attaches, before the optimizer is built."""
    if not cfg.enable_group_offload and not cfg.musubi_blocks_to_swap:
        return None
    if not stacks:
        raise ValueError(f"{cfg.model_family} has no block stacks to stream; set enable_group_offload to false")
    last = None
    if cfg.musubi_blocks_to_swap:
        size = len(getattr(transformer, stacks[-1]))
        last = min(cfg.musubi_blocks_to_swap, size)
        if last < cfg.musubi_blocks_to_swap:
            emit("warning", message=f"musubi_blocks_to_swap {cfg.musubi_blocks_to_swap}: the transformer's "
                                    f"{stacks[-1]} has {size} blocks; all {size} stream")
    blocks = streamed_blocks(transformer, stacks, last)
    per_group = 1 if last is not None else cfg.group_offload_blocks_per_group
    prefetch = True if last is not None else cfg.group_offload_use_stream
    streamer = BlockStreamer(transformer, blocks, per_group, device, prefetch)
    transformer.to(device)  # the resident rest; the streamed weights are empty tensors there already
    for p in params:  # a LyCORIS network is not a submodule of the transformer
        if p.device != torch.device(device):
            p.data = p.data.to(device)
    total = streamer.streamed_bytes()
    largest = max((g.nbytes() for g in streamer.groups), default=0)
    where = f"the last {last} of {stacks[-1]}" if last is not None else " + ".join(stacks)
    held = 2 if prefetch else 1  # the running group and the next one (BlockStreamer._enter)
    mode = ("prefetched on a side CUDA stream" if streamer.stream is not None else
            "prefetched synchronously (no CUDA)" if prefetch else "copied when needed, no prefetch")
    emit("info", message=f"block streaming: {len(blocks)} blocks ({where}) in {len(streamer.groups)} groups of "
                         f"{per_group}, {total / 2**20:.1f} MiB of frozen weights in CPU memory"
                         f"{' (pinned)' if torch.device(device).type == 'cuda' else ''}, {mode}; at most "
                         f"{held} group{'s' if held > 1 else ''} ({held * largest / 2**20:.1f} MiB) on the accelerator "
                         "at once",
         streamed_blocks=len(blocks), streamed_bytes=total, groups=len(streamer.groups))
    return streamer
