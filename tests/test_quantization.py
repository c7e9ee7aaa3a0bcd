"""Quantized base models (base_model_precision): LoRA and LyCORIS train on an int8 transformer, the
saved adapter has the keys of an unquantized run and loads into the unquantized stock pipeline, validation
samples on the quantized model, the checkpoint holds no base weight, and a resumed run repeats its losses."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

from conftest import write_config
from difftune.cli import main
from difftune.config import ConfigError, load_config
from difftune.data.cache import fingerprint
from difftune.models import get_family
from difftune.models.quantize import tensor_bytes, weight_bytes
from difftune.models.quantized_saves import _lean_forward
from difftune.train.loop import train
from difftune.train.setup import build_run
from families import Case
from test_train import crash_then_resume, losses

FAMILIES = ["lumina2", "kandinsky5-image"]
PRECISIONS = ["int8-quanto", "int8-torchao", "nf4-bnb"]
FAST = dict(max_train_steps=2, lora_rank=4, validation_prompt="a red circle", validation_resolution="32x32",
            validation_num_inference_steps=2, validation_disable_unconditional=True)


def events(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "events.jsonl").read_text().splitlines()]


def run_once(root, images, family: str, **overrides):
    path = write_config(root, images, model_family=family, model_flavour="tiny-random", **{**FAST, **overrides})
    run = build_run(load_config(path))
    result = train(run)
    return run, result


@pytest.fixture(scope="module")
def unquantized_keys(tmp_path_factory):
    """Keys of the LoRA each family saves without quantization (trained once per module)."""
    from difftune.demo import make_dataset

    root = tmp_path_factory.mktemp("plain")
    make_dataset(root / "images", count=2)
    keys = {}
    for family in FAMILIES:
        _, result = run_once(root / family, root / "images", family, max_train_steps=1)
        keys[family] = sorted(load_file(result))
    return keys


def quantized_weights(module) -> int:
    """How many weights are tensor subclasses (quantized), not plain float tensors."""
    return sum(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in module.parameters())


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_quantized_base_loads_into_the_unquantized_pipeline(
    tmp_path, dataset, family, precision, unquantized_keys
):
    run, result = run_once(tmp_path, dataset, family, base_model_precision=precision)
    history = losses(run.output_dir)
    assert sorted(history) == [1, 2] and all(math.isfinite(v) for v in history.values())
    assert (run.output_dir / "validation" / "final-step-000002-32x32.png").exists()  # sampled on the int8 base
    model = run.accelerator.unwrap_model(run.transformer)
    assert quantized_weights(model) > 0
    # The adapter trains in fp32 beside int8 base weights.
    assert all(p.dtype == torch.float32 and type(p) is torch.nn.Parameter for p in run.params)
    memory = [e for e in events(run.output_dir) if e["event"] == "info" and "bytes_before" in e]
    assert len(memory) == 1 and memory[0]["bytes_after"] < 0.6 * memory[0]["bytes_before"], memory
    assert precision in memory[0]["message"]
    # optimum-quanto's and torchao's layers keep only their quantized weight for backward (models/quantized_saves.py)
    lean = [e for e in events(run.output_dir) if "lean_layers" in e]
    assert len(lean) == 1 and (lean[0]["lean_layers"] > 0) == (precision != "nf4-bnb"), lean
    assert sum(getattr(m.forward, "__func__", None) is _lean_forward for m in model.modules()) == lean[0]["lean_layers"]

    saved = load_file(result)
    assert sorted(saved) == unquantized_keys[family]
    assert all(v.dtype == torch.float32 for v in saved.values())
    pipe = Case(family, "tiny-random").stock(run.comps.source)  # the stock pipeline, unquantized
    pipe.load_lora_weights(result.parent)
    assert quantized_weights(pipe.transformer) == 0
    adapter = next(iter(pipe.transformer.peft_config))
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=adapter)
    assert sorted(f"transformer.{k}" for k in loaded) == sorted(saved)
    for name, tensor in loaded.items():  # every saved tensor arrived, unchanged
        torch.testing.assert_close(tensor, saved[f"transformer.{name}"])


@pytest.mark.parametrize("precision", ["int8-quanto", "nf4-bnb"])
def test_resume_on_quantized_base_gives_same_losses(tmp_path, dataset, monkeypatch, precision):
    common = dict(max_train_steps=4, checkpoint_step_interval=2, resume_from_checkpoint="latest",
                  base_model_precision=precision, lora_rank=4)
    train(build_run(load_config(write_config(tmp_path / "a", dataset, **common))))
    expected = losses(tmp_path / "a" / "output")
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", dataset, **common), at_step=3)
    resumed = losses(tmp_path / "b" / "output")
    assert sorted(resumed) == sorted(expected) == [1, 2, 3, 4]
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    # The checkpoint holds the adapter, never the (quantized) base weights.
    checkpoint = tmp_path / "b" / "output" / "checkpoints" / "checkpoint-0000002"
    trainable = load_file(checkpoint / "trainable.safetensors")
    assert trainable and all("lora_" in k for k in trainable)
    total = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    assert total < 1_000_000, total


def test_lycoris_on_quantized_base(tmp_path, dataset):
    (tmp_path / "lycoris.json").write_text(json.dumps({"algo": "lokr", "linear_dim": 4, "linear_alpha": 1,
                                                       "factor": 4}))
    common = dict(lora_type="lycoris", lycoris_config=str(tmp_path / "lycoris.json"))
    _, plain = run_once(tmp_path / "plain", dataset, "lumina2", max_train_steps=1, **common)
    run, result = run_once(tmp_path / "q", dataset, "lumina2", base_model_precision="int8-torchao", **common)
    assert quantized_weights(run.accelerator.unwrap_model(run.transformer)) > 0
    assert all(math.isfinite(v) for v in losses(run.output_dir).values())
    assert sorted(load_file(result)) == sorted(load_file(plain))


@pytest.mark.parametrize("precision", ["int8-quanto", "int4-quanto", "fp8-quanto"])
def test_quanto_base_of_fp32_weights_under_bf16_mixed_precision(tmp_path, dataset, precision):
    """fp32 weights (base_model_default_dtype 'fp32', which check advises for DoRA on quanto) under bf16 autocast:
    the quantized layers got bf16 inputs (forward failed), or autocast cast their scales (backward failed). They run
    in their weights' dtype outside autocast; LoRA and DoRA train, validation samples, and autocast is on again
    after each layer (the next layers still run in bf16)."""
    common = dict(base_model_precision=precision, mixed_precision="bf16", base_model_default_dtype="fp32",
                  max_train_steps=2, validation_prompt="a red circle", validation_resolution="32x32",
                  validation_num_inference_steps=2, validation_disable_unconditional=True)
    run, _ = run_once(tmp_path / "lora", dataset, "lumina2", **common)
    assert all(math.isfinite(v) for v in losses(run.output_dir).values()) and len(losses(run.output_dir)) == 2
    assert (run.output_dir / "validation" / "final-step-000002-32x32.png").is_file()
    assert not torch.is_autocast_enabled("cpu")  # nothing left switched
    if precision == "int8-quanto":
        dora, _ = run_once(tmp_path / "dora", dataset, "lumina2", use_dora=True, **common)
        assert all(math.isfinite(v) for v in losses(dora.output_dir).values())


def test_full_fine_tune_on_quantized_base_is_refused_in_check(tmp_path, dataset, capsys):
    path = write_config(tmp_path, dataset, model_type="full", base_model_precision="int8-quanto")
    assert main(["check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "full fine-tune" in err and "base_model_precision" in err


@pytest.mark.parametrize("value", ["int4-torchao"])
def test_unimplemented_precision_is_refused(tmp_path, dataset, value):
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, base_model_precision=value))
    text = "\n".join(info.value.problems)
    assert "base_model_precision" in text and "not implemented yet" in text and value in text


def test_precision_settings_are_typed(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, base_model_precision="int8-torchao",
                                   quantize_via="accelerator")).train
    assert (cfg.base_model_precision, cfg.quantize_via) == ("int8-torchao", "accelerator")
    assert load_config(write_config(tmp_path, dataset)).train.base_model_precision == "no_change"
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, quantize_via="pipeline"))
    assert "not implemented yet" in "\n".join(info.value.problems)
    cfg = load_config(write_config(tmp_path, dataset, text_encoder_1_precision="int8-quanto")).train
    assert cfg.text_encoder_precisions() == {"text_encoder": "int8-quanto"}
    assert (cfg.text_encoder_2_precision, cfg.base_model_precision) == ("no_change", "no_change")


def test_fp16_weights_under_bf16_autocast_on_a_quantized_base_are_refused(tmp_path, dataset):
    """The quantized layers computed in fp16 beside bf16 activations: the first step failed in torch.stack
    (autocast cannot combine fp16 with bf16), after loading and caching."""
    with pytest.raises(ConfigError, match="mixes fp16 and bf16, which autocast cannot combine; set "
                                          "base_model_default_dtype to 'bf16'"):
        load_config(write_config(tmp_path, dataset, base_model_precision="int8-quanto", mixed_precision="bf16",
                                 base_model_default_dtype="fp16"))
    for ok in ({"base_model_precision": "no_change"}, {"base_model_default_dtype": "bf16"},
               {"base_model_default_dtype": "fp32"}):
        load_config(write_config(tmp_path, dataset, **{"base_model_precision": "int8-quanto", "mixed_precision": "bf16",
                                                       "base_model_default_dtype": "fp16", **ok}))


def test_nf4_without_bitsandbytes_is_a_config_error(tmp_path, dataset, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, text_encoder_1_precision="nf4-bnb"))
    text = "\n".join(info.value.problems)
    assert "text_encoder_1_precision 'nf4-bnb' needs the bitsandbytes package" in text and "difftune[bnb]" in text


@pytest.mark.parametrize("precision, at_most", [("int2-quanto", 0.2), ("fp8uz-quanto", 0.3), ("nf4-bnb", 0.2),
                                                ("int4-quanto", 0.2), ("fp8-torchao", 0.3)])
def test_each_precision_shrinks_a_layer_and_keeps_its_output(precision, at_most):
    """Bytes after quantization (fp32 layer: 4 bytes a weight) and the output error stay within what the
    precision's bits allow: a quantizer that did nothing, or broke the layer, fails here."""
    from difftune.models.quantize import QUANTIZERS, quantized_layers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(8, 256)
    expected = model(x).detach()
    before = weight_bytes(model)
    model.requires_grad_(False)
    QUANTIZERS[precision](model, quantized_layers(model))
    assert quantized_weights(model) == 2
    assert weight_bytes(model) < at_most * before, (weight_bytes(model), before)
    error = (model(x) - expected).abs().mean() / expected.abs().mean()
    assert 0 < error < {"int2-quanto": 0.8, "fp8uz-quanto": 0.1, "fp8-torchao": 0.1}.get(precision, 0.2), error


