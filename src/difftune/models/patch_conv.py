"""Split the HunyuanVideo VAE's causal 3D convolutions into tiles to cap their memory peaks.

`HunyuanVideoCausalConv3d.forward` is `conv(F.pad(x, time_causal_padding))`: on a long or large clip it first
materialises a padded copy of the whole activation, then runs one Conv3d over it, whose workspace (im2col /
cuDNN buffers) grows with the input too. diffusers has no switch to split that (its VAE tiling cuts the clip into
overlapping tiles and blends them, which changes the result). `enable_patch_conv` replaces the forward of each
such conv *instance* (the class is untouched) with one that, above `max_elements`, computes the same output tile
by tile:

* Tiles are ranges of output rows (height); when one output row over all frames is still too big, ranges of
  output frames too. Each tile's input is the padded input window its outputs read: for `n` outputs along a dim
  with stride `s` and dilated kernel extent `K = dilation * (kernel - 1) + 1`, padded positions
  `[o0 * s, (o1 - 1) * s + K)`, so consecutive tiles overlap by `K - s` (the halo) and each output is computed
  from exactly the inputs the unsplit conv uses: same values, up to float summation order.
* The causal padding is applied per tile: each tile is a view of the unpadded input plus only the padding that
  falls inside its window (replicate/constant padding of a border tile equals that slice of the padded whole).

What is bounded: every padded tile handed to the Conv3d has at most `max_elements` elements (so the F.pad copy
and the conv workspace scale with a tile, not the clip), except when a single output row of a single output
frame is already larger (the width is never split; such a tile runs as is). Tiles along an axis are of equal
size (no small remainder). The workspace is per tile but not equal to it: cuDNN/oneDNN pick their own buffers,
and on CPU PyTorch sends small inputs to its native im2col path, whose buffer is about kernel volume (27) times
the tile - so very small `max_elements` on CPU costs speed and can even raise the peak. What is not bounded:
the input itself, the output (allocated once at full size and filled tile by tile, no torch.cat copy), one
tile's conv output (it follows the channel ratio and strides, e.g. larger than the tile for a channel-expanding
conv), and, with autograd on, the tensors saved for backward (each tile keeps its padded input: about the whole
padded input in total, as the unsplit conv would).

The wrapper calls the instance's own `conv` submodule on each tile, so anything that replaced or hooked it
(adapters, offloading hooks) still applies. Convs it cannot split exactly run unchanged: a Conv3d with its own
padding along time or height (a chunk border would get zeros), a pad mode other than replicate/constant, a
forward overridden by a subclass.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoCausalConv3d

# Instance attributes set while patched: the threshold, and the instance-level forward found before patching
# (None when the class's forward was in use).
_MAX_ELEMENTS = "_difftune_patch_conv_max_elements"
_ORIGINAL_FORWARD = "_difftune_patch_conv_original_forward"


def _stock(module: torch.nn.Module) -> bool:
    # A subclass overriding forward may compute something else; only the stock computation is reproduced here.
    return isinstance(module, HunyuanVideoCausalConv3d) and type(module).forward is HunyuanVideoCausalConv3d.forward


def _is_ours(forward) -> bool:
    return getattr(forward, "__func__", None) is _patched_forward


def enable_patch_conv(module: torch.nn.Module, max_elements: int = 2**27) -> int:
    """Tile every HunyuanVideoCausalConv3d in `module` whose padded input exceeds `max_elements` elements.
    Returns how many convs are patched. Calling it again only updates `max_elements` (no double wrapping)."""
    if max_elements < 1:
        raise ValueError(f"max_elements must be positive, got {max_elements}")
    count = 0
    for conv in module.modules():
        if not _stock(conv):
            continue
        if _MAX_ELEMENTS not in conv.__dict__:
            current = conv.__dict__.get("forward")
            if not _is_ours(current):  # never wrap our own wrapper, whatever state the attributes are in
                conv.__dict__[_ORIGINAL_FORWARD] = current
                conv.forward = types.MethodType(_patched_forward, conv)
        conv.__dict__[_MAX_ELEMENTS] = int(max_elements)
        count += 1
    return count


def disable_patch_conv(module: torch.nn.Module) -> None:
    """Undo `enable_patch_conv`: the convs get back the forward they had before."""
    for conv in module.modules():
        if not isinstance(conv, HunyuanVideoCausalConv3d):
            continue
        conv.__dict__.pop(_MAX_ELEMENTS, None)
        if _is_ours(conv.__dict__.get("forward")):
            original = conv.__dict__.pop(_ORIGINAL_FORWARD, None)
            if original is None:
                del conv.forward  # the instance attribute; the class's forward shows through again
            else:
                conv.forward = original
        # Otherwise something wrapped our forward after us (e.g. an offloading hook); without the threshold our
        # wrapper, still inside that chain, just passes through to the original forward.


def _original_forward(conv: HunyuanVideoCausalConv3d, hidden_states: torch.Tensor) -> torch.Tensor:
    original = conv.__dict__.get(_ORIGINAL_FORWARD)
    if original is not None:
        return original(hidden_states)
    return HunyuanVideoCausalConv3d.forward(conv, hidden_states)


def _patched_forward(self: HunyuanVideoCausalConv3d, hidden_states: torch.Tensor) -> torch.Tensor:
    max_elements = self.__dict__.get(_MAX_ELEMENTS)
    plan = None if max_elements is None else _plan(self, hidden_states, max_elements)
    if plan is None:
        return _original_forward(self, hidden_states)
    return _tiled_forward(self, hidden_states, *plan)


def _base_conv(conv: HunyuanVideoCausalConv3d) -> torch.nn.Conv3d | None:
    # Adapters (PEFT) wrap the Conv3d; its geometry is the wrapped layer's.
    inner = conv.conv
    if hasattr(inner, "get_base_layer"):
        inner = inner.get_base_layer()
    return inner if isinstance(inner, torch.nn.Conv3d) else None


class _Axis:
    """One split axis (time or height): input size, causal padding, stride and dilated kernel extent."""

    def __init__(self, size: int, pad_before: int, pad_after: int, kernel: int, stride: int, dilation: int):
        self.size, self.pad_before, self.pad_after, self.stride = size, pad_before, pad_after, stride
        self.extent = dilation * (kernel - 1) + 1
        self.padded = pad_before + size + pad_after
        self.outputs = (self.padded - self.extent) // stride + 1

    def span(self, outputs: int) -> int:
        """Padded inputs read by `outputs` consecutive outputs."""
        return (outputs - 1) * self.stride + self.extent

    def fit(self, budget: int) -> int:
        """Most consecutive outputs whose window fits in `budget` positions (0 if not even one)."""
        return 0 if budget < self.extent else min(self.outputs, (budget - self.extent) // self.stride + 1)

    def window(self, first: int, stop: int) -> tuple[int, int, int, int]:
        """For outputs [first, stop): the unpadded input slice and the padding inside the window."""
        start, end = first * self.stride, (stop - 1) * self.stride + self.extent  # padded coordinates
        before = max(0, min(end, self.pad_before) - start)
        after = max(0, end - max(start, self.pad_before + self.size))
        return max(start - self.pad_before, 0), min(end - self.pad_before, self.size), before, after


def _plan(conv: HunyuanVideoCausalConv3d, x: torch.Tensor, max_elements: int):
    """(time axis, height axis, outputs per time tile, outputs per height tile), or None: run unchanged."""
    inner = _base_conv(conv)
    if x.dim() != 5 or inner is None or conv.pad_mode not in ("replicate", "constant"):
        return None
    if inner.padding_mode != "zeros" or isinstance(inner.padding, str) or any(inner.padding[:2]):
        return None
    batch, channels, frames, height, width = x.shape
    width_left, width_right, top, bottom, front, back = conv.time_causal_padding
    padded_width = width + width_left + width_right
    if batch * channels * (frames + front + back) * (height + top + bottom) * padded_width <= max_elements:
        return None
    time = _Axis(frames, front, back, inner.kernel_size[0], inner.stride[0], inner.dilation[0])
    rows = _Axis(height, top, bottom, inner.kernel_size[1], inner.stride[1], inner.dilation[1])
    for axis in (time, rows):
        # Every window must reach real input (the stock padding, smaller than the kernel, guarantees it), or a
        # tile could be all padding, which replicate cannot produce from an empty slice.
        if axis.outputs < 1 or max(axis.pad_before, axis.pad_after) >= axis.extent or axis.size < 1:
            return None
    per_position = batch * channels * padded_width  # elements of one padded (frame, row) line
    budget = max_elements // per_position  # padded (frame, row) positions a tile may hold
    row_tile = rows.fit(budget // time.span(time.outputs))
    if row_tile >= 1:  # row tiles over all frames
        frame_tile = time.outputs
    else:  # also split time: as many rows as fit with one output frame, then as many frames as fit with those
        row_tile = max(1, rows.fit(budget // time.extent))
        frame_tile = max(1, time.fit(budget // rows.span(row_tile)))
    if row_tile >= rows.outputs and frame_tile >= time.outputs:
        return None  # one tile: that is the unsplit conv (the padding it skips was never read)
    return time, rows, _even(frame_tile, time.outputs), _even(row_tile, rows.outputs)


def _even(tile: int, outputs: int) -> int:
    """The same number of tiles, of near-equal sizes: no small remainder tile. Fewer distinct shapes (kernel
    selection / autotuning per shape), and no tile so small that PyTorch's CPU heuristic sends it to the native
    im2col path, whose buffer is kernel-volume times the tile's size."""
    count = -(-outputs // tile)
    return -(-outputs // count)


def _tiled_forward(conv, x: torch.Tensor, time: _Axis, rows: _Axis, frame_tile: int, row_tile: int):
    width_left, width_right = conv.time_causal_padding[:2]
    out = None
    for t0 in range(0, time.outputs, frame_tile):
        t1 = min(t0 + frame_tile, time.outputs)
        f_start, f_end, front, back = time.window(t0, t1)
        for h0 in range(0, rows.outputs, row_tile):
            h1 = min(h0 + row_tile, rows.outputs)
            r_start, r_end, top, bottom = rows.window(h0, h1)
            # A view of the unpadded input, padded on its own: only this tile is ever copied.
            tile = F.pad(
                x[:, :, f_start:f_end, r_start:r_end],
                (width_left, width_right, top, bottom, front, back),
                mode=conv.pad_mode,
            )
            y = conv.conv(tile)
            if out is None:  # dtype/device/width as the conv produces them (autocast may change the dtype)
                out = y.new_empty((*y.shape[:2], time.outputs, rows.outputs, y.shape[4]))
            out[:, :, t0:t1, h0:h1] = y
    return out
