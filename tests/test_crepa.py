"""CREPA / REPA (train/crepa.py) on the tiny models, with a tiny random DINOv2 saved offline."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.models import get_family, tiny_model
from difftune.train import caching, crepa
from difftune.train.loop import train
from difftune.train.setup import build_run
from families import Case, case_data, make_pairs
from test_train import crash_then_resume, losses


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


def test_neighbours_at_the_distance_or_up_to_it():
    tokens, targets = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 4, 8)

    def by_hand(offsets):
        total = 0.0
        for t in range(5):
            for d in offsets:
                if 0 <= t + d < 5:
                    cos = torch.nn.functional.cosine_similarity(tokens[0, t], targets[0, t + d], dim=-1).mean()
                    total -= float(torch.exp(torch.tensor(-abs(d) / 1.0))) * cos.item()
        return total / 5

    # the paper's K = {f-d, f+d} (and the frame itself), or every offset up to d (crepa_cumulative_neighbors)
    assert crepa.alignment(tokens, targets, 2, 1.0, True).item() == pytest.approx(by_hand((-2, 0, 2)), rel=1e-5)
    assert crepa.alignment(tokens, targets, 2, 1.0, True, cumulative=True).item() == pytest.approx(
        by_hand((-2, -1, 0, 1, 2)), rel=1e-5)
    assert crepa.alignment(tokens, targets, 1, 1.0, True).item() == pytest.approx(
        crepa.alignment(tokens, targets, 1, 1.0, True, cumulative=True).item())  # the same at distance 1


def test_weight_schedule():
    from types import SimpleNamespace as NS

    def cfg(**k):
        return NS(**({"crepa_lambda": 0.5, "crepa_warmup_steps": 0, "crepa_scheduler": "constant",
                      "crepa_decay_steps": 0, "crepa_lambda_end": 0.0, "crepa_power": 1.0, "crepa_cutoff_step": 0} | k))

    def at(c, *steps, total=100):
        return [crepa.weight(c, s, total) for s in steps]

    assert at(cfg(), 0, 50, 99) == [0.5, 0.5, 0.5]
    assert at(cfg(crepa_warmup_steps=10), 0, 5, 10, 99) == pytest.approx([0.0, 0.25, 0.5, 0.5])
    # decays after the warm-up, over crepa_decay_steps or the rest of the run, then stays at the end value
    assert at(cfg(crepa_scheduler="linear", crepa_warmup_steps=10, crepa_lambda_end=0.1), 10, 55, 100) == pytest.approx(
        [0.5, 0.3, 0.1])
    assert at(cfg(crepa_scheduler="cosine", crepa_decay_steps=20), 0, 10, 20, 90) == pytest.approx([0.5, 0.25, 0.0, 0.0])
    assert at(cfg(crepa_scheduler="polynomial", crepa_decay_steps=10, crepa_power=2.0), 5) == pytest.approx([0.125])
    assert at(cfg(crepa_cutoff_step=30), 29, 30, 31) == [0.5, 0.0, 0.0]


def test_warmup_and_cutoff_skip_the_term(tmp_path, dataset, dino, monkeypatch):
    calls = []
    real = crepa.Crepa.term
    monkeypatch.setattr(crepa.Crepa, "term", lambda self, x0: calls.append(1) or real(self, x0))
    common = dict(max_train_steps=2, train_batch_size=2)
    train(build_run(load_config(write_config(tmp_path / "off", dataset, **common))))
    # weight 0 at step 0 (the warm-up's start): the plain loss, bit for bit, and no decode or DINOv2 pass
    train(build_run(load_config(write_config(tmp_path / "warm", dataset, **common, **on(dino, crepa_warmup_steps=4)))))
    plain, warm = losses(tmp_path / "off" / "output"), losses(tmp_path / "warm" / "output")
    assert warm[1] == plain[1] and warm[2] != plain[2] and len(calls) == 1
    calls.clear()
    train(build_run(load_config(write_config(tmp_path / "cut", dataset, **common, **on(dino, crepa_cutoff_step=1)))))
    assert len(calls) == 1  # step 0 only
    assert losses(tmp_path / "cut" / "output")[1] != plain[1]


def test_similarity_threshold_cuts_the_term(tmp_path):
    from types import SimpleNamespace as NS

    def aligner(mode):
        a = crepa.Crepa.__new__(crepa.Crepa)  # the gate alone: no model needed
        a.cfg = NS(crepa_similarity_threshold=0.5, crepa_similarity_ema_decay=0.5, crepa_threshold_mode=mode,
                   crepa_block_index=0, crepa_encoder="dino")
        a.processes, a.similarity, a.cut, a.device = 1, None, torch.tensor(False), torch.device("cpu")
        a.backbone = False
        return a

    seen = [0.2, 0.9, 0.9, 0.0, 0.0]  # averages: 0.2, 0.55, 0.725, 0.3625, 0.18125
    permanent, recoverable = aligner("permanent"), aligner("recoverable")
    assert [permanent._gate(torch.tensor(v)).item() for v in seen] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert [recoverable._gate(torch.tensor(v)).item() for v in seen] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert recoverable.similarity.item() == pytest.approx(0.18125)
    # checkpointed: a resumed run goes on from the same average and the same cut
    permanent.module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    permanent.save(tmp_path)
    back = aligner("permanent")
    back.module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    back.load(tmp_path)
    assert back.cut.item() and back.similarity.item() == pytest.approx(permanent.similarity.item())


def test_similarity_threshold_in_training(tmp_path, dataset, dino):
    common = dict(max_train_steps=2, train_batch_size=2)
    train(build_run(load_config(write_config(tmp_path / "off", dataset, **common))))
    train(build_run(load_config(write_config(tmp_path / "on", dataset, **common, **on(dino)))))
    # reached at once (any similarity is above it): the plain flow loss, bit for bit
    train(build_run(load_config(write_config(tmp_path / "low", dataset, **common,
                                             **on(dino, crepa_similarity_threshold=1e-9, crepa_similarity_ema_decay=0.0)))))
    # never reached: CREPA as without a threshold
    train(build_run(load_config(write_config(tmp_path / "high", dataset, **common,
                                             **on(dino, crepa_similarity_threshold=1.0)))))
    off, on_, low, high = (losses(tmp_path / k / "output") for k in ("off", "on", "low", "high"))
    assert low == off and high == on_ and on_ != off
    assert (tmp_path / "high" / "output" / "checkpoints" / "checkpoint-0000002" / crepa.SIMILARITY_FILE).is_file()


def test_config_keys(tmp_path, dataset, dino, monkeypatch):
    cfg = load_config(write_config(tmp_path, dataset, crepa_enabled=True)).train
    assert (cfg.crepa_block_index, cfg.crepa_lambda, cfg.crepa_adjacent_distance, cfg.crepa_adjacent_tau) == (8, 0.5, 1, 1.0)
    assert (cfg.crepa_encoder, cfg.crepa_encoder_image_size) == ("dinov2_vitg14", 518)  # the spec's defaults
    bad = {"crepa_lambda": dict(crepa_lambda=-1.0), "crepa_adjacent_tau": dict(crepa_adjacent_tau=0.0)}
    for expected, keys in bad.items():
        with pytest.raises(ConfigError, match=expected):
            load_config(write_config(tmp_path / expected, dataset, crepa_enabled=True, **keys))
    load_config(write_config(tmp_path / "off", dataset, crepa_drop_vae_encoder=True))  # free while off
    # SimpleTuner's names: crepa_model is crepa_encoder (the backbone mode: test_crepa_backbone.py)
    assert load_config(write_config(tmp_path / "alias", dataset, crepa_model="dinov2_vits14")).train.crepa_encoder == \
        "dinov2_vits14"
    load_config(write_config(tmp_path / "dep", dataset, crepa_similarity_ema_decay=0.99, crepa_threshold_mode="permanent",
                             crepa_teacher_block_index=16, crepa_scheduler="cosine", crepa_warmup_steps=100,
                             crepa_decay_steps=5000, crepa_lambda_end=0.1, crepa_cutoff_step=3000))
    # A wrong encoder fails at check, before any model loads and before caching (DINOv2 loads after it)
    for typo, message in (("dinov2_vitg14_typo", "neither an existing folder nor a hub id"),
                          ("/nowhere/dino", "the folder '/nowhere/dino' does not exist")):
        with pytest.raises(ConfigError, match=f"crepa_encoder: .*{message}"):
            load_config(write_config(tmp_path / "enc", dataset, crepa_enabled=True, crepa_encoder=typo))
    load_config(write_config(tmp_path / "enc-off", dataset, crepa_encoder="/nowhere/dino"))  # free while off
    def no_caching(*args, **kwargs):
        raise AssertionError("the block is checked before the caches fill")

    monkeypatch.setattr("difftune.train.setup.fill_caches", no_caching)
    with pytest.raises(crepa.CrepaError, match="crepa_block_index 8 is out of range"):
        build_run(load_config(write_config(tmp_path / "range", dataset, **on(dino, crepa_block_index=8))))
    empty = tmp_path / "not-dino"
    empty.mkdir()
    with pytest.raises(crepa.CrepaError, match="cannot load DINOv2"):  # offline, or not a model: before caching too
        build_run(load_config(write_config(tmp_path / "enc-empty", dataset, **on(dino, crepa_encoder=str(empty)))))
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


def test_crepa_switched_across_a_resume(tmp_path, dataset, dino):
    """On over a checkpoint without a projector: refused in words about CREPA (was torch's "loaded state dict
    contains a parameter group that doesn't match"). Off over one with a projector: goes on, the optimizer afresh."""
    import json

    common = dict(max_train_steps=2, train_batch_size=2, checkpoint_step_interval=2, resume_from_checkpoint="latest")
    train(build_run(load_config(write_config(tmp_path / "plain", dataset, **common))))
    with pytest.raises(ValueError, match="was trained without CREPA .* but crepa_enabled is on"):
        train(build_run(load_config(write_config(tmp_path / "plain", dataset, **{**common, "max_train_steps": 3},
                                                 **on(dino)))))
    train(build_run(load_config(write_config(tmp_path / "with", dataset, **common, **on(dino)))))
    train(build_run(load_config(write_config(tmp_path / "with", dataset, **{**common, "max_train_steps": 3}))))
    out = tmp_path / "with" / "output"
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "step"][-1] == 3
    assert any(e["event"] == "warning" and "was trained with CREPA, and crepa_enabled is off now" in e["message"]
               for e in events)


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
             crepa_use_backbone_features=False,
             crepa_adjacent_distance=1, crepa_adjacent_tau=1.0, crepa_normalize_by_frames=True, crepa_lambda=0.5,
             crepa_cumulative_neighbors=False, crepa_spatial_align=True, crepa_similarity_threshold=None,
             weight_dtype_name=lambda: "fp32")
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
    # crepa_spatial_align false: frame means aligned instead of tokens, another (finite) term
    family.predict(transformer, x0, torch.tensor([0.5]), text)
    aligner.cfg.crepa_spatial_align = False
    pooled = aligner.term(x0)
    assert torch.isfinite(pooled) and pooled.item() != pytest.approx(term.item())