def test_int8_quanto_layer_takes_an_input_that_starts_off_alignment():
    """torch's CPU int8 x bf16 kernel, which quanto calls for qint8 weights, crashed the process (a segmentation
    fault) on an input view starting 16 bytes into its storage: Kandinsky 5's bf16 validation died that way. Run in
    a child process, so a crash fails this test rather than the test run."""
    code = """
import torch
from difftune.models.quantize import QUANTIZERS, quantized_layers
model = torch.nn.Sequential(torch.nn.Linear(32, 32)).to(torch.bfloat16).requires_grad_(False)
expected = [model(torch.ones(m, 32, dtype=torch.bfloat16)) for m in (1, 10)]
QUANTIZERS["int8-quanto"](model, quantized_layers(model))
for m, want in zip((1, 10), expected):
    x = torch.ones(m * 32 + 64, dtype=torch.bfloat16)[8:8 + m * 32].view(m, 32)
    assert x.data_ptr() % 64 == 16
    with torch.no_grad():
        got = model(x)
    assert torch.allclose(got.float(), want.float(), rtol=0.05, atol=0.05), (got, want)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.returncode, done.stderr[-2000:])


def test_int8_quanto_leaves_a_layer_the_cpu_kernel_cannot_take():
    """The same kernel crashed on inputs of 12 rows whose width is not a multiple of 16: Kandinsky 5 video and i2i's
    visual embedder (132 inputs) killed bf16 training at step 1. That layer stays unquantized. (A child process.)"""
    code = """
