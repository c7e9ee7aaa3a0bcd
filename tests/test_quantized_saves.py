"""models/quantized_saves.py (issue 13): the quantized base's linear layers keep only their quantized weight for the
backward pass. The loss and the LoRA gradients are bit-identical to the libraries' own backward; what autograd keeps
is what an unquantized base keeps (without the fix: torchao's dequantized weights, quanto's layer inputs); block
streaming, gradient checkpointing and no-grad forwards still work."""

from __future__ import annotations

import gc

import pytest
import torch
from peft import LoraConfig

from difftune.models import get_family, tiny_model
from difftune.models.quantize import QUANTIZERS, quantized_layers, tensor_bytes
from difftune.models.quantized_saves import OUTER_HOOKS, _lean_forward, lean_saves
from test_offload import assert_identical, forward_backward, streamed

pytestmark = pytest.mark.skipif(OUTER_HOOKS is None, reason="lean_saves needs torch >= 2.8")

PRECISIONS = ["int8-quanto", "int8-torchao", "fp8-torchao"]


def tiny(precision: str, lean: bool, checkpointing: bool = False, half: bool = False) -> torch.nn.Module:
    """The tiny Lumina2 as training builds it: quantized (and made lean) before peft's LoRA attaches (fp32 adapter;
    lora_B drawn too, not zero, so every LoRA weight gets a gradient through the base layers); `half`: bf16 base
    weights, as mixed_precision bf16 loads them."""
    family = get_family("lumina2")
    dtype = torch.bfloat16 if half else torch.float32
    transformer = family.load(str(tiny_model("lumina2", "tiny-random")), dtype).transformer
    transformer.requires_grad_(False)
    if precision != "no_change":
        QUANTIZERS[precision](transformer, quantized_layers(transformer))
    if lean:
        assert lean_saves(transformer) == len(quantized_layers(transformer)) > 0
    torch.manual_seed(0)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                       target_modules=list(family.lora_target_modules)))
    for name, p in transformer.named_parameters():
        if p.requires_grad:
            p.data = p.data.float() if "lora_B" not in name else torch.randn(p.shape) * 0.1
    if checkpointing:
        transformer.enable_gradient_checkpointing()
    return transformer


def step(transformer: torch.nn.Module, half: bool) -> tuple[torch.Tensor, dict, int, list]:
    """Loss and LoRA gradients of one training step (bf16 inputs under bf16 autocast with `half`, as training runs),
    the bytes autograd saved (each storage once, parameters and the plain parts of quantized ones excluded), and
    the saved tensors made from weights: shaped like a linear layer's weight (or its transpose), needing no
    gradient."""
    def plain_parts(t: torch.Tensor) -> list[torch.Tensor]:  # older torchao nests subclasses (a layout tensor)
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            return [t]
        return [part for name in t.__tensor_flatten__()[0] for part in plain_parts(getattr(t, name))]

    own = {t.untyped_storage().data_ptr() for p in transformer.parameters() for t in plain_parts(p)}
    shapes = {tuple(m.weight.shape) for m in transformer.modules() if isinstance(m, torch.nn.Linear)}
    shapes |= {s[::-1] for s in shapes if len(s) == 2}
    saved, weight_shaped = {}, []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor and t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            if tuple(t.shape) in shapes and not t.requires_grad:  # activations carry the input's gradient
                weight_shaped.append(tuple(t.shape))
        return t

    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g), timestep=torch.rand(2, generator=g),
                  encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
                  encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool))
    if half:  # the latents and caption embeddings come in the weights' dtype, as family.predict passes them
        inputs["hidden_states"], inputs["encoder_hidden_states"] = (
            inputs[k].bfloat16() for k in ("hidden_states", "encoder_hidden_states"))
    with torch.autocast("cpu", torch.bfloat16, enabled=half), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = transformer(**inputs).sample.float().pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in transformer.named_parameters() if p.requires_grad}
    assert grads and all(g.abs().sum() > 0 for g in grads.values())
    return loss.detach(), grads, sum(saved.values()), weight_shaped


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_lean_layers_give_the_libraries_gradients_and_save_what_an_unquantized_base_saves(precision, half):
    plain = step(tiny("no_change", False, half=half), half)
    library = step(tiny(precision, False, half=half), half)
    lean = step(tiny(precision, True, half=half), half)
    assert torch.equal(library[0], lean[0])
    assert library[1].keys() == lean[1].keys()
    for name in library[1]:
        assert torch.equal(library[1][name], lean[1][name]), name
    # What stays for the backward pass: what an unquantized base keeps, no weight-shaped tensor more (the few
    # there are: activations of the tiny model that happen to have a weight's shape and need no gradient).
    assert lean[2] == plain[2] and lean[3] == plain[3]
    assert library[2] > lean[2]
    if precision.endswith("torchao"):  # the library's way: the weights again, dequantized
        assert len(library[3]) > len(plain[3])


