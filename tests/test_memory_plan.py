"""`difftune plan` (memory_plan/): weights exact against the loaded, quantized tiny model; activations within
tolerance of what autograd really saves; monotone lever choice; the CLI's tables and exit status."""

from __future__ import annotations

import pytest
import torch

from conftest import write_config
from difftune.cli import PLAN_DOES_NOT_FIT, main
from difftune.config import load_config
from difftune.memory_plan import architecture as A
from difftune.memory_plan import measure
from difftune.memory_plan.levers import choose, ladder
from difftune.memory_plan.predict import (
    GIB,
    _transformer,
    activation_bytes,
    block_bytes,
    coefficients_for,
    predict,
    tokens_of,
)
from difftune.models.quantize import QUANTIZERS, weight_bytes


@pytest.fixture(scope="module")
def tiny_cfg(tmp_path_factory):
    from difftune.demo import make_dataset

    root = tmp_path_factory.mktemp("plan")
    make_dataset(root / "images", count=2)
    return load_config(write_config(root, root / "images", mixed_precision="bf16", validation_resolution="64x64"))


def loaded_transformer(cfg):
    from diffusers import Lumina2Transformer2DModel

    return Lumina2Transformer2DModel.from_pretrained(A.architecture_of(cfg).name, subfolder="transformer",
                                                     torch_dtype=torch.bfloat16)


@pytest.mark.parametrize("precision", ["no_change", "int8-quanto", "int8-torchao"])
def test_transformer_bytes_exact(tiny_cfg, precision):
    """The planner's bytes equal the whole loaded transformer's after models/quantize.py quantizes it."""
    cfg = tiny_cfg.train
    model = loaded_transformer(cfg)
    if precision != "no_change":
        from difftune.models.quantize import quantized_layers

        QUANTIZERS[precision](model, quantized_layers(model))
    predicted = _transformer(A.architecture_of(cfg), "bf16", precision)[0]
    assert predicted == weight_bytes(model)


def test_adapter_parameters_exact(tiny_cfg):
    """LoRA parameters: the count adapters/kinds.py trains on the loaded model."""
    from difftune.adapters.kinds import build_adapter
    from difftune.models import get_family

    cfg = tiny_cfg.train
    adapter = build_adapter(cfg, get_family(cfg.model_family), loaded_transformer(cfg))
    prediction = predict(cfg, None)
    line = next(li for li in prediction.phase("training").lines if li.label.startswith("adapter"))
    assert line.bytes == sum(p.numel() for p in adapter.parameters()) * 4


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_within_tolerance(tiny_cfg, checkpointing):
    """Saved activations predicted (fitted on 2 blocks per stack at two other token counts) against autograd's
    saved tensors in the whole tiny model at the bucket, computed for real in bf16."""
    cfg = tiny_cfg.train.model_copy(update={"gradient_checkpointing": checkpointing, "train_batch_size": 2})
    arch = A.architecture_of(cfg)
    blocks = _transformer(arch, "bf16", "no_change")[1]
    model = loaded_transformer(cfg)
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_rank,
                                 target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    latent, text = (1, 24, 16), 40
    measured = measure.saved_by_block(arch, model, latent, text, checkpointing, batch=2, backward=True)
    saved, transient, _ = activation_bytes(cfg, arch, blocks, tokens_of(arch, (128, 192)), text,
                                           coefficients_for(arch)[0])
    assert saved == pytest.approx(sum(measured.values()), rel=0.15)
    assert (transient > 0) == checkpointing


def test_no_lever_when_it_fits(tiny_cfg):
    cfg = tiny_cfg.train
    peak = predict(cfg, None).peak
    choice = choose(cfg, None, peak / GIB * 1.01)
    assert choice.fits and choice.steps == []


