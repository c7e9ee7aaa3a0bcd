"""Block streaming (train/offload.py; enable_group_offload, musubi_blocks_to_swap) on the CPU, where the same code
runs synchronously: the streamed weights are really gone between uses (an empty tensor), losses, gradients,
adapters and validation samples are bit-identical to a resident run, with gradient checkpointing and without,
on quantized bases, across a crash and resume; and while a block runs, at most the running group and the
prefetched one hold their weights."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.models import get_family, tiny_model
from difftune.models.quantize import QUANTIZERS, quantized_layers
from difftune.train.loop import train
from difftune.train.offload import BlockStreamer, streamed_blocks
from difftune.train.setup import build_run
from test_train import crash_then_resume, losses

OFFLOAD = dict(enable_group_offload=True, group_offload_type="block_level", group_offload_blocks_per_group=1,
               group_offload_use_stream=True)
STACKS = get_family("lumina2").facts.block_stacks


def lora_lumina2(precision: str = "no_change", checkpointing: bool = False):
    family = get_family("lumina2")
    transformer = family.load(str(tiny_model("lumina2", "tiny-random")), torch.float32).transformer
    transformer.requires_grad_(False)
    if precision != "no_change":
        QUANTIZERS[precision](transformer, quantized_layers(transformer))
    torch.manual_seed(0)  # gaussian init: lora_B is not zero, so every gradient is non-trivial
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                       target_modules=list(family.lora_target_modules)))
    if checkpointing:
        transformer.enable_gradient_checkpointing()
    return transformer


def forward_backward(transformer, device: str | torch.device = "cpu"
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Loss and LoRA gradients of one training forward, and a no-grad (validation) output; inputs on `device`."""
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g), timestep=torch.rand(2, generator=g),
                  encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
                  encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool))
    inputs = {k: v.to(device) for k, v in inputs.items()}
    loss = transformer(**inputs).sample.pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in transformer.named_parameters() if p.requires_grad}
    with torch.no_grad():
        sample = transformer(**inputs).sample
    return loss.detach(), grads, sample


def streamed(transformer, per_group: int, prefetch: bool) -> BlockStreamer:
    streamer = BlockStreamer(transformer, streamed_blocks(transformer, STACKS, None), per_group,
                             torch.device("cpu"), prefetch)
    streamer.trace = []
    return streamer


