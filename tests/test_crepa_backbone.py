"""CREPA's backbone mode (crepa_use_backbone_features, train/crepa.py): the student block aligned with a deeper block
of the transformer itself, without DINOv2 or a VAE decode."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.models import get_family, tiny_model
from difftune.train import crepa
from difftune.train.loop import train
from difftune.train.setup import build_run
from test_train import crash_then_resume, losses

# tiny Lumina2 has 2 joint blocks (hidden size 48); the default crepa_encoder (dinov2_vitg14) is not reachable
# offline, so a run that tried to load it would fail
BACKBONE = dict(crepa_enabled=True, crepa_use_backbone_features=True, crepa_block_index=0, crepa_teacher_block_index=1)


def test_config(tmp_path, dataset):
    def load(name, **keys):
        return load_config(write_config(tmp_path / name, dataset, **keys))

    cfg = load("on", **BACKBONE).train
    assert cfg.crepa_use_backbone_features
    # SimpleTuner's newer switch is the same setting; disagreeing with the older one is an error
    newer = load("newer", crepa_enabled=True, crepa_feature_source="backbone", crepa_block_index=0,
                 crepa_teacher_block_index=1).train
    assert newer.crepa_use_backbone_features
    assert not load("encoder", crepa_enabled=True, crepa_feature_source="encoder").train.crepa_use_backbone_features
    with pytest.raises(ConfigError, match="crepa_feature_source 'backbone' and crepa_use_backbone_features False "
                                          "disagree"):
        load("both", **{**BACKBONE, "crepa_use_backbone_features": False}, crepa_feature_source="backbone")
    # 'encoder' is SimpleTuner's default (its configure tool writes it): the switch beside it wins, also from the
    # command line
    assert load("default", **BACKBONE, crepa_feature_source="encoder").train.crepa_use_backbone_features
    path = write_config(tmp_path / "cli", dataset, **{**BACKBONE, "crepa_use_backbone_features": False},
                        crepa_feature_source="encoder")
    assert load_config(path, {"crepa_use_backbone_features": "true"}).train.crepa_use_backbone_features
    # the teacher must be named (SimpleTuner's default, the student block itself, teaches nothing) and deeper
    for teacher, said in ((None, "which is unset"), (0, "which is 0")):
        with pytest.raises(ConfigError, match=f"crepa_teacher_block_index, {said}: set it above 0"):
            load(f"teacher-{teacher}", **{**BACKBONE, "crepa_teacher_block_index": teacher})
    with pytest.raises(ConfigError, match="not implemented yet: crepa_feature_source 'self_flow'"):
        load("self-flow", crepa_enabled=True, crepa_feature_source="self_flow")
    with pytest.raises(ConfigError, match="crepa_self_flow.*not implemented yet|not implemented yet.*crepa_self_flow"):
        load("self-flow-old", crepa_enabled=True, crepa_self_flow=True)
    # SimpleTuner's defaults of the keys while they are off are accepted (its configure tool writes them all)
    load("defaults", crepa_self_flow=False, crepa_self_flow_mask_ratio=0.1, crepa_feature_source="encoder",
         crepa_use_backbone_features=False, crepa_teacher_block_index=None)
    load("off", crepa_use_backbone_features=True)  # free while CREPA is off
    with pytest.raises(ConfigError, match="crepa_enabled with fsdp_enable is not supported"):
        load("fsdp", **BACKBONE, fsdp_enable=True, fsdp_version=2)
    # the DINOv2 keys are not used in backbone mode, and the teacher is not used without it: notes say so
    notes = load("notes", **BACKBONE, crepa_encoder="/nowhere/dino", crepa_drop_vae_encoder=True).notes()
    assert any(n.startswith("crepa_encoder not used: crepa_use_backbone_features") for n in notes)
    assert any(n.startswith("crepa_drop_vae_encoder not used") for n in notes)
    notes = load("teacher-alone", crepa_enabled=True, crepa_encoder="dinov2_vits14", crepa_teacher_block_index=12).notes()
    assert any(n.startswith("crepa_teacher_block_index not used: crepa_use_backbone_features is off") for n in notes)


def test_blocks_checked_before_caching_and_before_load(tmp_path, dataset, monkeypatch):
    def no_caching(*args, **kwargs):
        raise AssertionError("the blocks are checked before the caches fill")

    monkeypatch.setattr("difftune.train.setup.fill_caches", no_caching)
    with pytest.raises(crepa.CrepaError, match="crepa_teacher_block_index 2 is out of range: this model has 2"):
        build_run(load_config(write_config(tmp_path / "range", dataset, **{**BACKBONE,
                                                                           "crepa_teacher_block_index": 2})))
    with pytest.raises(crepa.CrepaError, match="crepa_teacher_block_index 1 lies inside the TREAD route of blocks 1-1"):
        build_run(load_config(write_config(tmp_path / "tread", dataset, **BACKBONE, tread_config={
            "routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 1}]})))
    # the real Lumina2 (26 blocks, from its known architecture): before any model loads, as difftune check does
    cfg = load_config(write_config(tmp_path / "real", dataset, **BACKBONE)).train
    real = cfg.model_copy(update={"model_flavour": "2.0", "crepa_block_index": 8, "crepa_teacher_block_index": 26})
    with pytest.raises(crepa.CrepaError, match="crepa_teacher_block_index 26 is out of range: this model has 26"):
        crepa.check_before_load(real)
    with pytest.raises(crepa.CrepaError, match="crepa_block_index 30 is out of range"):
        crepa.check_before_load(real.model_copy(update={"crepa_block_index": 30, "crepa_use_backbone_features": False}))
    crepa.check_before_load(real.model_copy(update={"crepa_teacher_block_index": 25}))


def test_trains_without_an_encoder_or_a_decode(tmp_path, dataset, monkeypatch):
    def no_decode(self, x0, grid):
        raise AssertionError("backbone mode decodes nothing and runs no DINOv2")

    monkeypatch.setattr(crepa.Crepa, "_encoded", no_decode)
    common = dict(max_train_steps=2, train_batch_size=2)
    plain = train(build_run(load_config(write_config(tmp_path / "off", dataset, **common))))
    run = build_run(load_config(write_config(tmp_path / "on", dataset, **common, **BACKBONE)))
    assert run.crepa.encoder is None and run.comps.vae is None  # no validation: the VAE is freed after caching
    adapter = train(run)
    off, on = losses(tmp_path / "off" / "output"), losses(tmp_path / "on" / "output")
    assert on[1] != off[1] and all(map(torch.isfinite, map(torch.tensor, on.values())))
    # the unweighted term in each step's event (the progress bar and trackers show it too)
    steps = [e for e in map(json.loads, (tmp_path / "on" / "output" / "events.jsonl").read_text().splitlines())
             if e["event"] == "step"]
    assert len(steps) == 2 and all(-1 <= e["crepa_loss"] <= 1 for e in steps)
    assert load_file(adapter).keys() == load_file(plain).keys()  # the projector is not in the adapter
    projector = load_file(tmp_path / "on" / "output" / "checkpoints" / "checkpoint-0000002" / crepa.PROJECTOR_FILE)
    assert projector["4.weight"].shape == (48, crepa.PROJECTOR_WIDTH)  # back to the hidden size: the teacher's width


@pytest.mark.slow
def test_resumes_exactly(tmp_path, dataset, monkeypatch):
    common = dict(max_train_steps=4, train_batch_size=2, checkpoint_step_interval=2, resume_from_checkpoint="latest",
                  **BACKBONE)
    train(build_run(load_config(write_config(tmp_path / "whole", dataset, **common))))
    crash_then_resume(monkeypatch, write_config(tmp_path / "resumed", dataset, **common), at_step=3)
    assert losses(tmp_path / "resumed" / "output") == pytest.approx(losses(tmp_path / "whole" / "output"),
                                                                     rel=1e-6, abs=1e-7)


def test_teacher_is_frozen_on_kandinsky5_video():
    """The term's gradient reaches the student block and the blocks before it, never the teacher block or those
    between: the teacher's output is a target, taken without gradient. Every latent frame is aligned."""
    from types import SimpleNamespace as NS

    family = get_family("kandinsky5-video")
    comps = family.load(str(tiny_model("kandinsky5-video", "tiny-random")), torch.float32)
    transformer = comps.transformer.train()
    cfg = NS(crepa_enabled=True, crepa_use_backbone_features=True, crepa_block_index=1, crepa_teacher_block_index=3,
             seed=0, tread_config=None, crepa_adjacent_distance=1, crepa_adjacent_tau=1.0,
             crepa_normalize_by_frames=True, crepa_cumulative_neighbors=False, crepa_spatial_align=True,
             crepa_similarity_threshold=None, crepa_encoder="not-loaded", weight_dtype_name=lambda: "fp32")
    aligner = crepa.attach(cfg, family, comps, torch.device("cpu"))
    assert aligner.encoder is None
    torch.manual_seed(0)
    x0 = torch.randn(1, 16, 2, 8, 8)
    text = {"prompt_embeds": torch.randn(1, 5, transformer.config.in_text_dim),
            "pooled": torch.randn(1, transformer.config.in_text_dim2)}
    family.predict(transformer, x0, torch.tensor([0.5]), text)
    assert aligner.captured.shape[1] == aligner.teacher.shape[1] == 2 * 16  # 2 latent frames of 4x4 tokens
    assert not aligner.teacher.requires_grad
    transformer.zero_grad(set_to_none=True)
    term = aligner.term(x0)
    term.backward()
    assert term.ndim == 0 and torch.isfinite(term) and aligner.captured is None and aligner.teacher is None
    blocks = transformer.visual_transformer_blocks

    def reached(block):
        return any(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters())

    assert reached(blocks[0]) and reached(blocks[1])
    assert not reached(blocks[2]) and not reached(blocks[3])
    assert all(p.grad.abs().sum() > 0 for p in aligner.parameters())
    with torch.no_grad():  # sampling captures nothing
        family.predict(transformer, x0, torch.tensor([0.5]), text)
    assert aligner.captured is None and aligner.teacher is None


