"""FSDP2 (`fsdp_enable`, train/fsdp.py): two processes on CPU (torchrun, gloo) train as one process with the
same global batch, write the files one process writes, sample without hanging, and resume exactly."""

import json
import time

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import write_config
from difftune.config.schema import TrainConfig
from difftune.demo import make_dataset
from test_distributed import finish, kill_all, launch
from test_train import losses

SAMPLE = dict(validation_prompt="a red circle", validation_num_inference_steps=2, validation_resolution="64x48",
              validation_disable_unconditional=True)


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / "images"
    make_dataset(folder, count=8)
    return folder


def same_run(a, b, rel=1e-5):
    la, lb = losses(a), losses(b)
    assert la and la.keys() == lb.keys(), (la, lb)
    assert all(la[k] == pytest.approx(lb[k], rel=rel) for k in la), (la, lb)


def events(output):
    return [json.loads(x) for x in (output / "events.jsonl").read_text().splitlines()]


def test_fsdp_lora_two_processes_equal_one(tmp_path, images):
    """LoRA on a frozen base: the same losses, adapter and validation image as one process with the global
    batch; a mid-run sample (process 0 samples alone while the other waits), then training goes on."""
    settings = dict(max_train_steps=2, lr_scheduler="linear", validation_step_interval=1, **SAMPLE)
    two = write_config(tmp_path / "two", images, train_batch_size=1, fsdp_enable=True, **settings)
    one = write_config(tmp_path / "one", images, train_batch_size=2, **settings)
    finish(launch(two, 29631))
    finish(launch(one, 0, processes=1))
    out1, out2 = tmp_path / "one" / "output", tmp_path / "two" / "output"
    same_run(out1, out2)
    assert any(e["event"] == "info" and e["message"].startswith("FSDP2: ") for e in events(out2))
    wa, wb = load_file(out1 / "pytorch_lora_weights.safetensors"), load_file(out2 / "pytorch_lora_weights.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=1e-6, rtol=1e-5)
    assert (out2 / "checkpoints" / "checkpoint-0000002" / "optimizer_fsdp").is_dir()  # SHARDED by default
    for label in ("step-000001", "final-step-000002"):  # after the first, training went on (weights resharded)
        a = np.asarray(Image.open(out1 / "validation" / f"{label}-64x48.png")).astype(int)
        b = np.asarray(Image.open(out2 / "validation" / f"{label}-64x48.png")).astype(int)
        assert np.abs(a - b).max() <= 1


@pytest.mark.slow  # about 60 s on 2 cores
def test_fsdp_full_finetune_two_processes_equal_one_and_load(tmp_path, images):
    """A full fine-tune (every weight a DTensor shard), with gradient accumulation (a reduce-scatter per
    micro-batch) and gradient checkpointing: the same losses as one process, and the gathered transformer
    folder loads with diffusers' from_pretrained and equals the one-process result."""
    from diffusers import Lumina2Transformer2DModel

    settings = dict(model_type="full", max_train_steps=3, learning_rate=1e-4, gradient_accumulation_steps=2,
                    gradient_checkpointing=True)
    two = write_config(tmp_path / "two", images, train_batch_size=1, fsdp_enable=True,
                       fsdp_state_dict_type="FULL_STATE_DICT", checkpoint_step_interval=2, **settings)
    one = write_config(tmp_path / "one", images, train_batch_size=2, **settings)
    finish(launch(two, 29641))
    finish(launch(one, 0, processes=1))
    out1, out2 = tmp_path / "one" / "output", tmp_path / "two" / "output"
    same_run(out1, out2)
    assert (out2 / "checkpoints" / "checkpoint-0000002" / "optimizer_fsdp.pt").is_file()
    a = Lumina2Transformer2DModel.from_pretrained(out1 / "transformer").state_dict()
    b = Lumina2Transformer2DModel.from_pretrained(out2 / "transformer").state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)


@pytest.mark.slow  # about 130 s on 2 cores
def test_fsdp_kandinsky5_video_image_to_video(tmp_path):
    """The family FSDP is for (Kandinsky 5 Video, Pro at full size): its two block stacks found and sharded,
    first-frame conditioning, the same losses and LoRA as one process with the global batch."""
    from families import make_clips

    clips = make_clips(tmp_path / "clips", count=4, frames=9)
    settings = dict(model_family="kandinsky5-video", model_flavour="tiny-random-i2v", max_train_steps=2,
                    dataset={"dataset_type": "video", "resolution": 32, "video": {"num_frames": 9}})
    two = write_config(tmp_path / "two", clips, train_batch_size=1, fsdp_enable=True, **settings)
    one = write_config(tmp_path / "one", clips, train_batch_size=2, **settings)
    finish(launch(two, 29671))
    finish(launch(one, 0, processes=1))
    out1, out2 = tmp_path / "one" / "output", tmp_path / "two" / "output"
    same_run(out1, out2)
    info = next(e["message"] for e in events(out2) if e["event"] == "info" and e["message"].startswith("FSDP2: "))
    assert "Kandinsky5TransformerDecoderBlock" in info and "Kandinsky5TransformerEncoderBlock" in info
    # Adam divides near-zero gradients by their own size, so fp32 summation-order differences (a batch of 2
    # against 1 + 1) reach the weights: DDP differs from one process by the same ~4e-5 here; the update is ~1e-3.
    wa, wb = load_file(out1 / "pytorch_lora_weights.safetensors"), load_file(out2 / "pytorch_lora_weights.safetensors")
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=1e-4, rtol=1e-3)


