"""`difftune plan`'s CREPA lines (memory_plan/crepa.py): exact encoder, projector and VAE bytes, the backbone mode,
and the projector's and the loss's saved activations against what autograd keeps."""

from __future__ import annotations

import pytest
import torch

from conftest import tensor_bytes, write_config
from difftune.config import load_config
from difftune.memory_plan import architecture as A
from difftune.memory_plan import measure
from difftune.memory_plan.predict import predict


def test_crepa_off_changes_nothing(real_cfg):
    """crepa_enabled off: the same prediction whatever the other crepa_* keys say, and no CREPA line. (That it is
    bit for bit the prediction from before CREPA was modelled was checked once against that commit's predict.py.)"""
    plain = predict(real_cfg, None)
    settings = {"crepa_drop_vae_encoder": True, "crepa_encoder": "dinov2_vits14", "crepa_spatial_align": False,
                "crepa_encoder_image_size": 224, "crepa_adjacent_distance": 3}
    assert predict(real_cfg.model_copy(update=settings), None) == plain
    assert not any("CREPA" in line.label for phase in plain.phases for line in phase.lines)
    assert not any("CREPA" in note for note in plain.notes)


def test_crepa_lines_and_exact_encoder_bytes(real_cfg):
    """crepa_enabled with the default encoder (dinov2_vitg14): the training phase keeps its lines and grows by at
    least DINOv2-giant's exact bytes, counted here on a meta model built from its sizes; the projector, the
    resident VAE and the working sets appear as lines, in the tables too; validation keeps the encoder."""
    from rich.console import Console
    from transformers import Dinov2Config, Dinov2Model

    from difftune.memory_plan.render import phase_tables

    with torch.device("meta"):
        giant = Dinov2Model(Dinov2Config(hidden_size=1536, num_hidden_layers=40, num_attention_heads=24,
                                         use_swiglu_ffn=True, image_size=518, patch_size=14))
    exact = tensor_bytes(giant.to(torch.bfloat16))  # loaded in the bf16 weights' dtype (train/crepa.encoder_dtype)
    assert 1.1e9 < sum(p.numel() for p in giant.parameters()) < 1.2e9

    off, on = predict(real_cfg, None), predict(real_cfg.model_copy(update={"crepa_enabled": True}), None)
    before, after = off.phase("training"), on.phase("training")
    assert after.lines[:len(before.lines)] == before.lines
    added = {line.label: line.bytes for line in after.lines[len(before.lines):]}
    assert after.total - before.total >= exact
    assert added["CREPA: DINOv2 dinov2_vitg14 = facebook/dinov2-giant: 1136.5M parameters, bf16"] == exact
    projector = (2304 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 1536 + 1536) * 4  # Lumina2's width -> DINOv2's
    assert added["CREPA: projector (12.1M parameters, fp32)"] == added["CREPA: projector gradients"] == projector
    assert added["CREPA: projector optimizer state (adamw)"] == 2 * projector
    with torch.device("meta"):
        from diffusers import AutoencoderKL

        vae = AutoencoderKL(**A.FLUX_VAE)
    assert added["CREPA: VAE (decodes the clean latents every step)"] == tensor_bytes(vae) // 2  # bf16
    tokens = 4096  # 1024 px, Lumina2: latent /8, patch 2
    assert added["CREPA: projector and loss, saved activations"] == tokens * (2304 * 4 + 4 * 2048 * 4 + 2 * 1536 * 4)
    (targets,) = [label for label in added if label.startswith("CREPA targets: ")]
    assert added[targets] > 0 and "DINOv2 pass (1 frame at 518 px)" in next(
        line.note for line in after.lines if line.label == targets)
    assert on.phase("validation").total - off.phase("validation").total == exact + 3 * projector
    console = Console(record=True, width=200)
    for table in phase_tables(on, "predicted"):
        console.print(table)
    text = console.export_text()
    assert "CREPA: DINOv2" in text and "CREPA targets" in text and "CREPA: projector gradients" in text

    unknown = predict(real_cfg.model_copy(update={"crepa_enabled": True, "crepa_encoder": "someone/other-vit"}), None)
    labels = [line.label for line in unknown.phase("training").lines]
    assert not any("DINOv2" in label or "projector" in label for label in labels)
    assert "CREPA: VAE (decodes the clean latents every step)" in labels
    assert any("'someone/other-vit'" in note and "left out" in note for note in unknown.notes)


