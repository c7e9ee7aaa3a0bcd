"""The precision keys (config/precision_keys.py): `vae_dtype` puts the VAE in a dtype of its own
(models/vae_dtype.py) for caching, conditioning and validation decoding, its latents cached apart;
`disable_tf32` sets torch's TF32 switches (train/torch_options.py)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.config.schema import TrainConfig
from difftune.models import get_family, tiny_model
from difftune.train.loop import train
from difftune.train.setup import build_run
from difftune.train.torch_options import apply_torch_options
from families import CASES, case_data


def test_precision_keys_validate(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, vae_dtype="fp32", disable_tf32="false")).train
    assert (cfg.vae_dtype, cfg.disable_tf32) == ("fp32", False)
    for spelling in ("default", "none", None):  # SimpleTuner's "default": the weights' dtype
        assert load_config(write_config(tmp_path, dataset, vae_dtype=spelling)).train.vae_dtype is None
    assert TrainConfig(model_family="lumina2", max_train_steps=1).disable_tf32 is None  # torch's own defaults
    for key, bad in (("vae_dtype", "fp8"), ("disable_tf32", "sometimes")):
        with pytest.raises(ConfigError) as info:
            load_config(write_config(tmp_path, dataset, **{key: bad}))
        assert key in "\n".join(info.value.problems)


@pytest.fixture
def tf32_state():
    """torch's TF32 switches are process-wide: put back exactly what they were (both of torch's views)."""
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]
    torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = saved[2:]


def tf32_switches() -> tuple:
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.allow_tf32)


def test_disable_tf32_sets_torch(tf32_state):
    def apply(value):
        cfg = TrainConfig(model_family="lumina2", max_train_steps=1, disable_tf32=value)
        return apply_torch_options(cfg, None)

    before = tf32_switches()
    assert apply(None) == [] and tf32_switches() == before  # unset: torch's settings untouched
    assert apply(False) == ["TF32 matmuls and convolutions"]  # SimpleTuner's default
    assert tf32_switches() == ("high", True, "tf32", True) and torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert apply(True) == ["TF32 off (disable_tf32)"]
    assert tf32_switches() == ("highest", False, "ieee", False)


# (case, weights' dtype, VAE dtype): the stock pipelines hand the VAE tensors in the transformer's dtype (Lumina2
# decodes its latents as they are; i2i and i2v encode the input image in it)
VAE_CASES = [(CASES[0], torch.bfloat16, torch.float32), (CASES[2], torch.bfloat16, torch.float32),
             (CASES[4], torch.bfloat16, torch.float32), (CASES[0], torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("case,weights,vae_dtype", VAE_CASES,
                         ids=[f"{c.id}-{str(w)[6:]}-vae-{str(v)[6:]}" for c, w, v in VAE_CASES])
def test_vae_in_its_own_dtype_encodes_and_decodes(case, weights, vae_dtype):
    family = get_family(case.family)
    source = str(tiny_model(case.family, case.flavour))
    own, usual = family.load(source, weights, vae_dtype=vae_dtype), family.load(source, weights)
    assert {p.dtype for p in own.vae.parameters()} == {vae_dtype} and own.transformer.dtype == weights
    assert {p.dtype for p in usual.vae.parameters()} == {weights}
    pixels = torch.rand(1, 3, 9, 32, 32) * 2 - 1 if case.video else torch.rand(1, 3, 32, 32) * 2 - 1
    latents, reference = family.encode_images(own, pixels), family.encode_images(usual, pixels)
    assert (latents.dtype, reference.dtype) == (vae_dtype, weights)  # computed in the VAE's own dtype
    assert not torch.equal(latents.float(), reference.float())
    assert torch.allclose(latents.float(), reference.float(), atol=0.1)
    # cached apart: the fingerprint holds the VAE's dtype
    assert family.identity(own)["vae"] != family.identity(usual)["vae"]
    assert family.identity(own)["vae"]["dtype"] == str(vae_dtype)
    # the stock pipeline decodes its latents (in the transformer's dtype) with it
    decoded = own.vae.decode(torch.randn_like(latents.float()).to(weights) / own.vae.config.scaling_factor).sample
    assert decoded.dtype == vae_dtype and torch.isfinite(decoded.float()).all()


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]],
                         ids=lambda c: c.id)
def test_bf16_run_with_an_fp32_vae_caches_trains_and_validates(case, tmp_path, dataset):
    """bf16 weights, vae_dtype fp32: the latent cache is written by the fp32 VAE into a folder of its own; training
    runs; the validation sample (an input image encoded, bf16 latents decoded) is an image."""
    data, extra = case_data(case, tmp_path, dataset)
    config = write_config(tmp_path, data, model_family=case.family, model_flavour=case.flavour,
                          mixed_precision="bf16", vae_dtype="fp32", max_train_steps=1, validation_prompt="a red circle",
                          validation_resolution="64x48", validation_num_inference_steps=2,
                          validation_disable_unconditional=True, **extra)
    run = build_run(load_config(config))
    assert {p.dtype for p in run.comps.vae.parameters()} == {torch.float32}  # kept on the CPU for validation
    train(run)
    folders = [p.parent for p in (tmp_path / "cache" / "vae").rglob("fingerprint.json")]
    assert len(folders) == 1
    assert json.loads((folders[0] / "fingerprint.json").read_text())["dtype"] == "torch.float32"
    entries = [load_file(f) for f in folders[0].rglob("*.safetensors")]
    assert entries and all(t.dtype == torch.float32 and torch.isfinite(t).all() for e in entries for t in e.values())
    samples = sorted((tmp_path / "output" / "validation").glob("final-*.png"))
    assert samples and np.asarray(Image.open(samples[0])).std() > 0
    # the usual VAE (bf16, the weights' dtype) encodes into another folder: the fp32 VAE's latents are not reused
    usual = write_config(tmp_path, data, model_family=case.family, model_flavour=case.flavour, mixed_precision="bf16",
                         max_train_steps=1, **extra)
    build_run(load_config(usual))
    assert len(list((tmp_path / "cache" / "vae").rglob("fingerprint.json"))) == 2