import torch
from difftune.models.quantize import QUANTIZERS, quantized_layers
from optimum.quanto import QModuleMixin
model = torch.nn.Sequential(torch.nn.Linear(132, 32), torch.nn.Linear(32, 32)).to(torch.bfloat16).requires_grad_(False)
QUANTIZERS["int8-quanto"](model, quantized_layers(model))
assert [isinstance(m, QModuleMixin) for m in model] == [False, True]
with torch.no_grad():
    model(torch.randn(12, 132, dtype=torch.bfloat16))
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.returncode, done.stderr[-2000:])


def test_the_memory_line_counts_the_layers_quantized():
    """It said "3 linear layers" where int8-quanto had kept one of them (the CPU kernel's width rule)."""
    from difftune.models.quantize import quantize_frozen

    said = []
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32), torch.nn.Linear(33, 16))
    quantize_frozen(model, "int8-quanto", "cpu", torch.device("cpu"), False,
                    lambda kind, message, **kw: said.append(message), "transformer", "base_model_precision")
    assert "(2 of 3 linear layers, quantized on the CPU)" in said[0], said


class Blocks(torch.nn.Module):
    """A transformer's shape: blocks in a ModuleList beside an embedder and a final projection."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Sequential(torch.nn.Linear(32, 64))
        self.model = torch.nn.Module()  # blocks one level down, as a text encoder's layers are
        self.model.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                                                    torch.nn.Linear(64, 64)) for _ in range(4))
        self.proj_out = torch.nn.Linear(64, 16)

    def forward(self, x):
        x = self.embed(x)
        for block in self.model.blocks:
            x = x + block(x)
        return self.proj_out(x)


@pytest.mark.parametrize("precision", ["int8-quanto", "int8-torchao", "nf4-bnb"])
def test_quantize_via_accelerator_holds_one_block_at_full_precision(precision, monkeypatch):
    """quantize_via 'accelerator' moved the whole full-precision transformer there first (Kandinsky 5 Pro: 40 GiB in
    bf16, with block streaming meant to keep it in CPU memory). A block at a time now, to the same result as 'cpu'."""
    from difftune.models.quantize import quantize_frozen

    torch.manual_seed(0)
    plain, x = Blocks(), torch.randn(3, 32)
    block = sum(p.numel() * p.element_size() for p in plain.model.blocks[0].parameters())
    results, moved = {}, []
    real_to = torch.nn.Module.to

    def to(module, *args, **kwargs):  # what each move to the accelerator carries at full precision
        if args and str(args[0]) == "cpu":  # the test's accelerator is the CPU
            moved.append(sum(p.numel() * p.element_size() for name, p in module.named_parameters()
                             if type(p) in (torch.Tensor, torch.nn.Parameter) and type(p.data) is torch.Tensor
                             and p.dtype == torch.float32 and p.dim() == 2))
        return real_to(module, *args, **kwargs)

    for via in ("cpu", "accelerator"):
        model = Blocks()
        model.load_state_dict(plain.state_dict())
        said = []
        monkeypatch.setattr(torch.nn.Module, "to", to if via == "accelerator" else real_to)
        quantize_frozen(model, precision, via, torch.device("cpu"), False,
                        lambda kind, message, said=said, **kw: said.append(message), "transformer",
                        "base_model_precision")
        monkeypatch.setattr(torch.nn.Module, "to", real_to)
        with torch.no_grad():
            results[via] = (model(x), said[0].split("MiB (")[1])
    assert torch.equal(results["cpu"][0], results["accelerator"][0])
    assert results["cpu"][1].startswith("10 of 10 linear layers") and \
        results["accelerator"][1] == results["cpu"][1].replace("CPU", "accelerator")
    assert moved and max(moved) <= block, (moved, block)  # never the whole model's 2-D float weights
    # parked (offload_during_startup, block streaming): the whole model never goes there, not even quantized
    whole: list[str] = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda m, *a, **k: (whole.append(type(m).__name__)
                                                                   if isinstance(m, Blocks) else None) or real_to(m, *a, **k))
    model = Blocks()
    model.load_state_dict(plain.state_dict())
    quantize_frozen(model, precision, "accelerator", torch.device("cpu"), True, lambda *a, **k: None, "transformer",
                    "base_model_precision")
    monkeypatch.setattr(torch.nn.Module, "to", real_to)
    assert whole == [], whole
    with torch.no_grad():
        assert torch.equal(model(x), results["cpu"][0])


def test_weight_bytes_count_quantized_tensors():
    from optimum.quanto import freeze, qint8, quantize

    layer = torch.nn.Sequential(torch.nn.Linear(64, 64))
    assert weight_bytes(layer) == (64 * 64 + 64) * 4
    quantize(layer, weights=qint8)
    freeze(layer)
    assert tensor_bytes(layer[0].weight) < 64 * 64 * 2
    assert weight_bytes(layer) < (64 * 64 + 64) * 4 / 3


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_learns_one_image_on_quantized_base(tmp_path, monkeypatch, request, family, precision):
    """test_learning's run (300 LoRA steps on one image), on the quantized base; the LoRA is judged in the
    unquantized stock pipeline."""
    import test_learning

    kind = f"{family}-{precision}"
    monkeypatch.setitem(test_learning.KINDS, kind, (family, {"base_model_precision": precision}))
    test_learning.test_learns_one_image(kind, tmp_path, request)


# --- text encoders (text_encoder_1_precision, text_encoder_2_precision)

def text_encoder_lines(output_dir) -> dict[str, dict]:
    """The bytes line of each quantized text encoder, by its setting."""
    return {e["message"].split()[0]: e for e in events(output_dir)
            if e["event"] == "info" and "bytes_before" in e and e["message"].startswith("text_encoder_")}


def assert_memory_lines(output_dir) -> None:
    memory = [e for e in events(output_dir) if e["event"] == "memory"]
    # the run validates (the final validation): its peak is a phase of its own, as the planner's
    assert [e["phase"] for e in memory] == ["model load", "caching", "first optimizer step", "first validation"], \
        memory
    for e in memory:
        assert isinstance(e["rss_peak_bytes"], int) and e["rss_peak_bytes"] > 2**20, e
    assert memory[0]["rss_peak_bytes"] <= memory[1]["rss_peak_bytes"] <= memory[2]["rss_peak_bytes"] <= \
        memory[3]["rss_peak_bytes"]


def test_lumina2_with_quantized_text_encoder_trains_and_validates(tmp_path, dataset, monkeypatch):
    from difftune.models.lumina2 import Lumina2Family

    seen = []  # (negative, quantized) for every encode_text call: captions and validation prompts alike
    original = Lumina2Family.encode_text

    def spy(self, comps, prompts, negative=False, images=None):
        seen.append((negative, quantized_weights(comps.text["text_encoder"]) > 0))
        return original(self, comps, prompts, negative=negative, images=images)

    monkeypatch.setattr(Lumina2Family, "encode_text", spy)
    run, result = run_once(tmp_path, dataset, "lumina2", text_encoder_1_precision="int8-quanto")
    assert sorted(losses(run.output_dir)) == [1, 2] and all(math.isfinite(v) for v in losses(run.output_dir).values())
    assert (run.output_dir / "validation" / "final-step-000002-32x32.png").exists()
    assert result.exists() and quantized_weights(run.accelerator.unwrap_model(run.transformer)) == 0
    # Captions, the validation prompt and the negative prompt all went through the quantized Gemma2.
    assert seen and all(q for _, q in seen) and {n for n, _ in seen} == {False, True}
    lines = text_encoder_lines(run.output_dir)
    assert list(lines) == ["text_encoder_1_precision"]
    assert "Gemma2" in lines["text_encoder_1_precision"]["message"]
    assert 0 < lines["text_encoder_1_precision"]["bytes_after"] < lines["text_encoder_1_precision"]["bytes_before"]
    assert_memory_lines(run.output_dir)


def test_kandinsky5_with_quantized_text_encoders_trains(tmp_path, dataset):
    run, _ = run_once(tmp_path, dataset, "kandinsky5-image", text_encoder_1_precision="int8-torchao",
                      text_encoder_2_precision="nf4-bnb", validation_prompt=None)
    assert sorted(losses(run.output_dir)) == [1, 2] and all(math.isfinite(v) for v in losses(run.output_dir).values())
    lines = text_encoder_lines(run.output_dir)
    assert sorted(lines) == ["text_encoder_1_precision", "text_encoder_2_precision"]
    assert "Qwen2.5-VL" in lines["text_encoder_1_precision"]["message"]
    assert "CLIP" in lines["text_encoder_2_precision"]["message"]
    assert lines["text_encoder_1_precision"]["bytes_after"] < lines["text_encoder_1_precision"]["bytes_before"]


def test_text_cache_identity_follows_the_encoder_precision(tmp_path, dataset):
    """A quantized encoder writes to its own text cache; 'no_change' keeps the folder of the identity used
    before text encoders could be quantized, so existing caches stay valid."""
    def text_run(name: str, **overrides) -> tuple[set[str], str]:
        path = write_config(tmp_path, dataset, output_dir=str(tmp_path / name), max_train_steps=1, **overrides)
        before = set(p.name for p in (tmp_path / "cache" / "text").glob("*"))
        train(build_run(load_config(path)))
        line = next(e["message"] for e in events(tmp_path / name)
                    if e["event"] == "info" and e["message"].startswith("text cache:"))
        return set(p.name for p in (tmp_path / "cache" / "text").glob("*")) - before, line

    new, line = text_run("plain")
    family = get_family("lumina2")
    comps = family.load(family_source(), torch.float32)  # mixed_precision 'no': the fp32 the run loaded
    assert new == {fingerprint(family.identity(comps)["text"])}, "no_change must keep the old cache folder"
    assert "0 from the cache" in line
    new, line = text_run("int8", text_encoder_1_precision="int8-quanto")
    assert len(new) == 1 and "0 from the cache" in line  # encoded again, into a folder of its own
    recorded = json.loads((tmp_path / "cache" / "text" / next(iter(new)) / "fingerprint.json").read_text())
    assert recorded["precisions"] == {"text_encoder": "int8-quanto"}
    new, line = text_run("plain-again")
    assert new == set() and ", 0 newly encoded" in line  # the first cache, reused as it was


def family_source() -> str:
    from difftune.models import tiny_model

    return str(tiny_model("lumina2", "tiny-random"))


def test_precision_of_a_missing_text_encoder_is_refused_in_check(tmp_path, dataset, capsys):
    path = write_config(tmp_path, dataset, text_encoder_2_precision="int8-quanto")  # Lumina2: Gemma2 only
    assert main(["check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "text_encoder_2_precision" in err and "no text encoder 2" in err and "Gemma2" in err
    load_config(write_config(tmp_path, dataset, text_encoder_2_precision="no_change"))  # changes nothing


@pytest.mark.parametrize("key", ["text_encoder_1_precision", "text_encoder_2_precision"])
@pytest.mark.parametrize("value", ["int4-torchao"])
def test_unimplemented_text_encoder_precision_is_refused(tmp_path, dataset, key, value):
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, model_family="kandinsky5-image", **{key: value}))
    text = "\n".join(info.value.problems)
    assert key in text and "not implemented yet" in text and value in text


def test_lora_on_torchao_base_prints_no_peft_merge_warning(tmp_path, dataset):
    """peft warns per torchao layer that merge() would fail; difftune never merges, so no such warning is shown."""
    import warnings

    path = write_config(tmp_path, dataset, model_family="lumina2", model_flavour="tiny-random",
                        base_model_precision="int8-torchao", **{**FAST, "max_train_steps": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = build_run(load_config(path))
    assert quantized_weights(run.accelerator.unwrap_model(run.transformer)) > 0
    assert not [w for w in caught if "TorchaoLoraLinear" in str(w.message)]
