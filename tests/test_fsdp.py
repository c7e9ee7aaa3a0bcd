"""FSDP2 (`fsdp_enable`, train/fsdp.py): two processes on CPU (torchrun, gloo) train as one process with the
same global batch, write the files one process writes, sample without hanging, and resume exactly."""

import json
import os
import shutil
import time
from pathlib import Path

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


def test_fsdp_lora_with_activation_offload_equals_one_process(tmp_path, images):
    """gradient_checkpointing_backend 'unsloth' on sharded blocks: FSDP2 gathers each block's weights in its hooks
    (again when checkpointing recomputes it), the offload moves only the blocks' inputs; the losses and adapter of
    one process with plain checkpointing and the global batch."""
    settings = dict(max_train_steps=2, gradient_checkpointing=True)
    two = write_config(tmp_path / "two", images, train_batch_size=1, fsdp_enable=True,
                       gradient_checkpointing_backend="unsloth", **settings)
    one = write_config(tmp_path / "one", images, train_batch_size=2, **settings)
    finish(launch(two, 29635))
    finish(launch(one, 0, processes=1))
    out1, out2 = tmp_path / "one" / "output", tmp_path / "two" / "output"
    same_run(out1, out2)
    said = [e["message"] for e in events(out2) if e["event"] == "info"]
    assert any(m.startswith("FSDP2: ") for m in said) and any(m.startswith("activation offload: each") for m in said)
    assert any(e.get("offloaded_bytes") for e in events(out2))  # the inputs did go to CPU memory (after step 1)
    wa, wb = load_file(out1 / "pytorch_lora_weights.safetensors"), load_file(out2 / "pytorch_lora_weights.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=1e-6, rtol=1e-5)


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
    # A gradient that is pure rounding noise can take any Adam step up to the learning rate (one element of 128
    # once differed by 2e-4): nearly every element within 1e-4, none beyond two steps' worth.
    wa, wb = load_file(out1 / "pytorch_lora_weights.safetensors"), load_file(out2 / "pytorch_lora_weights.safetensors")
    for key in wa:
        difference = (wa[key] - wb[key]).abs()
        assert (difference > 1e-4 + 1e-3 * wa[key].abs()).float().mean() <= 0.02, key
        assert difference.max() <= 2 * 2 * 1e-3, key  # 2 steps at learning_rate 1e-3


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
        (dict(fsdp_cpu_ram_efficient_loading=True), "acts only with FSDP.*set fsdp_enable true"),
        (dict(fsdp_enable=True, fsdp_cpu_ram_efficient_loading=True), None),
    ]
    for overrides, message in cases:
        if message is None:  # accepted (a full fine-tune ignores lora_type)
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


# --- fsdp_cpu_ram_efficient_loading: process 0 reads the transformer, the others build it on meta ---

# Put on PYTHONPATH (sitecustomize runs at every interpreter's start, torchrun's workers included): each process
# lists the safetensors files it opens, in reads-<RANK>.json. Both the diffusers (`safetensors.torch.load_file`)
# and the transformers (`from safetensors import safe_open`) loaders go through `safe_open`.
AUDIT = """
import atexit, json, os
if os.environ.get("DIFFTUNE_TEST_READS"):
    import safetensors, safetensors.torch
    _opened = []
    _real = safetensors.safe_open
    def _safe_open(path, *args, **kwargs):
        _opened.append(os.path.realpath(os.fspath(path)))
        return _real(path, *args, **kwargs)
    safetensors.safe_open = safetensors.torch.safe_open = _safe_open
    def _write():
        if "RANK" in os.environ:
            folder = os.environ["DIFFTUNE_TEST_READS"]
            with open(os.path.join(folder, "reads-" + os.environ["RANK"] + ".json"), "w") as f:
                json.dump(_opened, f)
    atexit.register(_write)
"""