def test_levers_monotone_and_cheapest_first(tiny_cfg):
    """Lumina2 2.0 at real size (meta models, no weights): more memory never needs more levers, every answer's
    predicted peak fits, the free rung comes first, checkpointing saves the most, and at 24 GiB it alone is
    enough."""
    cfg = tiny_cfg.train.model_copy(update={"model_flavour": "2.0", "validation_resolution": "1024x1024",
                                            "lora_rank": 16})
    before = predict(cfg, None)
    assert 20 * GIB < before.peak < 40 * GIB  # 2.6B bf16 (~4.9 GiB) + ~20 GiB of activations at 1024 px
    assert ladder(cfg, before, 1)[:2] == [[{"offload_during_startup": True}],
                                          [{"offload_during_startup": True, "gradient_checkpointing": True}]]
    counts = []
    for gigabytes in (80, 32, 24, 12, 8, 6, 4, 2):
        choice = choose(cfg, None, gigabytes, 1, before)
        if not choice.fits:
            assert gigabytes <= 4 and "nothing fits" in choice.message
            continue
        assert choice.after.peak <= gigabytes * GIB
        counts.append(len(choice.steps))
        if choice.steps:  # checkpointing is always among them, and saves the most (~20 GiB of activations)
            assert max(choice.steps, key=lambda s: s.saving).key == "gradient_checkpointing"
            assert choice.settings()["gradient_checkpointing"] is True
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] >= 2
    assert choose(cfg, None, 24, 1, before).settings() == {"gradient_checkpointing": True}


def test_cli_plan_output_and_exit(tiny_cfg, capsys, tmp_path):
    from difftune.demo import make_dataset

    make_dataset(tmp_path / "images", count=2)
    path = write_config(tmp_path, tmp_path / "images", mixed_precision="bf16", validation_resolution="64x64")
    assert main(["plan", "--config", str(path), "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    for phase in ("caching: text", "caching: latents", "training", "validation", "predicted peak"):
        assert phase in out
    assert "no lever needed" in out
    assert main(["plan", "--config", str(path), "--gpu-memory", "0.0001"]) == PLAN_DOES_NOT_FIT
    assert "nothing fits" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("family,flavour", [("lumina2", "2.0"), ("kandinsky5-image", "t2i-lite-sft")])
def test_real_size_blocks_match_measurement(family, flavour):
    """At real width, per-block saved activations computed for real (bf16, matmuls emulated in fp32) at a token
    count the coefficients were not fitted on: within 15% of coefficients.py."""
    name, config = A.real_architecture(family, flavour)
    arch = A.Architecture(family, name, config, known=True)
    coefficients = coefficients_for(arch)[0]
    model = measure.reduced_model(arch, "lora")
    latent, text = measure.CHECK_LAYOUT
    tokens = measure.image_tokens(family, config, latent)
    for checkpointing in (False, True):
        found = measure.per_stack(measure.saved_by_block(arch, model, latent, text, checkpointing))
        table = coefficients["checkpointed" if checkpointing else "lora"]
        for stack, size in found.items():
            if stack == "outside":
                continue
            predicted = block_bytes(table, stack, tokens, text)
            print(f"{name} {stack} checkpointing={checkpointing}: measured {size / 2**20:.2f} MiB, "
                  f"predicted {predicted / 2**20:.2f} MiB")
            assert predicted == pytest.approx(size, rel=0.15), (stack, checkpointing)


def test_web_ui_plans_the_edited_config(tmp_path):
    """POST /api/config/plan: the planner's prediction and choice for the form's config; a config with problems
    is not planned."""
    import json

    from fastapi.testclient import TestClient

    from difftune.demo import make_dataset
    from difftune.ui.server import create_app

    root = tmp_path / "root"
    make_dataset(root / "images", count=2)
    path = write_config(root, root / "images", mixed_precision="bf16", validation_resolution="64x64",
                        train_batch_size=8)
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False)
    body = {"path": str(path), "config": json.loads(path.read_text()),
            "datasets": json.loads((root / "config" / "multidatabackend.json").read_text())}
    answer = client.post("/api/config/plan", json=body).json()
    assert answer["ok"] and answer["plan"]["peak_bytes"] > 0 and "choice" not in answer["plan"]
    peak = answer["plan"]["peak_bytes"]
    tight = client.post("/api/config/plan", json={**body, "gpu_memory": peak * 0.8 / GIB}).json()["plan"]["choice"]
    assert tight["fits"] and tight["settings"] == {"gradient_checkpointing": True}
    assert tight["peak_bytes_after"] <= peak * 0.8
    body["config"]["learning_rate"] = "fast"
    refused = client.post("/api/config/plan", json=body).json()
    assert not refused["ok"] and refused["plan"] is None