@pytest.mark.parametrize("precision", ["int8-quanto", "int8-torchao"])
def test_lean_layers_under_gradient_checkpointing(precision):
    library = step(tiny(precision, False, checkpointing=True), False)
    lean = step(tiny(precision, True, checkpointing=True), False)
    assert torch.equal(library[0], lean[0])
    assert all(torch.equal(library[1][n], lean[1][n]) for n in library[1])
    assert lean[2] < library[2]


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("precision", ["int8-quanto", "int8-torchao"])
def test_lean_layers_with_streamed_blocks(precision, checkpointing):
    """Block streaming's hooks still see the weights the layers keep, and a weight-derived tensor is remade only
    once its block's weights are back: losses, gradients and no-grad samples equal a resident run's."""
    expected = forward_backward(tiny(precision, True, checkpointing=checkpointing))
    transformer = tiny(precision, True, checkpointing=checkpointing)
    streamer = streamed(transformer, 1, True)
    assert_identical(expected, forward_backward(transformer))
    assert streamer.peak == 2 and streamer.holding() == 0
    # Without the remade tensors fetching their block, some would run on offloaded (empty) weights and fail.
    assert any(block is None for _, block, direction, _ in streamer.trace if direction == -1)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_remade_tensors_fetch_their_streamed_block(precision):
    """Blocks that end in a quantized layer, streamed without prefetch: when the backward pass reaches a block,
    nothing of it is on the device until something asks. Its last layer's weight-derived tensor (fp8-torchao: only
    that one), its scales (int8-torchao) or its weight (quanto) is asked first, and must bring the block back
    through block streaming's hooks."""
    from difftune.train.offload import BlockStreamer

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
                for _ in range(3))

        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return x

    def run(stream: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = Stack()
        QUANTIZERS[precision](model, quantized_layers(model))
        model.requires_grad_(False)  # after: quanto's freeze makes weights that ask for gradients
        assert lean_saves(model) == 6
        if stream:
            BlockStreamer(model, list(model.layers), 1, torch.device("cpu"), prefetch=False)
            assert tensor_bytes(model.layers[0][2].weight) == 0  # really gone until fetched
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss.detach(), x.grad

    resident, streamed_ = run(False), run(True)
    assert torch.equal(resident[0], streamed_[0]) and torch.equal(resident[1], streamed_[1])


def test_only_quantized_linear_layers_are_wrapped():
    assert lean_saves(tiny("no_change", False)) == 0
    transformer = tiny("int8-torchao", True)
    layer = transformer.layers[0].attn.to_q
    assert layer.base_layer.forward.__func__ is _lean_forward
    assert "forward" not in vars(layer.lora_A["default"])  # the adapter's own layers are plain
    with torch.no_grad():  # no gradients: the layer's own forward, no hooks
        x = torch.randn(3, layer.base_layer.in_features)
        assert torch.equal(layer.base_layer(x), type(layer.base_layer).forward(layer.base_layer, x))


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_real_size_lumina2_block_saves_no_weight(precision):
    """The real-size Lumina2 (2 blocks per stack, bf16 weights, LoRA r16, bf16 autocast) at 512x512 (1024 image +
    128 caption tokens; 1024x1024 takes 10 GiB): per block, the library keeps what the bf16 base keeps and more
    (torchao: the block's 7 linear weights in bf16, 148.5 MiB at any size; quanto: the inputs of the layers
    whose bf16 version keeps none); the lean layers keep what the bf16 base keeps. 20-60 s a precision."""
    from peft import LoraConfig

    from difftune import bench_memory as real
    from difftune.memory_plan import measure
    from difftune.memory_plan.architecture import Architecture
    from difftune.models import get_family

    arch = Architecture("lumina2", "Lumina2 2.0", dict(real.LUMINA2), True)

    def saved(precision: str, lean: bool) -> int:
        model = measure.build_real(arch, num_layers=2, num_refiner_layers=1)
        model.train().requires_grad_(False)
        if precision != "bf16":
            QUANTIZERS[precision](model, quantized_layers(model))
        if lean:
            lean_saves(model)
        targets = list(get_family("lumina2").lora_target_modules)
        model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        by = measure.saved_by_block(arch, model, (1, 64, 64), 128, False, compute=False, kept=True)
        del model
        gc.collect()  # a lean layer's bound forward is a reference cycle: free the model before the next one
        return by["layers.1"]

    bf16 = saved("bf16", False)
    library, lean = saved(precision, False), saved(precision, True)
    assert lean == bf16
    if precision.endswith("torchao"):  # to_q, to_out (2304x2304), to_k, to_v (768x2304), the feed-forward's three,
        # in bf16; int8 also its per-row scales (one per output feature) cast to bf16
        scales = (2 * 2304 + 2 * 768 + 2 * 9216 + 2304) * 2 if precision == "int8-torchao" else 0
        assert library - bf16 == (2 * 2304 * 2304 + 2 * 2304 * 768 + 3 * 2304 * 9216) * 2 + scales
    else:  # the inputs of to_q/k/v (one tensor), to_out and the feed-forward's down projection, 1152 tokens
        assert library - bf16 == 1152 * (2 * 2304 + 9216) * 2
