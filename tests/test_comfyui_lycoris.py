"""LyCORIS networks in ComfyUI's layout (adapters/comfyui_lycoris.py): every key maps to a ComfyUI weight, and the
weights ComfyUI patches from the file equal the network's merged weights, in ComfyUI's fused layout.

ComfyUI cannot be installed here. `comfy_patch` is its path for these files reduced to what they use, written from
its source (Comfy-Org/ComfyUI, 2026): the generic key map of `comfy/lora.py` `model_lora_keys_unet`
(`diffusion_model.<m>` -> `diffusion_model.<m>.weight`), `load_lora`'s `diff`/`diff_b`, and the weight adapters'
formulas: `comfy/weight_adapter/lora.py` (up @ down * alpha / rank), `loha.py` ((w1a @ w1b) * (w2a @ w2b) *
alpha / rank), `lokr.py` (kron(w1, w2), times alpha / rank only where a factor is decomposed)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from difftune.adapters.comfyui_lycoris import lycoris_to_comfyui
from difftune.adapters.lycoris import attach_lycoris
from difftune.models import get_family, tiny_model
from test_comfyui_format import comfy_architecture, linear_weights, to_comfy_layout

ALGOS = {
    "lokr": {"algo": "lokr", "linear_dim": 4, "linear_alpha": 2, "factor": 4},
    "lokr-full-factors": {"algo": "lokr", "linear_dim": 100000, "linear_alpha": 1, "factor": 4},
    "loha": {"algo": "loha", "linear_dim": 4, "linear_alpha": 2},
    "locon": {"algo": "locon", "linear_dim": 4, "linear_alpha": 2},
    "full": {"algo": "full"},
    "glora": {"algo": "glora", "linear_dim": 4, "linear_alpha": 2},
    "lokr-dora": {"algo": "lokr", "linear_dim": 4, "linear_alpha": 2, "factor": 4, "dora_wd": True},
}


def _scale(lora: dict, x: str, rank: int | None) -> float:
    alpha = lora.get(f"{x}.alpha")
    return float(alpha) / rank if alpha is not None and rank is not None else 1.0


def comfy_delta(lora: dict[str, torch.Tensor], x: str, shape) -> tuple[torch.Tensor | None, set[str]]:
    """The weight difference ComfyUI's adapters compute for stem `x`, and the keys they read."""
    g = lambda name: lora[f"{x}.{name}"].float() if f"{x}.{name}" in lora else None  # noqa: E731
    used = {k for k in lora if k.startswith(x + ".")}
    if g("diff") is not None:
        return g("diff").reshape(shape), used
    if g("lora_up.weight") is not None:
        up, down = g("lora_up.weight"), g("lora_down.weight")
        return (up.flatten(1) @ down.flatten(1)).reshape(shape) * _scale(lora, x, down.shape[0]), used
    if g("hada_w1_a") is not None:
        w = (g("hada_w1_a") @ g("hada_w1_b")) * (g("hada_w2_a") @ g("hada_w2_b"))
        return w.reshape(shape) * _scale(lora, x, g("hada_w1_b").shape[0]), used
    if g("lokr_w1") is not None or g("lokr_w1_a") is not None:
        rank = None
        w1 = g("lokr_w1")
        if w1 is None:
            w1, rank = g("lokr_w1_a") @ g("lokr_w1_b"), g("lokr_w1_b").shape[0]
        w2 = g("lokr_w2")
        if w2 is None:
            w2, rank = g("lokr_w2_a") @ g("lokr_w2_b"), g("lokr_w2_b").shape[0]
        return torch.kron(w1, w2).reshape(shape) * _scale(lora, x, rank), used
    return None, set()


def comfy_patch(model_sd: dict[str, torch.Tensor], lora: dict[str, torch.Tensor]):
    """The patched weights, and the keys ComfyUI would log as "lora key not loaded"."""
    patched = {k: v.clone().float() for k, v in model_sd.items()}
    loaded: set[str] = set()
    for key in model_sd:
        x = key[: -len(".weight")]
        delta, used = comfy_delta(lora, x, model_sd[key].shape)
        if delta is not None:
            patched[key] += delta
            loaded |= used
    return patched, set(lora) - loaded


@pytest.mark.parametrize("family_name", ["lumina2", "kandinsky5-image"])
@pytest.mark.parametrize("algo", list(ALGOS))
def test_comfyui_patches_the_networks_weights(family_name, algo):
    family = get_family(family_name)
    net = family.load(str(tiny_model(family_name, "tiny-random")), torch.float32).transformer
    base = linear_weights(net)
    network, params = attach_lycoris(net, ALGOS[algo], family=family_name)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.05)
    names = {id(m): n for n, m in net.named_modules()}
    merged = dict(base)
    with torch.no_grad():  # what each adapted layer computes: its weight, read through the identity
        for lora in network.loras:
            eye = torch.eye(lora.org_module[0].in_features)
            merged[names[id(lora.org_module[0])]] = (lora(eye) - lora(torch.zeros_like(eye[:1]))).T
    file = lycoris_to_comfyui(family_name, network, net)

    comfy_base = to_comfy_layout(family_name, base)
    assert {k[len("diffusion_model."):-len(".weight")] for k in comfy_base} == comfy_architecture(family_name, net.config)
    patched, not_loaded = comfy_patch(comfy_base, file)
    assert not not_loaded, sorted(not_loaded)[:5]
    expected = to_comfy_layout(family_name, merged)
    changed = [k for k in expected if not torch.equal(expected[k], comfy_base[k])]
    assert changed
    for key in expected:
        torch.testing.assert_close(patched[key], expected[key], atol=4e-3, rtol=1e-2, msg=key)
    if family_name == "kandinsky5-image" and algo in ("lokr", "loha", "locon", "full"):
        assert not any(k.endswith(".diff") for k in file) or algo == "full"  # renamed, not expanded


def test_a_lycoris_run_writes_the_comfyui_file(tmp_path, dataset):
    """lora_format 'comfyui' with lora_type 'lycoris' (was refused): the LyCORIS file and the ComfyUI one."""
    from conftest import write_config
    from difftune.config import load_config
    from difftune.train.loop import train
    from difftune.train.setup import build_run

    config = tmp_path / "lycoris.json"
    config.write_text(json.dumps(ALGOS["lokr"]))
    run = build_run(load_config(write_config(tmp_path, dataset, lora_type="lycoris", lycoris_config=str(config),
                                             lora_format="comfyui", max_train_steps=1, validation_prompt=None)))
    train(run)
    out = tmp_path / "output"
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    comfy = load_file(out / "comfyui_lora.safetensors")
    assert comfy and all(k.startswith("diffusion_model.") for k in comfy)


def test_the_card_points_lycoris_users_to_the_comfyui_file(tmp_path):
    from difftune.config.schema import TrainConfig
    from difftune.train.model_card import _comfyui

    config = tmp_path / "lycoris.json"
    config.write_text(json.dumps({**ALGOS["lokr"], "multiplier": 0.8}))
    keys = dict(model_family="lumina2", max_train_steps=1, lora_type="lycoris", lycoris_config=str(config))
    assert "Train with `lora_format: comfyui`" in _comfyui(TrainConfig(**keys))
    assert "strength 0.8" in _comfyui(TrainConfig(**keys, lora_format="comfyui"))
    assert "diffusers transformer folder" in _comfyui(TrainConfig(model_family="lumina2", max_train_steps=1,
                                                                  model_type="full"))
