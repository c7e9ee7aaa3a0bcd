"""peft's LoRA input casts skipped under autocast (adapters/casts.py): a bf16 base with fp32 LoRA under bf16 autocast
gives the same loss and LoRA gradients bit for bit with fewer dtype copies, with and without gradient checkpointing;
a forward without autocast (validation) still casts; DoRA and LoRA dropout keep their casts."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch.utils._python_dispatch import TorchDispatchMode

from difftune.adapters.kinds import build_adapter
from difftune.config.schema import TrainConfig
from families import Case
from test_dora import inputs, tiny, wake

FAMILIES = ["lumina2", "kandinsky5-image"]
COPIES = ("aten._to_copy", "aten.copy_")  # a dtype cast is one of these, whoever asks for it (peft or autocast)


class OpCount(TorchDispatchMode):
    """How many times each aten op ran (forward and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def copies(self) -> int:
        return sum(self.ops[name] for name in COPIES)


def lora_bf16(family_name: str, skip_casts: bool, checkpointing: bool = False, **keys):
    """A tiny bf16 transformer with fp32 LoRA as LoraAdapter attaches it, lora_B random so that every gradient is
    non-trivial; `skip_casts` False takes the hook off again: peft's own behaviour."""
    family, comps = tiny(family_name, torch.bfloat16)
    torch.manual_seed(0)
    adapter = build_adapter(TrainConfig(model_family=family_name, max_train_steps=1, lora_rank=4,
                                        lora_init_type="gaussian", gradient_checkpointing=checkpointing, **keys),
                            family, comps.transformer)
    assert adapter.input_casts is not None
    if not skip_casts:
        adapter.input_casts.handle.remove()
    wake(comps.transformer)
    return family, comps, adapter


def training_step(family_name: str, skip_casts: bool, checkpointing: bool):
    """Loss, LoRA gradients and copy count of one step under CPU bf16 autocast, then a validation-style output:
    no autocast, bf16 inputs into the bf16 base and its fp32 LoRA."""
    family, comps, adapter = lora_bf16(family_name, skip_casts, checkpointing)
    net = comps.transformer
    x, text = inputs(family, comps, Case(family_name, "tiny-random"))
    x, sigmas = x.repeat(2, *[1] * (x.dim() - 1)).bfloat16(), torch.tensor([0.3, 0.7])
    text = {k: v.repeat(2, *[1] * (v.dim() - 1)) for k, v in text.items()}
    with OpCount() as count:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = family.predict(net, x, sigmas, text, None)
        loss = pred.float().pow(2).mean()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad}
    with torch.no_grad():
        plain = family.predict(net, x, sigmas, text, None)
    return loss.detach(), grads, count.copies(), plain, adapter


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("family_name", FAMILIES)
def test_skipped_casts_give_identical_loss_and_gradients_with_fewer_copies(family_name, checkpointing):
    loss, grads, copies, plain, _ = training_step(family_name, skip_casts=False, checkpointing=checkpointing)
    loss2, grads2, copies2, plain2, adapter = training_step(family_name, skip_casts=True, checkpointing=checkpointing)
    assert torch.isfinite(loss) and torch.equal(loss, loss2)
    assert grads.keys() == grads2.keys() and grads
    for name in grads:
        assert grads[name].dtype == torch.float32 and grads[name].abs().sum() > 0, name
        assert torch.equal(grads[name], grads2[name]), name
    # Every LoRA layer ran at least once in the forward, dropping its cast there and the cast's backward.
    layers = adapter.input_casts.layers
    assert layers and copies - copies2 >= 2 * len(layers), (copies, copies2)
    # The forward without autocast put the casts back (bf16 input, fp32 LoRA: F.linear would refuse otherwise)
    assert torch.isfinite(plain2).all() and torch.equal(plain, plain2)
    assert all(layer.cast_input_dtype_enabled for layer in layers)


def test_the_switch_follows_autocast_forward_by_forward():
    family, comps, adapter = lora_bf16("lumina2", skip_casts=True)
    x, text = inputs(family, comps, Case("lumina2", "tiny-random"))
    layers = adapter.input_casts.layers
    for autocast in (True, False, True, False):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            assert torch.isfinite(family.predict(comps.transformer, x.bfloat16(), torch.tensor([0.4]), text)).all()
        assert [layer.cast_input_dtype_enabled for layer in layers] == [not autocast] * len(layers)


@pytest.mark.parametrize("keys", [dict(use_dora=True), dict(lora_dropout=0.1)], ids=["dora", "dropout"])
def test_layers_doing_more_than_a_matmul_on_the_input_keep_casting(keys):
    """DoRA's norms and dropout's 1/(1-p) round differently in bf16 than in fp32: those layers keep peft's cast."""
    family, comps, adapter = lora_bf16("lumina2", skip_casts=True, **keys)
    x, text = inputs(family, comps, Case("lumina2", "tiny-random"))
    layers = [m for m in comps.transformer.modules() if isinstance(m, LoraLinear)]
    assert layers == adapter.input_casts.layers and layers
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = family.predict(comps.transformer, x.bfloat16(), torch.tensor([0.4]), text).float().pow(2).mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert adapter.input_casts.casting is False  # the hook saw autocast ...
    assert all(layer.cast_input_dtype_enabled for layer in layers)  # ... and left these layers casting