# --- crepa_drop_vae_encoder -------------------------------------------------------------------------------------


def events_of(output_dir, kind):
    return [e for e in map(json.loads, (output_dir / "events.jsonl").read_text().splitlines()) if e["event"] == kind]


def spy_on_drop(monkeypatch):
    """Record, before the real drop runs, the VAE's parameter count and a weak reference to its encoder."""
    seen = []

    def spy(vae, emit):
        seen.append((sum(p.numel() for p in vae.parameters()), weakref.ref(vae.encoder)))
        return real(vae, emit)

    real = caching.drop_vae_encoder
    monkeypatch.setattr(caching, "drop_vae_encoder", spy)
    return seen


def test_drop_vae_encoder_refusals(tmp_path, dataset, dino):
    """What still encodes after caching is refused before any model loads (tiny configs, nothing trains)."""
    drop = on(dino, crepa_drop_vae_encoder=True)
    cases = {
        "vae_cache_disable: on-the-fly": dict(vae_cache_disable=True),
        "dataset 'train': vae_cache_disable encodes its latents": dict(dataset={"vae_cache_disable": True}),
    }
    for expected, keys in cases.items():
        with pytest.raises(ConfigError, match=expected) as e:
            load_config(write_config(tmp_path / "c", dataset, **drop, **keys))
        assert "crepa_drop_vae_encoder" in str(e.value)
    make_pairs(dataset, tmp_path / "inputs")
    i2i = dict(model_family="kandinsky5-image", model_flavour="tiny-random-i2i", conditioning_dir=tmp_path / "inputs",
               dataset={"conditioning_data": "inputs"})
    with pytest.raises(ConfigError, match="crepa_drop_vae_encoder with validation of the image-conditioned flavour "
                                          "'tiny-random-i2i'"):
        load_config(write_config(tmp_path / "i2i", dataset, **drop, **i2i, validation_prompt="a cat"))
    load_config(write_config(tmp_path / "i2i", dataset, **drop, **i2i))  # no validation: the pairs are cached
    clips = tmp_path / "clips"
    clips.mkdir()
    i2v = dict(model_family="kandinsky5-video", model_flavour="tiny-random-i2v", validation_num_video_frames=17,
               dataset={"dataset_type": "video", "resolution": 32, "video": {"num_frames": 9}})
    with pytest.raises(ConfigError, match="image-conditioned flavour 'tiny-random-i2v'"):
        load_config(write_config(tmp_path / "i2v", clips, **drop, **i2v, validation_prompt_library=True))
    load_config(write_config(tmp_path / "t2i", dataset, **drop, validation_prompt="a cat"))  # decoding only
    load_config(write_config(tmp_path / "off", dataset, crepa_drop_vae_encoder=True, vae_cache_disable=True))
    with pytest.raises(crepa.CrepaError, match="does not know which parts of a Linear VAE"):
        crepa.drop_vae_encoder(torch.nn.Linear(1, 1), print)