def audited_launch(monkeypatch, tmp_path, config, port, reads):
    """`launch`, with each process's opened safetensors files written to `reads`/reads-<rank>.json."""
    site = tmp_path / "audit-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(AUDIT)
    reads.mkdir(parents=True)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("DIFFTUNE_TEST_READS", str(reads))
    try:
        return finish(launch(config, port))
    finally:
        monkeypatch.delenv("DIFFTUNE_TEST_READS")


def opened(reads, rank, component):
    """The weight files of `component` (transformer, vae, ...) that process `rank` opened."""
    files = json.loads((reads / f"reads-{rank}.json").read_text())
    return [f for f in files if Path(f).parent.name == component]


def loading_report(output):
    return next(e["loading"] for e in events(output) if e["event"] == "info" and "loading" in e)


FLAG_CASES = [
    pytest.param("lumina2", "lora", dict(), id="lumina2-lora"),  # about 35 s on 2 cores; the others too
    # with a mid-run sample, which process 0 draws alone from the gathered weights
    pytest.param("lumina2", "full", dict(gradient_checkpointing=True, validation_step_interval=1, **SAMPLE),
                 marks=pytest.mark.slow, id="lumina2-full"),
    # bf16 weights with Kandinsky 5's fp32 modules (`_keep_in_fp32_modules`) and its non-persistent RoPE buffers
    pytest.param("kandinsky5-image", "lora", dict(mixed_precision="bf16"), marks=pytest.mark.slow,
                 id="kandinsky5-image-lora-bf16"),
    pytest.param("kandinsky5-image", "full", dict(fsdp_state_dict_type="FULL_STATE_DICT"), marks=pytest.mark.slow,
                 id="kandinsky5-image-full"),
]


@pytest.mark.parametrize("family,model_type,extra", FLAG_CASES)
def test_ram_efficient_loading_equals_every_process_loading(tmp_path, images, monkeypatch, family, model_type,
                                                            extra):
    """fsdp_cpu_ram_efficient_loading on and off: the same losses, bit for bit, and the same result files (LoRA,
    or the transformer folder of a full fine-tune), so process 1's shards, the LoRA's seeded initial weights and
    the RoPE buffers arrived intact from process 0. With it on, process 1 builds the transformer on meta and
    opens no transformer weight file (it opens the VAE's, so the audit sees its reads); with it off it does."""
    settings = dict(max_train_steps=2, train_batch_size=1, fsdp_enable=True, model_type=model_type,
                    learning_rate=1e-4 if model_type == "full" else 1e-3, **extra)
    if family != "lumina2":
        settings.update(model_family=family, model_flavour="tiny-random")
    on = write_config(tmp_path / "on", images, fsdp_cpu_ram_efficient_loading=True, **settings)
    off = write_config(tmp_path / "off", images, **settings)
    reads_on, reads_off = tmp_path / "reads-on", tmp_path / "reads-off"
    audited_launch(monkeypatch, tmp_path, on, 29691, reads_on)
    audited_launch(monkeypatch, tmp_path, off, 29692, reads_off)
    out_on, out_off = tmp_path / "on" / "output", tmp_path / "off" / "output"
    assert losses(out_on) == losses(out_off) and len(losses(out_on)) == 2
    if model_type == "full":
        a, b = (load_file(next((o / "transformer").glob("*.safetensors"))) for o in (out_on, out_off))
    else:
        a, b = (load_file(o / "pytorch_lora_weights.safetensors") for o in (out_on, out_off))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    samples = sorted((out_off / "validation").glob("*.png"))
    assert len(samples) == (2 if "validation_prompt" in extra else 0)
    for image in samples:
        assert np.array_equal(np.asarray(Image.open(image)), np.asarray(Image.open(out_on / "validation" / image.name)))

    assert opened(reads_on, 0, "transformer") and not opened(reads_on, 1, "transformer")
    assert opened(reads_on, 1, "vae") and opened(reads_off, 1, "transformer")
    report = loading_report(out_on)
    assert [(e["process"], e["built"]) for e in report] == [(0, "read"), (1, "meta")]
    assert report[0]["weights_read_bytes"] > 0 and report[1]["weights_read_bytes"] == 0
    assert all(e["rss_peak_bytes"] > 0 for e in report)
    assert not any("loading" in e for e in events(out_off))  # off: every process loads, as before