def test_crepa_backbone_mode_holds_no_encoder_and_no_vae(real_cfg):
    """crepa_use_backbone_features: the projector maps Lumina2's width to itself; no DINOv2, no resident VAE and no
    decode, so it plans far less than DINOv2-giant; validation keeps the projector and its optimizer state only."""
    off = predict(real_cfg, None)
    backbone = predict(real_cfg.model_copy(update={"crepa_enabled": True, "crepa_use_backbone_features": True,
                                                   "crepa_block_index": 8, "crepa_teacher_block_index": 16}), None)
    dinov2 = predict(real_cfg.model_copy(update={"crepa_enabled": True}), None)
    before, after = off.phase("training"), backbone.phase("training")
    assert after.lines[:len(before.lines)] == before.lines
    added = {line.label: line.bytes for line in after.lines[len(before.lines):]}
    assert not any("DINOv2" in label or "VAE" in label for label in added)
    projector = (2304 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 2304 + 2304) * 4
    assert added["CREPA: projector (13.6M parameters, fp32)"] == added["CREPA: projector gradients"] == projector
    tokens = 4096
    assert added["CREPA: projector and loss, saved activations"] == tokens * (2304 * 4 + 4 * 2048 * 4 + 2 * 2304 * 4)
    assert added["CREPA targets: the teacher block's tokens (fp32) and the loss temporaries"] == 3 * tokens * 2304 * 4
    assert after.total < dinov2.phase("training").total - 2 * 2**30  # DINOv2-giant alone is 2.1 GiB in bf16
    assert backbone.phase("validation").total - off.phase("validation").total == 3 * projector


@pytest.mark.parametrize("flavour", ["2.0", "t2v-lite-sft-5s"])
def test_crepa_drop_vae_encoder_lowers_by_the_encoders_bytes(real_cfg, flavour):
    """crepa_drop_vae_encoder: training and validation lower by the VAE encoder's (and quant_conv's) bytes,
    counted here on the meta VAE (FLUX's AutoencoderKL, which has no quant_conv; the HunyuanVideo VAE)."""
    import diffusers

    family = "lumina2" if flavour == "2.0" else "kandinsky5-video"
    cfg = real_cfg.model_copy(update={"model_family": family, "model_flavour": flavour, "crepa_enabled": True,
                                      "crepa_encoder": "dinov2_vits14", "crepa_encoder_image_size": 224})
    if family == "kandinsky5-video":
        cfg = cfg.model_copy(update={"validation_resolution": "256x256", "validation_num_video_frames": 17})
    with torch.device("meta"):
        vae = diffusers.AutoencoderKL(**A.FLUX_VAE) if family == "lumina2" else diffusers.AutoencoderKLHunyuanVideo()
    encoder = sum(tensor_bytes(m) for m in (vae.encoder, vae.quant_conv) if m is not None) // 2  # bf16
    assert (vae.quant_conv is None) == (family == "lumina2")
    kept = predict(cfg, None)
    dropped = predict(cfg.model_copy(update={"crepa_drop_vae_encoder": True}), None)
    for phase in ("training", "validation"):
        assert kept.phase(phase).total - dropped.phase(phase).total == encoder
    assert [p.total for p in kept.phases[:2]] == [p.total for p in dropped.phases[:2]]  # caching encodes


def test_crepa_plan_matches_what_build_run_holds(tmp_path, dataset, dino):
    """The tiny Lumina2 with the tiny DINOv2 folder and crepa_drop_vae_encoder: the plan's encoder, projector and
    VAE bytes are those of the modules build_run attaches (the VAE after its encoder was freed)."""
    from difftune.train.setup import build_run

    cfg = load_config(write_config(tmp_path, dataset, crepa_enabled=True, crepa_encoder=dino,
                                   crepa_encoder_image_size=28, crepa_block_index=1, crepa_drop_vae_encoder=True))
    lines = {line.label.split(":")[1].split("(")[0].strip(): line.bytes
             for line in predict(cfg.train, None).phase("training").lines if line.label.startswith("CREPA: ")}
    run = build_run(cfg)
    assert lines[f"DINOv2 {dino}"] == tensor_bytes(run.crepa.encoder)
    assert lines["projector"] == tensor_bytes(run.crepa.module)
    assert lines["VAE"] == tensor_bytes(run.comps.vae)
    # backbone mode: the projector to the hidden size; no encoder, and no VAE kept (no validation here)
    cfg = load_config(write_config(tmp_path / "backbone", dataset, crepa_enabled=True, crepa_use_backbone_features=True,
                                   crepa_block_index=0, crepa_teacher_block_index=1))
    lines = {line.label.split(":")[1].split("(")[0].strip(): line.bytes
             for line in predict(cfg.train, None).phase("training").lines if line.label.startswith("CREPA: ")}
    run = build_run(cfg)
    assert lines["projector"] == tensor_bytes(run.crepa.module) and run.crepa.encoder is None and run.comps.vae is None
    assert not any("DINOv2" in label or "VAE" in label for label in lines)


@pytest.mark.parametrize("weights,expected", [("bf16", torch.bfloat16), ("fp32", torch.float32),
                                              ("fp16", torch.float32)])
