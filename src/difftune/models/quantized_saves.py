"""What autograd keeps for the backward pass of a quantized frozen linear layer (base_model_precision, issue 13).

A quantized base should lower a LoRA step's peak by the bytes the quantization saves. Measured with
memory_plan/measure.py on the real-size Lumina2 (one block at 1024x1024, LoRA r16, bf16 autocast: a bf16 base
keeps 744.5 MiB; tests/test_quantized_saves.py checks the same at 512x512, slow), the libraries' linear layers keep
more than a bf16 layer does, more than int8 saves, and the peak rose:

- torchao (int8, fp8 weight-only): `linear` on the weight's tensor subclass dequantizes above autograd, so the matrix
  product saves the full-precision weight it was given (int8: the int8 values cast to bf16, and the scales; fp8:
  the dequantized weight) to compute the input's gradient: +148.5 MiB a block, every layer's weight alive again in
  bf16 at the end of the forward, beside the int8 one.
- optimum-quanto (every qtype): its linear autograd Function saves the quantized weight, and also the layer's input,
  which it reads only for the weight's gradient: a frozen layer never needs it. +111.4 MiB a block: the inputs of
  attention's projections (peft's LoRA keeps its own fp32 copy) and of the feed-forward's down projection (4x wider).
- bitsandbytes NF4 already keeps only the 4-bit weight and dequantizes again in backward: left alone.

`lean_saves` wraps each quantized layer's forward, from outside, in `saved_tensors_hooks` that change only what that
layer's own forward saves:
- the layer's input (or a view of it) is kept as its shape alone (a tensor on the meta device): the gradient of a
  linear layer's input does not depend on it, and a library that read it anyway would fail loudly, not silently;
- a tensor made from the frozen weight alone (it needs no gradient and is not the weight itself) is kept as a
  recipe: when the backward pass asks for it, the layer runs again on a one-row input under the same autocast, and
  the same saved tensor is taken from that run. The same library code makes the same bits; the cost is one
  dequantization per layer in the backward pass, as bitsandbytes does;
- anything else (the quantized weight itself, which costs nothing) goes to the hooks outside unchanged, so block
  streaming (train/offload.py) still finds and fetches the streamed weights; a recipe fetches its layer's weight
  through them before it runs.
Inside torch.compile the wrapper steps aside: AOTAutograd chooses what its graphs save.
"""

from __future__ import annotations

import types
from typing import Any

import torch

PLAIN = (torch.Tensor, torch.nn.Parameter)
# The hooks active outside a layer (torch >= 2.8; private, as torch's own AOTAutograd reads it). Without it a
# layer's saves could not reach block streaming's hooks, so nothing is wrapped.
OUTER_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a (possibly quantized) tensor is made of."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) in PLAIN:
        return [t]
    return [p for name in flatten()[0] for p in _plain_parts(getattr(t, name))]


def _storage(t: torch.Tensor) -> int | None:
    """A plain tensor's storage address (None for a tensor subclass, a meta tensor or an empty storage)."""
    if type(t) not in PLAIN or t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
        return None
    return t.untyped_storage().data_ptr()


class _Input:
    """The layer's input, kept as its shape: unpacked as a meta tensor."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype = t.shape, t.dtype


class _Recipe:
    """The index-th weight-derived tensor the layer's forward saves, made again by `_Call.remake`."""

    def __init__(self, call: _Call, index: int, t: torch.Tensor):
        self.call, self.index = call, index
        self.form = (t.shape, t.stride(), t.dtype)


class _Outer:
    """A tensor packed by the hooks that were active outside the layer (block streaming's)."""

    def __init__(self, unpack: Any, packed: Any):
        self.unpack, self.packed = unpack, packed