@pytest.mark.slow  # about 45 s on 2 cores
def test_ram_efficient_loading_resumes_with_the_same_losses(tmp_path, images):
    """A run resumed from its step-2 checkpoint (the meta-built process takes its shards from process 0,
    then the checkpoint's adapter and optimizer state) continues with the losses of the run that went on."""
    common = dict(max_train_steps=4, train_batch_size=1, checkpoint_step_interval=2, resume_from_checkpoint="latest",
                  fsdp_enable=True, fsdp_cpu_ram_efficient_loading=True, lr_scheduler="linear")
    reference = write_config(tmp_path / "ref", images, **common)
    finish(launch(reference, 29693))
    resumed = write_config(tmp_path / "cut", images, **common)
    checkpoint = "checkpoints/checkpoint-0000002"
    shutil.copytree(tmp_path / "ref" / "output" / checkpoint, tmp_path / "cut" / "output" / checkpoint)
    finish(launch(resumed, 29694))
    out = tmp_path / "cut" / "output"
    assert any(e["event"] == "info" and e["message"].endswith("at step 2") for e in events(out))
    expected = {k: v for k, v in losses(tmp_path / "ref" / "output").items() if k > 2}
    assert losses(out) == expected and len(expected) == 2


@pytest.mark.parametrize("family", ["lumina2", "kandinsky5-image"])
def test_transformer_on_meta_reads_no_weight_on_other_processes(family):
    """On a process other than 0 the family's own `load` yields a transformer on meta, built from the same
    config with the same default dtype (so Lumina2's RoPE tables, plain tensors computed in __init__, are
    the loaded model's), while the VAE and text encoder load their weights; process 0 and a plain
    `from_pretrained` are untouched."""
    from diffusers import ModelMixin

    from difftune.models import get_family, tiny_model
    from difftune.train.distributed import Ranks
    from difftune.train.fsdp import WEIGHTS_READ, transformer_on_meta

    cfg = TrainConfig(model_family=family, max_train_steps=1, fsdp_enable=True, fsdp_cpu_ram_efficient_loading=True)
    source, loader = str(tiny_model(family, "tiny-random")), get_family(family)
    original = ModelMixin.__dict__["from_pretrained"]
    with transformer_on_meta(cfg, Ranks(1, 2)):
        empty = loader.load(source, torch.bfloat16)
    assert ModelMixin.__dict__["from_pretrained"] is original
    with transformer_on_meta(cfg, Ranks(0, 2)):
        loaded = loader.load(source, torch.bfloat16)
    assert getattr(empty.transformer, WEIGHTS_READ) == 0 and getattr(loaded.transformer, WEIGHTS_READ) > 0
    assert all(p.is_meta for p in empty.transformer.parameters())
    assert not any(p.is_meta for p in [*empty.vae.parameters(), *empty.text["text_encoder"].parameters()])
    assert not any(p.is_meta for p in loaded.transformer.parameters())
    assert dict(empty.transformer.config) == dict(loaded.transformer.config)
    shapes = {n: p.shape for n, p in loaded.transformer.named_parameters()}
    assert {n: p.shape for n, p in empty.transformer.named_parameters()} == shapes
    assert not empty.transformer.training
    for (name, a), b in zip(loaded.transformer.named_buffers(), empty.transformer.buffers(), strict=True):
        assert torch.equal(a, b), name  # computed in __init__ on both (to_empty then loses them: see shard)
    if family == "lumina2":
        for a, b in zip(loaded.transformer.rope_embedder.freqs_cis, empty.transformer.rope_embedder.freqs_cis,
                        strict=True):
            assert not b.is_meta and torch.equal(a, b)
    with transformer_on_meta(cfg, Ranks(0, 1)):  # one process: nothing to share, a plain load
        single = loader.load(source, torch.bfloat16)
    assert not hasattr(single.transformer, WEIGHTS_READ)