@pytest.mark.slow  # about 90 s on 2 cores
def test_fsdp_equals_ddp_bit_for_bit_in_bf16(tmp_path, images):
    """bf16 autocast on a bf16 base with fp32 LoRA weights (mixed dtypes in one FSDP unit): FSDP2 and DDP
    give the same losses, adapter and validation image, bit for bit."""
    settings = dict(max_train_steps=2, train_batch_size=1, mixed_precision="bf16", **SAMPLE)
    fsdp = write_config(tmp_path / "fsdp", images, fsdp_enable=True, **settings)
    ddp = write_config(tmp_path / "ddp", images, **settings)
    finish(launch(fsdp, 29661))
    finish(launch(ddp, 29662))
    out1, out2 = tmp_path / "ddp" / "output", tmp_path / "fsdp" / "output"
    assert losses(out1) == losses(out2)
    wa, wb = load_file(out1 / "pytorch_lora_weights.safetensors"), load_file(out2 / "pytorch_lora_weights.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    name = "final-step-000002-64x48.png"
    assert np.array_equal(np.asarray(Image.open(out1 / "validation" / name)),
                          np.asarray(Image.open(out2 / "validation" / name)))


@pytest.mark.slow  # about 80 s on 2 cores
@pytest.mark.parametrize("layout", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_fsdp_killed_then_resumed(tmp_path, images, layout):
    common = dict(max_train_steps=6, train_batch_size=1, checkpoint_step_interval=2, resume_from_checkpoint="latest",
                  fsdp_enable=True, fsdp_state_dict_type=layout, lr_scheduler="linear")
    reference = write_config(tmp_path / "ref", images, **common)
    finish(launch(reference, 29651))
    cut = write_config(tmp_path / "cut", images, **common)
    proc = launch(cut, 29652, start_new_session=True)
    checkpoints = tmp_path / "cut" / "output" / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and not (checkpoints / "checkpoint-0000004" / "training_state.json").exists():
        time.sleep(0.01)
    kill_all(proc)
    finish(launch(cut, 29653))
    resumed = [e for e in events(tmp_path / "cut" / "output") if e["event"] == "info" and "resumed" in e["message"]]
    assert resumed and resumed[-1]["message"].endswith("at step 4")  # killed between checkpoints 4 and 6
    same_run(tmp_path / "ref" / "output", tmp_path / "cut" / "output", rel=1e-6)


def test_fsdp_keys_refused_with_the_fix():
    base = dict(model_family="lumina2", max_train_steps=1)
    cases = [
        (dict(fsdp_version=1), "set fsdp_version to 2"),
        (dict(fsdp_enable=True, use_ema=True), "use_ema with fsdp_enable"),
        (dict(fsdp_enable=True, lora_type="lycoris", lycoris_config=None, model_type="full"), None),
        (dict(fsdp_enable=True, base_model_precision="int8-quanto"), "quantized weights cannot be sharded"),
        (dict(fsdp_enable=True, mixed_precision="fp16"), "mixed_precision 'fp16'"),
        (dict(fsdp_cpu_ram_efficient_loading=True), "set fsdp_cpu_ram_efficient_loading to false"),
    ]
    for overrides, message in cases:
        if message is None:  # a full fine-tune ignores lora_type: accepted
            TrainConfig(**base, **overrides)
            continue
        with pytest.raises(ValueError, match=message):
            TrainConfig(**base, **overrides)
    cfg = TrainConfig(**base, fsdp_enable=True, fsdp_transformer_layer_cls_to_wrap="A, B",
                      fsdp_state_dict_type="FULL_STATE_DICT", fsdp_reshard_after_forward=False)
    assert cfg.fsdp_transformer_layer_cls_to_wrap == ["A", "B"]


def test_block_classes_found_and_a_wrong_name_lists_the_real_ones(lumina2_dir):
    from diffusers import Lumina2Transformer2DModel

    from difftune.train.fsdp import block_classes

    transformer = Lumina2Transformer2DModel.from_pretrained(lumina2_dir / "transformer")
    assert {c.__name__ for c in block_classes(transformer, None)} == {"Lumina2TransformerBlock"}
    assert {c.__name__ for c in block_classes(transformer, ["Lumina2TransformerBlock"])} == {"Lumina2TransformerBlock"}
    with pytest.raises(ValueError, match="its blocks are Lumina2TransformerBlock"):
        block_classes(transformer, ["WanTransformerBlock"])
