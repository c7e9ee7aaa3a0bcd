"""Attention backends (train/attention.py): the choice table, refusals, equal results per backend on the tiny
models, Lumina2's full-length caption batches without a mask, and a short training run with a forced kernel."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from diffusers import Kandinsky5Transformer3DModel
from diffusers.models.attention_dispatch import _AttentionBackendRegistry
from torch.overrides import TorchFunctionMode
from torch.profiler import profile

from conftest import write_config
from difftune.cli import main
from difftune.config import ConfigError, load_config
from difftune.models import get_family, tiny_model
from difftune.train import attention
from difftune.train.attention import AttentionError, Choice, Device
from difftune.train.loop import train
from difftune.train.setup import build_run

CPU = Device("cpu")
A100, H100, T4, B200 = Device("cuda", (8, 0)), Device("cuda", (9, 0)), Device("cuda", (7, 5)), Device("cuda", (10, 0))
FA2, FA3, SAGE = "flash_attn", "flash_attn_interface", "sageattention"
ALL = {FA2, FA3, SAGE}


@pytest.mark.parametrize(("device", "packages", "key", "halves", "expected"), [
    (CPU, ALL, "auto", (False, False), ("native", "native")),
    (CPU, ALL, "auto", (True, True), ("native", "native")),  # flash kernels are CUDA-only
    (H100, ALL, "auto", (True, True), ("_flash_3", "_flash_3")),
    (H100, {FA2}, "auto", (True, True), ("flash", "flash")),  # no FlashAttention 3 built: FlashAttention 2
    (A100, ALL, "auto", (True, True), ("flash", "flash")),  # FlashAttention 3 is Hopper-only
    (B200, {FA2, FA3}, "auto", (True, True), ("flash", "flash")),
    (A100, set(), "auto", (True, True), ("native", "native")),
    (T4, ALL, "auto", (True, True), ("native", "native")),  # flash-attn needs compute capability 8.0
    (A100, ALL, "auto", (True, False), ("flash", "native")),  # fp32 weights sample in fp32: no flash there
    (H100, ALL, "auto", (False, False), ("native", "native")),
    (A100, set(), "diffusers", (True, True), ("native", "native")),
    (CPU, set(), "native-math", (False, False), ("_native_math", "_native_math")),
    (CPU, set(), "native-flash", (False, False), ("_native_flash", "_native_flash")),  # torch's CPU flash kernel
    (T4, set(), "native-efficient", (True, True), ("_native_efficient", "_native_efficient")),
    (A100, set(), "cudnn", (True, True), ("_native_cudnn", "_native_cudnn")),
    (A100, {FA2}, "flash-attn-2", (True, True), ("flash", "flash")),
    (H100, {FA3}, "flash-attn-3", (True, True), ("_flash_3", "_flash_3")),
    (A100, set(), "flex", (False, False), ("flex", "flex")),
    (H100, ALL, "sageattention", (True, True), ("_flash_3", "sage")),  # training: what 'auto' picks
    (A100, {SAGE}, "sageattention", (True, True), ("native", "sage")),
])
def test_choice_table(device, packages, key, halves, expected):
    choice = attention.choose(key, device, packages, train_half=halves[0], sample_half=halves[1])
    assert (choice.train, choice.sample) == expected


def test_nabla_models_use_flex():
    for device in (A100, H100):
        assert attention.choose("auto", device, ALL, nabla=True) == Choice("flex", "flex")
        assert attention.choose("flex", device, ALL, nabla=True) == Choice("flex", "flex")
    for key in ("native", "diffusers", "flash-attn", "native-math", "sageattention"):
        with pytest.raises(AttentionError, match=rf"attention_mechanism '{key}' cannot run this Kandinsky 5 model's "
                                                 r"sparse NABLA attention.*use attention_mechanism 'auto' or 'flex'"):
            attention.choose(key, H100, ALL, nabla=True)


@pytest.mark.parametrize(("device", "packages", "key", "halves", "message"), [
    (CPU, ALL, "flash-attn", (True, True), "'flash-attn' needs a CUDA GPU, and this run is on a cpu device"),
    (CPU, set(), "cudnn", (True, True), "'cudnn' needs a CUDA GPU, and this run is on a cpu device"),
    (CPU, set(), "native-efficient", (False, False), "'native-efficient' needs a CUDA GPU"),
    (Device("mps"), set(), "flex", (False, False), "'flex' needs a CUDA GPU or the CPU, and this run is on a mps device"),
    (CPU, set(), "flex", (False, False), "'flex' has no backward pass on a cpu device, so it cannot train there"),
    (CPU, ALL, "sageattention", (True, True), "'sageattention' needs a CUDA GPU"),
    (A100, ALL, "flash-attn-3", (True, True), "'flash-attn-3' needs a GPU of compute capability 9.x, and this run "
                                               "is on a CUDA device of compute capability 8.0"),
    (T4, ALL, "flash-attn", (True, True), "'flash-attn' needs a GPU of compute capability >= 8.0"),
    (A100, {FA3}, "flash-attn", (True, True), "'flash-attn' needs the flash_attn package, which diffusers cannot use"),
    (A100, ALL, "flash-attn", (True, False), "'flash-attn' needs bf16/fp16 tensors, and validation computes in fp32"),
    (A100, set(), "native-flash", (False, False), "'native-flash' needs bf16/fp16 tensors, and training computes"),
    (A100, ALL, "sageattention", (True, False), "'sageattention' needs bf16/fp16 tensors, and validation computes"),
])
def test_refused_on_this_device(device, packages, key, halves, message):
    with pytest.raises(AttentionError, match=message) as error:
        attention.choose(key, device, packages, train_half=halves[0], sample_half=halves[1])
    assert str(error.value).endswith("use attention_mechanism 'auto'")


def test_config_refuses_half_only_kernels_in_fp32(tmp_path, dataset):
    with pytest.raises(ConfigError, match=r"attention_mechanism 'cudnn' needs bf16/fp16 tensors, but validation "
                                          r"samples in the base weights' dtype, fp32; set mixed_precision bf16"):
        load_config(write_config(tmp_path, dataset, attention_mechanism="cudnn"))
    with pytest.raises(ConfigError, match="set base_model_default_dtype bf16"):
        load_config(write_config(tmp_path / "b", dataset, attention_mechanism="cudnn", mixed_precision="bf16",
                                 base_model_default_dtype="fp32"))
    assert load_config(write_config(tmp_path / "c", dataset, attention_mechanism="cudnn",
                                    mixed_precision="bf16")).train.attention_mechanism == "cudnn"


MATH, CPU_FLASH = "aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_flash_attention_for_cpu"


def kernels(run):
    """(run's result, the torch SDPA kernels that ran in it), as the profiler saw them."""
    with profile() as prof:
        out = run()
    return out, {e.name for e in prof.events() if e.name in (MATH, CPU_FLASH)}


class SdpaMasks(TorchFunctionMode):
    """Records the attn_mask of every torch SDPA call (None, or its shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[tuple[int, ...] | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.masks.append(None if mask is None else tuple(mask.shape))
        return func(*args, **kwargs)


def _lumina2():
    family = get_family("lumina2")
    return family, family.load(str(tiny_model("lumina2", "tiny-random")), torch.float32).transformer


def _captions(family, *lengths):
    torch.manual_seed(1)
    return family.collate_text([{"prompt_embeds": torch.randn(n, 32)} for n in lengths])


def test_lumina2_full_length_captions_run_without_a_mask():
    family, transformer = _lumina2()
    torch.manual_seed(0)
    x, sigmas = torch.randn(2, 4, 8, 8), torch.full((2,), 0.6)
    full, unequal = _captions(family, 5, 5), _captions(family, 5, 3)

    def run(text):
        with SdpaMasks() as seen:
            out = family.predict(transformer, x, sigmas, text)
        out.square().mean().backward()
        grads = [p.grad.clone() for p in transformer.parameters() if p.grad is not None]
        transformer.zero_grad()
        return out.detach(), grads, seen.masks

    stock_full, stock_grads, masks = run(full)
    assert masks == [(2, 1, 1, 5), None, None, None]  # the context refiner: an all-true mask, flash kernel off
    stock_unequal, _, stock_masks = run(unequal)
    installed = attention.install(transformer, Choice("native", "native"))
    same, grads, masks = run(full)
    assert masks == [None] * 4
    assert torch.equal(same, stock_full) and all(torch.equal(a, b) for a, b in zip(grads, stock_grads, strict=True))
    same, _, masks = run(unequal)  # unequal captions keep their mask (refiner and joint blocks)
    assert masks == stock_masks == [(2, 1, 1, 5), None, (2, 1, 1, 21), (2, 1, 1, 21)]
    assert torch.equal(same, stock_unequal)
    transformer.enable_gradient_checkpointing()  # the joint blocks are recomputed in the backward pass
    same, grads, masks = run(full)
    assert masks == [None] * 4
    assert torch.allclose(same, stock_full, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, stock_grads, strict=True))
    installed.remove(transformer)
    assert run(full)[2][0] == (2, 1, 1, 5)


@pytest.mark.parametrize("backend", ["_native_math", "_native_flash", "flex"])
def test_lumina2_backends_give_the_same_output(backend):
    """The stock processor runs unchanged; its SDPA call goes to the backend (masked calls of mask-less kernels
    to torch SDPA). flex attention has no backward pass on the CPU: compared without gradients."""
    family, transformer = _lumina2()
    torch.manual_seed(0)
    x, sigmas = torch.randn(2, 4, 8, 8), torch.full((2,), 0.6)
    grad = torch.enable_grad() if backend != "flex" else torch.no_grad()

    def both():
        return [family.predict(transformer, x, sigmas, _captions(family, *n)) for n in ((5, 5), (5, 3))]

    with grad:
        expected = both()
        attention.install(transformer, Choice(backend, backend))
        with SdpaMasks() as seen:
            got, ran = kernels(both)
    for a, b in zip(got, expected, strict=True):
        assert (a - b).abs().max() < 1e-5
    if backend == "flex":
        assert seen.masks == [] and ran == set()  # every call went to flex attention, masked ones too
    else:  # native-flash: the masked calls went to torch SDPA
        assert ran == {MATH if backend == "_native_math" else CPU_FLASH}
        assert seen.masks == [None] * 4 + [(2, 1, 1, 5), None, (2, 1, 1, 21), (2, 1, 1, 21)]


def test_lumina2_validation_samples_with_its_own_backend():
    family, transformer = _lumina2()
    x, sigmas, text = torch.randn(1, 4, 8, 8), torch.full((1,), 0.6), _captions(family, 4)
    attention.install(transformer, Choice("native", "_native_math"))  # as with sageattention: train != sample

    def forward():
        with torch.no_grad():
            return family.predict(transformer, x, sigmas, text)

    trained, ran = kernels(forward)
    assert ran == {CPU_FLASH}
    with attention.sampling(transformer):
        sampled, ran = kernels(forward)
    assert ran == {MATH} and (sampled - trained).abs().max() < 1e-5
    assert kernels(forward)[1] == {CPU_FLASH}


def _kandinsky_loss(family, transformer, x, text):
    torch.manual_seed(3)
    noise = torch.randn_like(x)
    sigmas = torch.tensor([0.7])
    noisy = (1 - sigmas.view(-1, 1, 1, 1)) * x + sigmas.view(-1, 1, 1, 1) * noise
    return (family.predict(transformer, noisy, sigmas, text) - (noise - x)).square().mean()


def test_kandinsky5_backends_give_the_same_loss():
    family = get_family("kandinsky5-image")
    transformer = family.load(str(tiny_model("kandinsky5-image", "tiny-random")), torch.float32).transformer
    cfg = transformer.config
    torch.manual_seed(0)
    x = torch.randn(1, 16, 8, 8)
    text = {"prompt_embeds": torch.randn(1, 5, cfg.in_text_dim), "pooled": torch.randn(1, cfg.in_text_dim2)}
    default = _AttentionBackendRegistry.get_active_backend()[0]
    native = _kandinsky_loss(family, transformer, x, text)
    native.backward()
    native_grads = [p.grad.clone() for p in transformer.parameters() if p.grad is not None]
    transformer.zero_grad()
    installed = attention.install(transformer, Choice("_native_math", "flex"))
    assert _AttentionBackendRegistry.get_active_backend()[0] == default  # diffusers' default is left alone
    math, ran = kernels(lambda: _kandinsky_loss(family, transformer, x, text))
    assert ran == {MATH}
    math.backward()
    assert (math - native).abs() < 1e-5
    grads = [p.grad for p in transformer.parameters() if p.grad is not None]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, native_grads, strict=True))
    with attention.sampling(transformer), torch.no_grad():  # validation: the sampling backend, here flex
        flex, ran = kernels(lambda: _kandinsky_loss(family, transformer, x, text))
    assert ran == set() and (flex - native).abs() < 1e-5
    assert kernels(lambda: _kandinsky_loss(family, transformer, x, text))[1] == {MATH}  # training's again
    installed.remove(transformer)
    assert kernels(lambda: _kandinsky_loss(family, transformer, x, text))[1] == {CPU_FLASH}  # torch's CPU default


def _nabla_video():
    """The tiny Kandinsky 5 video transformer with NABLA sparse attention (as the 10s models), same weights."""
    family = get_family("kandinsky5-video")
    plain = family.load(str(tiny_model("kandinsky5-video", "tiny-random")), torch.float32).transformer
    nabla = Kandinsky5Transformer3DModel.from_config({
        **plain.config, "attention_type": "nabla", "attention_P": 0.9, "attention_wT": 11, "attention_wH": 3,
        "attention_wW": 3, "attention_add_sta": True, "attention_method": "topcdf"})
    nabla.load_state_dict(plain.state_dict())
    return family, nabla


def test_nabla_attention_runs_with_flex_only():
    family, transformer = _nabla_video()
    cfg = transformer.config
    torch.manual_seed(0)
    x = torch.randn(1, 16, 1, 16, 16)  # 8x8 patches: one 64-token NABLA block
    text = {"prompt_embeds": torch.randn(1, 5, cfg.in_text_dim), "pooled": torch.randn(1, cfg.in_text_dim2)}
    cpu = cpu_config(attention_mechanism="native-math")
    with pytest.raises(AttentionError, match="'native-math' cannot run this Kandinsky 5 model's sparse NABLA"):
        attention.apply(cpu, transformer, torch.device("cpu"), lambda *a, **k: None)
    with pytest.raises(AttentionError, match="'auto' has no backward pass on a cpu device"):  # auto is flex here
        attention.apply(cpu_config(), transformer, torch.device("cpu"), lambda *a, **k: None)
    attention.install(transformer, Choice("native", "native"))
    with torch.no_grad(), pytest.raises(Exception, match="BlockMask"):  # torch SDPA cannot take its mask
        family.predict(transformer, x, torch.tensor([0.5]), text)
    attention.install(transformer, Choice("flex", "flex"))
    with torch.no_grad():
        out = family.predict(transformer, x, torch.tensor([0.5]), text)
    assert out.shape == x.shape and torch.isfinite(out).all()


def cpu_config(**keys):
    """The keys apply() reads, as a TrainConfig has them (CPU: fp32)."""
    from types import SimpleNamespace

    return SimpleNamespace(attention_mechanism=keys.get("attention_mechanism", "auto"), mixed_precision="no",
                           weight_dtype_name=lambda: "fp32")


def test_device_refusal_comes_before_the_model_loads(tmp_path, dataset, capsys):
    path = write_config(tmp_path, dataset, attention_mechanism="native-efficient")
    assert main(["check", "--config", str(path)]) == 0  # valid config: check says nothing about attention
    assert "attention" not in capsys.readouterr().out
    assert main(["train", "--config", str(path)]) == 2  # said, not a traceback
    err = capsys.readouterr().err
    assert "error: the configuration cannot be used:\n  - attention_mechanism 'native-efficient' needs a CUDA GPU, " \
           "and this run is on a cpu device; use attention_mechanism 'auto'" in err
    assert "loading lumina2" not in err and not (tmp_path / "output" / "events.jsonl").exists()


def test_training_with_the_math_kernel(tmp_path, dataset):
    """End to end with attention_mechanism native-math: the losses of the default kernel, within 1e-5."""
    sampled = dict(validation_prompt="a red circle", validation_resolution="32x32", validation_num_inference_steps=2)
    logs = {}
    for key, extra in (("auto", {}), ("native-math", sampled)):
        config = write_config(tmp_path / key, dataset, attention_mechanism=key, max_train_steps=2, train_batch_size=2,
                              **extra)
        run = build_run(load_config(config))
        train(run)
        logs[key] = [json.loads(line) for line in (run.output_dir / "events.jsonl").read_text().splitlines()]
    assert list((tmp_path / "native-math" / "output" / "validation").glob("final-*.png"))
    info = [e["message"] for e in logs["native-math"] if e["event"] == "info" and e["message"].startswith("attention")]
    assert info == ["attention: torch SDPA (math kernel) for training and validation (attention_mechanism "
                    "'native-math')"]
    losses = {key: [e["loss"] for e in log if e["event"] == "step"] for key, log in logs.items()}
    assert len(losses["auto"]) == 2 and losses["native-math"] == pytest.approx(losses["auto"], abs=1e-5)