def test_drop_vae_encoder_keeps_decoding():
    """An AutoencoderKL with a quant_conv (the tiny families' have none): both encode-only parts go, decoding is
    unchanged, and encoding fails with the reason."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4, use_quant_conv=True).eval()
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        before = vae.decode(z).sample
    size = sum(p.numel() * 4 for m in (vae.encoder, vae.quant_conv) for p in m.parameters())
    events = []
    assert crepa.drop_vae_encoder(vae, lambda kind, **data: events.append((kind, data))) == size
    assert [(kind, data["freed_bytes"], data["modules"]) for kind, data in events] == [
        ("info", size, ["encoder", "quant_conv"])]
    with torch.no_grad():
        assert torch.equal(vae.decode(z).sample, before)
    with pytest.raises(RuntimeError, match="crepa_drop_vae_encoder"):
        vae.encode(torch.zeros(1, 3, 16, 16))


def test_drop_vae_encoder_kandinsky5_video(tmp_path, dataset, dino, monkeypatch):
    """CREPA on video with the encoder freed: the same losses, LoRA and validation video as with it kept."""
    clips, keys = case_data(Case("kandinsky5-video", "tiny-random"), tmp_path, dataset)
    common = dict(model_family="kandinsky5-video", model_flavour="tiny-random", max_train_steps=2, **keys,
                  validation_prompt="a square", validation_resolution="32x32", validation_num_inference_steps=2,
                  validation_disable_unconditional=True, vae_enable_patch_conv=True,  # its wrappers: cycles
                  **on(dino, crepa_block_index=0))
    kept = train(build_run(load_config(write_config(tmp_path / "kept", clips, **common))))
    seen = spy_on_drop(monkeypatch)
    run = build_run(load_config(write_config(tmp_path / "drop", clips, **common, crepa_drop_vae_encoder=True)))
    (before, encoder), = seen
    vae = run.comps.vae
    gone = [e for e in events_of(run.output_dir, "info") if "freed_bytes" in e]
    assert encoder() is None and sum(p.numel() for p in vae.parameters()) < before  # really released
    assert gone[0]["modules"] == ["encoder", "quant_conv"] and gone[0]["freed_bytes"] > 0
    assert gone[0]["freed_bytes"] == (before - sum(p.numel() for p in vae.parameters())) * 4  # fp32, no buffers
    with pytest.raises(RuntimeError, match="encoder was freed after caching"):
        run.family.encode_images(run.comps, torch.zeros(1, 3, 1, 32, 32))
    dropped = train(run)
    assert losses(tmp_path / "drop" / "output") == losses(tmp_path / "kept" / "output")  # bit for bit
    a, b = load_file(kept), load_file(dropped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    videos = [sorted((tmp_path / name / "output" / "validation").glob("final-*.mp4")) for name in ("kept", "drop")]
    assert len(videos[1]) == 1 and [p.name for p in videos[0]] == [p.name for p in videos[1]]  # the decoder samples
    png = [p.with_suffix(".png").read_bytes() for p in (videos[0][0], videos[1][0])]
    assert png[0] == png[1]


def test_drop_vae_encoder_repa_and_resume_with_new_cache_entries(tmp_path, dataset, dino, monkeypatch):
    """REPA on Lumina2 with the encoder freed: the same losses, LoRA and samples as with it kept. Resumed after its
    latent cache was lost, a start encodes the cache again before freeing the encoder, and continues as the run
    that kept its encoder resumes."""
    common = dict(max_train_steps=2, train_batch_size=2, resume_from_checkpoint="latest", validation_prompt="a cat",
                  validation_resolution="32x32", validation_num_inference_steps=2,
                  validation_disable_unconditional=True, **on(dino))
    kept = train(build_run(load_config(write_config(tmp_path / "kept", dataset, **common))))
    seen = spy_on_drop(monkeypatch)
    dropped = train(build_run(load_config(write_config(tmp_path / "drop", dataset, **common,
                                                       crepa_drop_vae_encoder=True))))
    (_, encoder), = seen
    assert encoder() is None
    out = {name: tmp_path / name / "output" for name in ("kept", "drop")}
    freed = [(e["modules"], e["freed_bytes"] > 0) for e in events_of(out["drop"], "info") if "freed_bytes" in e]
    assert freed == [(["encoder"], True)]  # Lumina2's AutoencoderKL has no quant_conv: the encoder alone
    assert losses(out["drop"]) == losses(out["kept"])  # bit for bit
    a, b = load_file(kept), load_file(dropped)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (out["drop"] / "validation" / "final-step-000002-32x32.png").read_bytes() == \
        (out["kept"] / "validation" / "final-step-000002-32x32.png").read_bytes()

    for name in ("kept", "drop"):  # one step more, from the checkpoint at step 2; the latent cache is gone
        for entry in (tmp_path / name / "cache" / "vae").rglob("*.safetensors"):
            entry.unlink()
        extra = dict(crepa_drop_vae_encoder=True) if name == "drop" else {}
        train(build_run(load_config(write_config(tmp_path / name, dataset, **common | {"max_train_steps": 3},
                                                 **extra))))
    assert len(seen) == 2 and seen[1][1]() is None  # the second start freed the encoder again
    cache_lines = [e["message"] for e in events_of(out["drop"], "info") if e["message"].startswith("latent cache")]
    assert cache_lines == ["latent cache: 4 files: 0 from the cache, 4 newly encoded"] * 2
    assert [e["message"].endswith("at step 2") for e in events_of(out["drop"], "info")
            if e["message"].startswith("resumed from")] == [True]
    assert sorted(losses(out["drop"])) == [1, 2, 3] and losses(out["drop"]) == losses(out["kept"])


def test_validation_leaves_the_vae_where_crepa_decodes(tmp_path, dataset, dino):
    """Validation parks the VAE in CPU memory afterwards, except when CREPA decodes with it every step: then
    it stays on the accelerator (on a GPU, parking it would move every later CREPA decode to the CPU)."""
    from difftune.train.loop import sample

    for name, extra in (("plain", {}), ("crepa", on(dino))):
        run = build_run(load_config(write_config(tmp_path / name, dataset, validation_prompt="a cat",
                                                 validation_resolution="32x32", validation_num_inference_steps=1,
                                                 **extra)))
        # On this CPU-only machine the accelerator is "cpu" too: the park is told apart as the move to the
        # string "cpu" (moves to the accelerator pass run.accelerator.device, a torch.device)
        parks, real_to = [], run.comps.vae.to
        run.comps.vae.to = lambda *a, parks=parks, real_to=real_to, **k: (parks.append(a[:1] == ("cpu",)),
                                                                          real_to(*a, **k))[1]
        assert sample(run, "check")
        assert any(parks) == (name == "plain"), name