class _Call:
    """One forward call of a wrapped layer with gradients on: its pack/unpack hooks and how to remake its saves."""

    def __init__(self, layer: torch.nn.Module, forward: Any, x: torch.Tensor, args: tuple, kwargs: dict):
        self.layer, self.forward, self.args, self.kwargs = layer, forward, args, kwargs
        self.row = dict(size=(1,) * (x.dim() - 1) + (x.shape[-1],), dtype=x.dtype, device=x.device)
        kind = x.device.type
        self.autocast = dict(device_type=kind, enabled=torch.is_autocast_enabled(kind),
                             dtype=torch.get_autocast_dtype(kind))
        self.inputs = {_storage(x)} - {None}
        self._own()
        self.outer = OUTER_HOOKS(False)  # (pack, unpack) or None
        self.weight: Any = None  # the layer's weight packed by the outer hooks: block streaming fetches it by this
        self.count = 0
        self.made: list[torch.Tensor | None] | None = None

    def _own(self) -> None:
        """The layer's parameters and the storages of their plain parts, as they are now (block streaming gives
        them new storages each time it installs them)."""
        self.own = {id(p) for p in self.layer.parameters()}
        self.own_storages = {_storage(q) for p in self.layer.parameters() for q in _plain_parts(p)} - {None}

    def _from_weight(self, t: torch.Tensor) -> bool:
        return not t.requires_grad and id(t) not in self.own and _storage(t) not in self.own_storages

    def pack(self, t: torch.Tensor) -> Any:
        if _storage(t) in self.inputs:
            return _Input(t)
        if self._from_weight(t):
            if self.count == 0 and self.outer is not None:
                self.weight = self.outer[0](self.layer.weight)
            self.count += 1
            return _Recipe(self, self.count - 1, t)
        return t if self.outer is None else _Outer(self.outer[1], self.outer[0](t))

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Input):
            return torch.empty(packed.shape, dtype=packed.dtype, device="meta")
        if isinstance(packed, _Recipe):
            return packed.call.remake(packed)
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        return packed

    def remake(self, recipe: _Recipe) -> torch.Tensor:
        if self.made is None or self.made[recipe.index] is None:
            if self.weight is not None:
                self.outer[1](self.weight)  # block streaming installs the layer's weights
            self._own()
            made: list[torch.Tensor] = []

            def keep(t: torch.Tensor) -> torch.Tensor:
                if self._from_weight(t):
                    made.append(t)
                return t

            row = torch.zeros(**self.row, requires_grad=True)
            with torch.enable_grad(), torch.autocast(**self.autocast), \
                    torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                self.forward(row, *self.args, **self.kwargs)
            if len(made) != self.count:
                raise RuntimeError(f"{type(self.layer).__name__}: its forward saved {len(made)} weight-derived "
                                   f"tensors on one row but {self.count} in training; cannot remake them")
            self.made = made
        t = self.made[recipe.index]
        self.made[recipe.index] = None  # each is unpacked once per backward: hold it no longer
        if (t.shape, t.stride(), t.dtype) != recipe.form:
            raise RuntimeError(f"{type(self.layer).__name__}: remade saved tensor {tuple(t.shape)} {t.dtype} "
                               f"differs from the saved {tuple(recipe.form[0])} {recipe.form[2]}")
        return t


def _lean_forward(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The layer class's own forward, under the hooks of one `_Call` while gradients are on. Bound to the layer as
    its `forward` (a method, not a closure, so a deep copy of the model calls its own copy)."""
    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or type(x) not in PLAIN:
        return forward(x, *args, **kwargs)
    call = _Call(self, forward, x, args, kwargs)
    with torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack):
        return forward(x, *args, **kwargs)


def lean_saves(module: torch.nn.Module) -> int:
    """Wrap every linear layer of `module` whose weight optimum-quanto or torchao quantized (see the module
    docstring); call after quantizing, before an adapter wraps the layers. Returns how many were wrapped (none
    before torch 2.8: see OUTER_HOOKS)."""
    if OUTER_HOOKS is None:
        return 0
    wrapped = 0
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if isinstance(layer, torch.nn.Linear) and isinstance(weight, torch.Tensor) and type(weight) not in PLAIN \
                and type(weight).__module__.split(".")[0] in ("optimum", "torchao"):
            layer.forward = types.MethodType(_lean_forward, layer)
            wrapped += 1
    return wrapped
