"""CREPA / REPA (train/crepa.py) on the tiny models, with a tiny random DINOv2 saved offline."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.models import get_family, tiny_model
from difftune.train import crepa
from difftune.train.loop import train
from difftune.train.setup import build_run
from families import Case
from test_train import crash_then_resume, losses


@pytest.fixture(scope="session")
def dino(tmp_path_factory):
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("dino")
    Dinov2Model(Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                             patch_size=14, image_size=28)).save_pretrained(folder)
    return str(folder)


def on(dino, **extra):
    return dict(crepa_enabled=True, crepa_encoder=dino, crepa_encoder_image_size=28, crepa_block_index=1) | extra


def test_alignment_weights_neighbours_by_distance():
    tokens = torch.randn(1, 3, 4, 8)
    same = crepa.alignment(tokens, tokens, 0, 1.0, True)
    assert same.item() == pytest.approx(-1.0)  # each frame with itself: cosine 1
    targets = torch.randn(1, 3, 4, 8)
    # frame 0 has one neighbour, frame 1 two, frame 2 one: summed with weight exp(-1/tau), then averaged
    expected = 0.0
    for t in range(3):
        for d in (-1, 0, 1):
            if 0 <= t + d < 3:
                cos = torch.nn.functional.cosine_similarity(tokens[0, t], targets[0, t + d], dim=-1).mean()
                expected -= float(torch.exp(torch.tensor(-abs(d) / 2.0))) * cos.item()
    got = crepa.alignment(tokens, targets, 1, 2.0, True)
    assert got.item() == pytest.approx(expected / 3, rel=1e-5)
    assert crepa.alignment(tokens, targets, 1, 2.0, False).item() == pytest.approx(expected, rel=1e-5)


def test_config_keys(tmp_path, dataset, dino):
    cfg = load_config(write_config(tmp_path, dataset, crepa_enabled=True)).train
    assert (cfg.crepa_block_index, cfg.crepa_lambda, cfg.crepa_adjacent_distance, cfg.crepa_adjacent_tau) == (8, 0.5, 1, 1.0)
    assert (cfg.crepa_encoder, cfg.crepa_encoder_image_size) == ("dinov2_vitg14", 518)  # the spec's defaults
    bad = {"crepa_drop_vae_encoder": dict(crepa_drop_vae_encoder=True), "crepa_lambda": dict(crepa_lambda=-1.0),
           "crepa_adjacent_tau": dict(crepa_adjacent_tau=0.0)}
    for expected, keys in bad.items():
        with pytest.raises(ConfigError, match=expected):
            load_config(write_config(tmp_path / expected, dataset, crepa_enabled=True, **keys))
    load_config(write_config(tmp_path / "off", dataset, crepa_drop_vae_encoder=True))  # free while off
    # A wrong encoder fails at check, before any model loads and before caching (DINOv2 loads after it)
    for typo, message in (("dinov2_vitg14_typo", "neither an existing folder nor a hub id"),
                          ("/nowhere/dino", "the folder '/nowhere/dino' does not exist")):
        with pytest.raises(ConfigError, match=f"crepa_encoder: .*{message}"):
            load_config(write_config(tmp_path / "enc", dataset, crepa_enabled=True, crepa_encoder=typo))
    load_config(write_config(tmp_path / "enc-off", dataset, crepa_encoder="/nowhere/dino"))  # free while off
    with pytest.raises(crepa.CrepaError, match="crepa_block_index 8 is out of range"):
        build_run(load_config(write_config(tmp_path / "range", dataset, **on(dino, crepa_block_index=8))))
    with pytest.raises(crepa.CrepaError, match="inside the TREAD route"):
        build_run(load_config(write_config(tmp_path / "tread", dataset, **on(dino), tread_config={
            "routes": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": -1}]})))


def test_lambda_zero_is_off_and_crepa_trains_outside_the_adapter(tmp_path, dataset, dino):
    common = dict(max_train_steps=2, train_batch_size=2)
    plain = train(build_run(load_config(write_config(tmp_path / "off", dataset, **common))))
    zero = train(build_run(load_config(write_config(tmp_path / "zero", dataset, **common, **on(dino, crepa_lambda=0.0)))))
    assert losses(tmp_path / "zero" / "output") == losses(tmp_path / "off" / "output")  # bit for bit
    a, b = load_file(plain), load_file(zero)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    adapter = train(build_run(load_config(write_config(tmp_path / "on", dataset, **common, **on(dino)))))
    assert losses(tmp_path / "on" / "output")[1] != losses(tmp_path / "off" / "output")[1]  # the term is in the loss
    weights = load_file(adapter)
    assert weights.keys() == a.keys() and not all(torch.equal(a[k], weights[k]) for k in a)  # same keys, trained
    ckpt = tmp_path / "on" / "output" / "checkpoints" / "checkpoint-0000002"
    projector = load_file(ckpt / crepa.PROJECTOR_FILE)
    fresh = crepa.projector(48, 16, 7).state_dict()  # its start (tiny Lumina2's hidden size, DINOv2's width, seed)
    assert projector.keys() == fresh.keys() and not torch.equal(projector["0.weight"], fresh["0.weight"])
    off_ckpt = tmp_path / "off" / "output" / "checkpoints" / "checkpoint-0000002"
    assert load_file(ckpt / "trainable.safetensors").keys() == load_file(off_ckpt / "trainable.safetensors").keys()
    assert not (off_ckpt / crepa.PROJECTOR_FILE).exists()


@pytest.mark.slow
def test_crepa_resumes_exactly(tmp_path, dataset, dino, monkeypatch):
    common = dict(max_train_steps=4, train_batch_size=2, checkpoint_step_interval=2, resume_from_checkpoint="latest",
                  **on(dino))
    train(build_run(load_config(write_config(tmp_path / "whole", dataset, **common))))
    crash_then_resume(monkeypatch, write_config(tmp_path / "resumed", dataset, **common), at_step=3)
    assert losses(tmp_path / "resumed" / "output") == pytest.approx(losses(tmp_path / "whole" / "output"),
                                                                     rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("case", [Case("kandinsky5-video", "tiny-random"),
                                  pytest.param(Case("kandinsky5-image", "tiny-random"), marks=pytest.mark.slow)],
                         ids=lambda c: c.id)
def test_term_on_kandinsky5(case, dino):
    """The visual stream: hidden states of every latent frame are aligned, a gradient reaches the model."""
    from types import SimpleNamespace as NS

    family = get_family(case.family)
    comps = family.load(str(tiny_model(case.family, case.flavour)), torch.float32)
    transformer = comps.transformer.train()
    cfg = NS(crepa_block_index=0, crepa_encoder=dino, crepa_encoder_image_size=28, seed=0, tread_config=None,
             crepa_adjacent_distance=1, crepa_adjacent_tau=1.0, crepa_normalize_by_frames=True, crepa_lambda=0.5)
    aligner = crepa.attach(NS(crepa_enabled=True, **vars(cfg)), family, comps, torch.device("cpu"))
    torch.manual_seed(0)
    x0 = torch.randn(1, 16, 2, 8, 8) if case.video else torch.randn(1, 16, 8, 8)
    text = {"prompt_embeds": torch.randn(1, 5, transformer.config.in_text_dim),
            "pooled": torch.randn(1, transformer.config.in_text_dim2)}
    family.predict(transformer, x0, torch.tensor([0.5]), text)
    hidden = aligner.captured
    assert hidden.shape[1] == (2 if case.video else 1) * 16  # every latent frame's 4x4 tokens
    hidden.retain_grad()
    term = aligner.term(x0)
    term.backward()
    assert term.ndim == 0 and torch.isfinite(term)
    assert hidden.grad.abs().sum() > 0 and all(p.grad.abs().sum() > 0 for p in aligner.parameters())
    with torch.no_grad():  # sampling captures nothing
        family.predict(transformer, x0, torch.tensor([0.5]), text)
    assert aligner.captured is None
