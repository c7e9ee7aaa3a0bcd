"""enable_patch_conv: tiled HunyuanVideo causal convs give the unsplit result, with bounded tiles."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import (
    HunyuanVideoCausalConv3d,
    HunyuanVideoDownsampleCausal3D,
)

from difftune.models.patch_conv import disable_patch_conv, enable_patch_conv
from difftune.models.tiny_kandinsky5_video import tiny_hunyuan_vae

MAX_ELEMENTS = 10_000  # far below the tiny VAE's activations; above every single (frame, row) tile it needs


def causal_convs(module):
    return [m for m in module.modules() if isinstance(m, HunyuanVideoCausalConv3d)]


class Spy:
    """Records, per causal conv call, the padded input size and the inputs its inner Conv3d received."""

    def __init__(self, module):
        self.calls: list[dict] = []
        self.handles = []
        for conv in causal_convs(module):
            self.handles.append(conv.register_forward_pre_hook(self._outer))
            self.handles.append(conv.conv.register_forward_pre_hook(self._inner))

    def _outer(self, conv, args):
        b, c, t, h, w = args[0].shape
        wl, wr, top, bottom, front, back = conv.time_causal_padding
        padded = (b, c, t + front + back, h + top + bottom, w + wl + wr)
        self.calls.append({"conv": conv, "padded": padded, "tiles": []})

    def _inner(self, _, args):
        self.calls[-1]["tiles"].append(tuple(args[0].shape))

    def remove(self):
        for handle in self.handles:
            handle.remove()


def numel(shape) -> int:
    return int(torch.Size(shape).numel())


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    return tiny_hunyuan_vae().eval()


@pytest.fixture(scope="module")
def clip():
    return torch.randn(1, 3, 9, 48, 40, generator=torch.Generator().manual_seed(1))


def encode_decode(vae, clip):
    with torch.no_grad():
        latents = vae.encode(clip).latent_dist.mean
        return latents, vae.decode(latents).sample


def test_vae_encode_decode_matches_unsplit(vae, clip):
    reference = encode_decode(vae, clip)
    assert enable_patch_conv(vae, max_elements=MAX_ELEMENTS) == len(causal_convs(vae))
    spy = Spy(vae)
    try:
        tiled = encode_decode(vae, clip)
    finally:
        spy.remove()
        disable_patch_conv(vae)
    for got, expected in zip(tiled, reference, strict=True):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    split = [call for call in spy.calls if len(call["tiles"]) > 1]
    assert split and all(numel(call["padded"]) > MAX_ELEMENTS for call in split)
    for call in spy.calls:
        if numel(call["padded"]) <= MAX_ELEMENTS:
            assert call["tiles"] == [call["padded"]]  # unchanged below the threshold
        else:
            assert len(call["tiles"]) > 1 and all(numel(tile) <= MAX_ELEMENTS for tile in call["tiles"])
    # Row tiles, and tiles that also cut time (where one output row over all frames is too big).
    assert any(tile[3] < call["padded"][3] for call in split for tile in call["tiles"])
    assert any(tile[2] < call["padded"][2] for call in split for tile in call["tiles"])
    # The strided downsample convs (space and space-time) were split too.
    downsamplers = {m.conv for m in vae.modules() if isinstance(m, HunyuanVideoDownsampleCausal3D)}
    strides = {call["conv"].conv.stride for call in split if call["conv"] in downsamplers}
    assert {(1, 2, 2), (2, 2, 2)} <= strides


def test_enable_twice_and_disable_restore(vae, clip):
    reference = encode_decode(vae, clip)
    count = enable_patch_conv(vae, max_elements=10**9)
    assert enable_patch_conv(vae, max_elements=MAX_ELEMENTS) == count  # only the threshold changes
    conv = vae.encoder.conv_in
    # One wrapper, around the class's forward (nothing nested).
    assert conv.forward.__func__.__name__ == "_patched_forward"
    assert conv.__dict__["_difftune_patch_conv_original_forward"] is None
    spy = Spy(vae)
    try:
        tiled = encode_decode(vae, clip)
    finally:
        spy.remove()
    assert sum(len(call["tiles"]) for call in spy.calls) > len(spy.calls)  # the second threshold applies
    for got, expected in zip(tiled, reference, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    disable_patch_conv(vae)
    for conv in causal_convs(vae):
        assert not any(key == "forward" or key.startswith("_difftune_patch_conv") for key in conv.__dict__)
    for got, expected in zip(encode_decode(vae, clip), reference, strict=True):
        assert torch.equal(got, expected)
    disable_patch_conv(vae)  # harmless when nothing is patched


def test_keeps_an_existing_instance_forward():
    conv = HunyuanVideoCausalConv3d(2, 2, 3)
    seen = []

    def hooked(x):  # e.g. a wrapper some other tool installed on the instance
        seen.append(x.shape)
        return HunyuanVideoCausalConv3d.forward(conv, x)

    conv.forward = hooked
    enable_patch_conv(conv, max_elements=10**9)
    conv(torch.randn(1, 2, 3, 5, 5))
    assert len(seen) == 1  # below the threshold the previous forward runs
    disable_patch_conv(conv)
    assert conv.forward is hooked


@pytest.mark.parametrize(
    ("kernel", "stride", "dilation", "pad_mode"),
    [
        (3, 1, 1, "replicate"),
        (3, 2, 1, "replicate"),
        (3, (1, 2, 2), 1, "replicate"),
        (3, (2, 1, 3), 1, "replicate"),
        (1, 1, 1, "replicate"),
        (3, 1, 2, "replicate"),
        (3, 2, (2, 1, 2), "constant"),
    ],
)
def test_single_conv_matches_unsplit(kernel, stride, dilation, pad_mode):
    torch.manual_seed(0)
    conv = HunyuanVideoCausalConv3d(3, 4, kernel, stride, dilation=dilation, pad_mode=pad_mode)
    x = torch.randn(2, 3, 7, 13, 11, requires_grad=True)
    expected = conv(x)
    grads = torch.autograd.grad(expected.square().sum(), [x, conv.conv.weight])
    inner_calls = []
    conv.conv.register_forward_pre_hook(lambda _, args: inner_calls.append(args[0].numel()))
    for max_elements in (1, 100, 500, 2000, 4000):  # 1: one output row of one output frame per tile
        enable_patch_conv(conv, max_elements=max_elements)
        inner_calls.clear()
        got = conv(x)
        assert len(inner_calls) > 1
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for g, e in zip(torch.autograd.grad(got.square().sum(), [x, conv.conv.weight]), grads, strict=True):
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-5)
    disable_patch_conv(conv)


def test_large_threshold_is_the_plain_forward():
    conv = HunyuanVideoCausalConv3d(3, 4, 3, (1, 2, 2))
    x = torch.randn(1, 3, 5, 9, 7)
    expected = conv(x)
    enable_patch_conv(conv)  # default 2**27 elements
    assert torch.equal(conv(x), expected)
    with pytest.raises(ValueError):
        enable_patch_conv(conv, max_elements=0)