def test_crepa_encoder_dtype_follows_the_weights(tmp_path, weights, expected):
    """The encoder is loaded in train/crepa.encoder_dtype's dtype (bf16 with bf16 weights, else fp32) whatever its
    checkpoint holds; the plan counts the bytes of the model so loaded."""
    from transformers import Dinov2Config, Dinov2Model

    from difftune.memory_plan import crepa as plan
    from difftune.train import crepa

    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                             image_size=28)).save_pretrained(tmp_path)  # an fp32 checkpoint
    dtype = crepa.encoder_dtype(weights)
    loaded = crepa.load_encoder(str(tmp_path), torch.device("cpu"), dtype)
    assert dtype == expected and loaded.dtype == expected
    assert plan.encoder_of(str(tmp_path), dtype).dtype == expected
    assert plan.encoder_size(str(tmp_path), dtype) == (tensor_bytes(loaded), sum(p.numel() for p in loaded.parameters()))


def _captured_term(cfg, batch, frames, per_frame, hidden, width, dtype):
    """train/crepa.term's graph: the projector on the captured tokens, then the alignment against targets.
    Returns (bytes autograd saved, peak of live bytes above the weights and the captured tokens)."""
    from difftune.train import crepa

    torch.manual_seed(0)
    module = crepa.projector(hidden, width, 0)
    captured = torch.randn(batch, frames * per_frame, hidden, dtype=dtype, requires_grad=True)
    skip = {t.untyped_storage()._cdata for t in [captured, *module.parameters()]}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage()._cdata not in skip:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with measure.LiveBytes(exclude=[captured, *module.parameters()]) as meter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            tokens = module(captured.reshape(batch, frames, per_frame, hidden).float())
            targets = torch.randn(batch, frames, per_frame, width)
            if not cfg.crepa_spatial_align:
                tokens, targets = tokens.mean(dim=2, keepdim=True), targets.mean(dim=2, keepdim=True)
            distance = cfg.crepa_adjacent_distance if frames > 1 else 0
            loss = crepa.alignment(tokens, targets, distance, 1.0, True, cfg.crepa_cumulative_neighbors)
        if cfg.crepa_similarity_threshold is not None:  # term's gate: a cosine whose graph is dropped at once
            loss = loss * torch.nn.functional.cosine_similarity(tokens, targets, dim=-1).mean().detach()
        del targets
    loss.backward()
    return sum(saved.values()), meter.peak


@pytest.mark.parametrize("spatial,frames,distance,cumulative,precision,threshold", [
    (True, 1, 1, False, "bf16", None), (True, 3, 1, False, "bf16", 0.5), (True, 4, 2, True, "fp32", None),
    (False, 3, 1, False, "bf16", 0.5)])
def test_crepa_activations_match_autograd(spatial, frames, distance, cumulative, precision, threshold):
    """projector_saved against autograd's saved tensors of the real projector and alignment (train/crepa.py) plus
    the projector's output, and with the loss's temporaries against the peak of live bytes: an upper bound by at
    most one offset's normalized targets (the last offset's do not exist yet at the peak of the one before)."""
    from types import SimpleNamespace

    from difftune.memory_plan import crepa as plan

    cfg = SimpleNamespace(crepa_spatial_align=spatial, crepa_adjacent_distance=distance,
                          crepa_cumulative_neighbors=cumulative, crepa_similarity_threshold=threshold,
                          mixed_precision="bf16" if precision == "bf16" else "no",
                          weight_dtype_name=lambda: precision)
    batch, per_frame, hidden, width = 2, 60, 48, 40
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    saved, peak = _captured_term(cfg, batch, frames, per_frame, hidden, width, dtype)
    predicted = plan.projector_saved(cfg, batch, frames, per_frame, hidden, width)
    output = batch * frames * per_frame * width * 4  # the projector's output: saved by the loss only token by token
    assert predicted == pytest.approx(saved + (0 if spatial else output), rel=0.003)
    bound = predicted + plan.loss_temporaries(cfg, batch, frames, per_frame, width)
    slack = output - output // frames if spatial and frames > 1 and not threshold else 0
    assert bound - slack - 0.003 * bound <= peak <= 1.003 * bound  # (+ per-token norms: a few bytes each)


def test_encoder_working_set_matches_a_whole_model():
    """measure.encoder_working_set (2 layers, ShapesOnly, 1 and 2 images) against a whole DINOv2 computed for real on
    3 images, with registers and the SwiGLU MLP too: the same peak of live bytes above the weights."""
    from transformers import Dinov2Config, Dinov2Model, Dinov2WithRegistersConfig, Dinov2WithRegistersModel

    torch.manual_seed(0)
    for cls, config in ((Dinov2Model, Dinov2Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                                   image_size=56, patch_size=14)),
                        (Dinov2WithRegistersModel, Dinov2WithRegistersConfig(
                            hidden_size=48, num_hidden_layers=3, num_attention_heads=3, use_swiglu_ffn=True,
                            image_size=56, patch_size=14))):
        per_image, fixed = measure.encoder_working_set(config, torch.float32, 70)
        model = cls(config).eval()
        pixels = torch.randn(3, 3, 70, 70)  # the input is not the forward's: the plan adds it apart
        with torch.no_grad(), measure.LiveBytes(exclude=[*model.parameters(), *model.buffers()]) as meter:
            model(pixel_values=pixels)
        assert fixed + 3 * per_image == meter.peak
        assert per_image > 0