def assert_identical(expected, got) -> None:
    assert torch.equal(expected[0], got[0])
    assert expected[1].keys() == got[1].keys() and expected[1]
    for name in expected[1]:
        assert torch.equal(expected[1][name], got[1][name]), name
    assert torch.equal(expected[2], got[2])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_streamed_blocks_give_identical_loss_gradients_and_samples(checkpointing):
    expected = forward_backward(lora_lumina2(checkpointing=checkpointing))
    for per_group, prefetch, at_most in ((1, True, 2), (2, False, 1)):
        transformer = lora_lumina2(checkpointing=checkpointing)
        streamer = streamed(transformer, per_group, prefetch)
        blocks = sum(len(getattr(transformer, s)) for s in STACKS)  # refiners and layers: 1 + 1 + 2
        assert len(streamer.groups) == -(-blocks // per_group)
        assert_identical(expected, forward_backward(transformer))
        # While any block ran (forward, recomputation, unpacking in backward), at most the running group and
        # the prefetched one held weights; without prefetch only the running one.
        held = [h for *_, h in streamer.trace]
        assert max(held) == streamer.peak == at_most, streamer.trace
        forward = [block for _, block, direction, _ in streamer.trace if direction == 1]
        assert forward == list(range(blocks)) * 2  # the training forward, then the no-grad one
        backward = [(group, block) for group, block, direction, _ in streamer.trace if direction == -1]
        if checkpointing:  # diffusers checkpoints `layers` only: they are recomputed, last first
            assert [b for _, b in backward if b is not None] == [blocks - 1, blocks - 2]
        # Saved weights of blocks run without checkpointing come back through the unpack hook, last to first.
        unpacked = [group for group, block in backward if block is None]
        assert unpacked and unpacked == sorted(unpacked, reverse=True)
        assert streamer.holding() == 0  # the no-grad forward dropped everything


def test_offloaded_weights_are_really_gone():
    transformer = lora_lumina2()
    streamer = streamed(transformer, 1, True)
    weight = transformer.layers[0].attn.to_q.base_layer.weight
    assert weight.numel() == 0 and not weight.requires_grad
    assert transformer.layers[0].attn.to_q.lora_A["default"].weight.numel() > 0  # the adapter stays
    assert transformer.x_embedder.weight.numel() > 0  # so does everything outside the blocks
    assert streamer.streamed_bytes() > 0
    for handle in streamer.handles:  # no hook, no load: the forward must fail
        handle.remove()
    with pytest.raises(RuntimeError):
        forward_backward(transformer)


@pytest.mark.parametrize("precision", ["int8-quanto", *(pytest.param(p, marks=pytest.mark.slow)
                                                       for p in ("int8-torchao", "int4-quanto", "nf4-bnb"))])
def test_quantized_weights_stream(precision):
    expected = forward_backward(lora_lumina2(precision, checkpointing=True))
    transformer = lora_lumina2(precision, checkpointing=True)
    streamer = streamed(transformer, 1, True)
    slots = [slot for group in streamer.groups for slot in group.slots]
    quantized = [s for s in slots if s.inner or type(s.top()) is not torch.nn.Parameter]
    assert quantized  # the parts of quantized tensors (bitsandbytes: its packed bytes) stream too
    assert_identical(expected, forward_backward(transformer))
    assert streamer.peak == 2


# --- whole runs --------------------------------------------------------------------------------------

RUN = dict(max_train_steps=4, checkpoint_step_interval=2, resume_from_checkpoint="latest", lora_rank=4,
           gradient_checkpointing=True, validation_prompt="a red circle", validation_resolution="32x32",
           validation_num_inference_steps=2, validation_disable_unconditional=True)
SAMPLE = "validation/final-step-000004-32x32.png"


def events(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def resident(tmp_path_factory):
    """The resident run every streamed one must repeat: losses, adapter, validation sample."""
    from difftune.demo import make_dataset

    root = tmp_path_factory.mktemp("resident")
    make_dataset(root / "images", count=4)
    run = build_run(load_config(write_config(root / "run", root / "images", **RUN)))
    result = train(run)
    return root / "images", run.output_dir, load_file(result)


def assert_same_run(output_dir, result, resident) -> None:
    _, expected_dir, expected = resident
    assert losses(output_dir) == losses(expected_dir) and sorted(losses(output_dir)) == [1, 2, 3, 4]
    got = load_file(result)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert (output_dir / SAMPLE).read_bytes() == (expected_dir / SAMPLE).read_bytes()


def test_group_offload_crashed_and_resumed_repeats_the_resident_run(tmp_path, monkeypatch, resident):
    config = write_config(tmp_path, resident[0], **RUN, **OFFLOAD)
    crash_then_resume(monkeypatch, config, at_step=3)
    output = tmp_path / "output"
    assert_same_run(output, output / "pytorch_lora_weights.safetensors", resident)
    info = [e for e in events(output) if e.get("streamed_blocks")]
    assert len(info) == 2 and info[0]["streamed_blocks"] == 4 and info[0]["streamed_bytes"] > 0  # one per launch


def test_musubi_blocks_to_swap_streams_the_last_blocks_of_the_main_stack(tmp_path, resident):
    run = build_run(load_config(write_config(tmp_path, resident[0], **RUN, musubi_blocks_to_swap=1)))
    result = train(run)
    transformer = run.comps.transformer
    assert [g.blocks for g in run.streamer.groups] == [[0]]  # one group of one block: the last of `layers`
    streamed = {id(slot.module) for slot in run.streamer.groups[0].slots}
    assert streamed == {id(m) for m in transformer.layers[-1].modules() if any(
        not p.requires_grad for p in m.parameters(recurse=False))}
    assert transformer.layers[0].attn.to_q.base_layer.weight.numel() > 0  # the rest stays resident
    assert transformer.noise_refiner[0].attn.to_q.weight.numel() > 0
    assert_same_run(run.output_dir, result, resident)


def run_config(root, dataset, **overrides):
    common = dict(max_train_steps=3, lora_rank=4, train_batch_size=2, validation_prompt="a red circle",
                  validation_resolution="32x32", validation_num_inference_steps=2,
                  validation_disable_unconditional=True)
    run = build_run(load_config(write_config(root, dataset, **{**common, **overrides})))
    return run, train(run)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_kandinsky5_with_group_offload_equals_training_without(tmp_path, dataset, checkpointing):
    kw = dict(model_family="kandinsky5-image", gradient_checkpointing=checkpointing)
    plain, plain_result = run_config(tmp_path / "plain", dataset, **kw)
    run, result = run_config(tmp_path / "offload", dataset, **kw, **OFFLOAD)
    assert run.streamer is not None and plain.streamer is None
    transformer = run.comps.transformer
    blocks = len(transformer.text_transformer_blocks) + len(transformer.visual_transformer_blocks)
    assert len(run.streamer.groups) == blocks and run.streamer.peak == 2
    assert losses(run.output_dir) == losses(plain.output_dir) and len(losses(run.output_dir)) == 3
    expected, got = load_file(plain_result), load_file(result)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    sample = "validation/final-step-000003-32x32.png"
    assert (run.output_dir / sample).read_bytes() == (plain.output_dir / sample).read_bytes()


@pytest.mark.slow
def test_lycoris_with_group_offload_equals_without(tmp_path, dataset):
    (tmp_path / "lycoris.json").write_text(json.dumps({"algo": "lokr", "linear_dim": 4, "linear_alpha": 1,
                                                       "factor": 4}))
    kw = dict(lora_type="lycoris", lycoris_config=str(tmp_path / "lycoris.json"), gradient_checkpointing=True)
    plain, plain_result = run_config(tmp_path / "plain", dataset, **kw)
    run, result = run_config(tmp_path / "offload", dataset, **kw, **OFFLOAD)
    assert losses(run.output_dir) == losses(plain.output_dir)
    expected, got = load_file(plain_result), load_file(result)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


# --- config ------------------------------------------------------------------------------------------


def test_group_offload_keys_are_settings(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, **{**OFFLOAD, "group_offload_blocks_per_group": 3})).train
    assert cfg.enable_group_offload and cfg.group_offload_blocks_per_group == 3 and cfg.group_offload_use_stream
    # Settings of a switched-off feature are accepted (they change nothing).
    off = dict(enable_group_offload=False, group_offload_type="leaf_level", group_offload_to_disk_path="/x")
    run = load_config(write_config(tmp_path / "off", dataset, **off))
    assert not run.train.enable_group_offload
    # with a note for each one that differs from its default (SimpleTuner's configure tool writes the defaults)
    notes = [n for n in run.notes() if "enable_group_offload is off" in n]
    assert [n.split()[0] for n in notes] == ["group_offload_type", "group_offload_to_disk_path"]
    defaults = dict(enable_group_offload=False, group_offload_type="block_level", group_offload_blocks_per_group=1,
                    group_offload_use_stream=False)
    assert not any("enable_group_offload is off" in n
                   for n in load_config(write_config(tmp_path / "defaults", dataset, **defaults)).notes())


@pytest.mark.parametrize("overrides,needles", [
    (dict(group_offload_type="leaf_level"), ["not implemented yet", "group_offload_type 'leaf_level'", "block_level"]),
    (dict(group_offload_to_disk_path="/tmp/x"), ["not implemented yet", "group_offload_to_disk_path"]),
    (dict(model_type="full"), ["enable_group_offload", "model_type 'full'"]),
    (dict(musubi_blocks_to_swap=2), ["enable_group_offload", "musubi_blocks_to_swap 2"]),
    (dict(enable_model_cpu_offload=True), ["enable_group_offload", "enable_model_cpu_offload cannot be combined"]),
    (dict(group_offload_blocks_per_group=0), ["group_offload_blocks_per_group"]),
])
def test_group_offload_refusals_name_the_keys(tmp_path, dataset, overrides, needles):
    with pytest.raises(ConfigError) as error:
        load_config(write_config(tmp_path, dataset, **{**OFFLOAD, **overrides}))
    text = str(error.value)
    assert all(needle in text for needle in needles), text


def test_musubi_with_model_cpu_offload_is_refused(tmp_path, dataset):
    with pytest.raises(ConfigError, match="musubi_blocks_to_swap and enable_model_cpu_offload"):
        load_config(write_config(tmp_path, dataset, musubi_blocks_to_swap=2, enable_model_cpu_offload=True))
