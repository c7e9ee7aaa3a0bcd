"""Activation offload (train/activation_offload.py; gradient_checkpointing_backend 'unsloth') on the CPU, where the
same code runs synchronously: the checkpointed blocks' inputs really leave (nothing on the device keeps them
between forward and backward), they come back one per recomputed block, and losses, gradients, adapters and
validation samples are bit-identical to plain checkpointing, with block streaming, across a crash and resume."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.train.activation_offload import ActivationOffload, offload_activations
from difftune.train.checkpointing import enable_checkpointing
from difftune.train.loop import train
from difftune.train.setup import build_run
from test_offload import (
    OFFLOAD,
    RUN,
    assert_identical,
    assert_same_run,
    events,
    forward_backward,
    lora_lumina2,
    resident,  # noqa: F401  (the module-scoped resident run, a fixture)
)
from test_train import crash_then_resume, losses

CPU = torch.device("cpu")


def offloaded(transformer, interval: int | None = None) -> ActivationOffload:
    cfg = SimpleNamespace(gradient_checkpointing_backend="unsloth", gradient_checkpointing_interval=interval)
    said: list[str] = []
    offload = offload_activations(cfg, transformer, CPU, lambda kind, **kw: said.append(kw["message"]))
    assert offload is not None and offload.stream is None and "saves no memory" in said[0]
    return offload


@pytest.mark.parametrize("interval", [None, 2])
def test_offloaded_inputs_give_identical_loss_gradients_and_samples(interval):
    expected_model = lora_lumina2()
    enable_checkpointing(expected_model, interval)
    expected = forward_backward(expected_model)
    transformer = lora_lumina2()
    offload = offloaded(transformer, interval)
    assert_identical(expected, forward_backward(transformer))
    checkpointed = len(range(0, len(transformer.layers), interval or 1))  # diffusers checkpoints `layers`
    assert offload.fetches == checkpointed  # each came back once, in the backward
    hidden = transformer.config.hidden_size * 4  # bytes per token (fp32)
    assert offload.stored_bytes > 0 and offload.stored_bytes % hidden == 0  # the hidden states, nothing else


def test_the_device_keeps_no_checkpointed_input_between_forward_and_backward():
    """The output of layers[0] is the input layers[1] checkpoints: plain checkpointing keeps it until the backward
    pass; offloaded, only its CPU copy lives."""

    def alive_after_forward(transformer) -> bool:
        ref: list[weakref.ref] = []
        handle = transformer.layers[0].register_forward_hook(lambda m, a, out: ref.append(weakref.ref(out)))
        x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
        loss = transformer(hidden_states=x, timestep=torch.rand(2), encoder_hidden_states=torch.randn(2, 5, 32),
                           encoder_attention_mask=torch.ones(2, 5, dtype=torch.bool)).sample.pow(2).mean()
        handle.remove()
        gc.collect()
        alive = ref[0]() is not None
        loss.backward()
        return alive

    assert alive_after_forward(lora_lumina2(checkpointing=True))
    transformer = lora_lumina2()
    offloaded(transformer)
    assert not alive_after_forward(transformer)


def test_no_grad_forwards_store_nothing():
    transformer = lora_lumina2()
    offload = offloaded(transformer)
    with torch.no_grad():
        transformer(hidden_states=torch.randn(1, 4, 8, 8), timestep=torch.rand(1),
                    encoder_hidden_states=torch.randn(1, 5, 32), encoder_attention_mask=torch.ones(1, 5, dtype=torch.bool))
    assert offload.stored_bytes == 0 and offload.fetches == 0


# --- whole runs --------------------------------------------------------------------------------------

UNSLOTH = dict(gradient_checkpointing_backend="unsloth")


def test_offloaded_and_streamed_run_crashed_and_resumed_repeats_the_resident_run(tmp_path, monkeypatch, resident):  # noqa: F811
    config = write_config(tmp_path, resident[0], **RUN, **OFFLOAD, **UNSLOTH)
    crash_then_resume(monkeypatch, config, at_step=3)
    output = tmp_path / "output"
    assert_same_run(output, output / "pytorch_lora_weights.safetensors", resident)
    said = [e["message"] for e in events(output) if e["event"] == "info"]
    assert sum(m.startswith("activation offload: each") for m in said) == 2  # one per launch
    # after each launch's first step: the bytes that waited in CPU memory (the caption lengths vary them)
    stored = [e["offloaded_bytes"] for e in events(output) if e.get("offloaded_bytes")]
    assert len(stored) == 2 and min(stored) > 0


def test_kandinsky5_offloaded_equals_plain_checkpointing(tmp_path, dataset):
    def run(name, **kw):
        r = build_run(load_config(write_config(
            tmp_path / name, dataset, model_family="kandinsky5-image", max_train_steps=2, lora_rank=4,
            train_batch_size=2, gradient_checkpointing=True, **kw)))
        return r, load_file(train(r))

    plain, expected = run("plain")
    offload, got = run("offload", **UNSLOTH)
    assert losses(offload.output_dir) == losses(plain.output_dir) and len(losses(plain.output_dir)) == 2
    assert any(e.get("offloaded_bytes") for e in events(offload.output_dir))  # the path ran (text and visual blocks)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize("overrides,match", [
    (dict(gradient_checkpointing=False), "set gradient_checkpointing to true"),
    (dict(compile=True, dynamo_use_regional_compilation=False), "dynamo_use_regional_compilation false"),
    (dict(compile=True, dynamo_mode="reduce-overhead"), "CUDA graphs"),
])
def test_settings_it_cannot_run_with_are_refused_before_loading(tmp_path, dataset, overrides, match):
    config = write_config(tmp_path, dataset, **{**dict(gradient_checkpointing=True, **UNSLOTH), **overrides})
    with pytest.raises(ConfigError, match=match):
        load_config(config)


def test_torch_backend_and_unset_are_plain_checkpointing(tmp_path, dataset):
    for value in ("torch", None):
        extra = {} if value is None else dict(gradient_checkpointing_backend=value)
        cfg = load_config(write_config(tmp_path / str(value), dataset, gradient_checkpointing=True, **extra)).train
        assert cfg.gradient_checkpointing_backend == "torch"
        assert offload_activations(cfg, lora_lumina2(), CPU, lambda *a, **k: None) is None


def test_with_tread_routing_the_checkpointed_blocks():
    """TREAD drops tokens inside the routed blocks (train/tread.py): the offloaded inputs are the full hidden states
    between blocks, and the results equal TREAD with plain checkpointing."""
    from difftune.models import get_family
    from difftune.train import tread

    route = SimpleNamespace(routes=[SimpleNamespace(selection_ratio=0.5, start_layer_idx=0, end_layer_idx=-1)])

    def with_tread(transformer):
        tread.attach(route, get_family("lumina2"), transformer, torch.Generator().manual_seed(3), False)
        return transformer.train()  # TREAD routes in training only

    expected = forward_backward(with_tread(lora_lumina2(checkpointing=True)))
    assert not torch.equal(expected[0], forward_backward(lora_lumina2(checkpointing=True))[0])  # TREAD routed
    transformer = with_tread(lora_lumina2())
    offload = offloaded(transformer)
    assert_identical(expected, forward_backward(transformer))
    assert offload.fetches == len(transformer.layers)