def test_a_resume_that_aligns_something_else_starts_a_fresh_projector(tmp_path, dataset, dino):
    """DINOv2 then backbone mode over the same output_dir: the projector (16 wide, DINOv2's; now 48, the model's) and
    its optimizer moments start afresh with a warning, where the resume crashed in load_state_dict (size mismatch)."""
    import json

    common = dict(max_train_steps=2, train_batch_size=2, checkpoint_step_interval=2, resume_from_checkpoint="latest",
                  crepa_enabled=True, crepa_block_index=0)
    train(build_run(load_config(write_config(tmp_path, dataset, **common, crepa_encoder=dino,
                                             crepa_encoder_image_size=28))))
    first = tmp_path / "output" / "checkpoints" / "checkpoint-0000002" / crepa.PROJECTOR_FILE
    from safetensors import safe_open

    with safe_open(str(first), framework="pt") as f:
        assert f.metadata() == {"student": "block 0", "teacher": f"DINOv2 {dino}", "width": "16"}
    train(build_run(load_config(write_config(tmp_path, dataset, **{**common, "max_train_steps": 4},
                                             crepa_use_backbone_features=True, crepa_teacher_block_index=1))))
    events = [json.loads(line) for line in (tmp_path / "output" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "step"][-2:] == [3, 4]
    assert any(e["event"] == "warning" and "its CREPA projector was trained for student block 0, teacher DINOv2"
               in e["message"] and "the projector starts afresh" in e["message"] for e in events)
    # the same target again: resumed as it was, no warning
    train(build_run(load_config(write_config(tmp_path, dataset, **{**common, "max_train_steps": 6},
                                             crepa_use_backbone_features=True, crepa_teacher_block_index=1))))
    events = [json.loads(line) for line in (tmp_path / "output" / "events.jsonl").read_text().splitlines()]
    assert sum("projector starts afresh" in e.get("message", "") for e in events) == 1


def test_plan_refuses_a_block_past_the_last_as_check_does(tmp_path, dataset, capsys):
    from difftune.cli import main

    path = write_config(tmp_path, dataset, **{**BACKBONE, "crepa_block_index": 8, "crepa_teacher_block_index": 40},
                        model_flavour="2.0")
    assert main(["plan", "--config", str(path)]) == 2
    assert "crepa_teacher_block_index 40 is out of range: this model has 26" in capsys.readouterr().err


def test_the_logged_crepa_loss_is_the_term_before_the_threshold_cut(tmp_path, dataset, monkeypatch):
    """Once crepa_similarity_threshold cuts the term off, the step events' crepa_loss read 0, as if aligned perfectly;
    it is the term before the cut (the loss then lacks it)."""
    monkeypatch.setattr(crepa.Crepa, "_gate", lambda self, similarity: torch.zeros(()))  # cut from the start
    common = dict(max_train_steps=2, train_batch_size=2)
    train(build_run(load_config(write_config(tmp_path / "off", dataset, **common))))
    train(build_run(load_config(write_config(tmp_path / "cut", dataset, **common, **BACKBONE,
                                             crepa_similarity_threshold=0.5))))
    assert losses(tmp_path / "cut" / "output") == losses(tmp_path / "off" / "output")  # the term is cut off
    steps = [e for e in map(json.loads, (tmp_path / "cut" / "output" / "events.jsonl").read_text().splitlines())
             if e["event"] == "step"]
    assert all(e["crepa_loss"] != 0 for e in steps)
