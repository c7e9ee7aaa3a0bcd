"""LayerSync (`layersync_*`, train/layersync.py): an earlier block's output pulled towards a deeper block's output of
the same forward pass (the teacher taken without gradient), blocks counted from 1 as SimpleTuner counts them."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.models import get_family, tiny_model
from difftune.train import layersync
from difftune.train.loop import train
from difftune.train.setup import build_run
from test_train import crash_then_resume, losses

# tiny Lumina2 has 2 joint blocks: the first aligned with the second
ON = dict(layersync_enabled=True, layersync_student_block=1, layersync_teacher_block=2)


def cfg_of(student: int, teacher: int, **extra):
    return NS(layersync_enabled=True, layersync_student_block=student, layersync_teacher_block=teacher,
              layersync_lambda=0.2, tread_config=None, **extra)


def test_config(tmp_path, dataset):
    def load(name, **keys):
        return load_config(write_config(tmp_path / name, dataset, **keys))

    cfg = load("on", **ON).train
    assert (cfg.layersync_student_block, cfg.layersync_teacher_block, cfg.layersync_lambda) == (1, 2, 0.2)
    # SimpleTuner's configure tool writes the defaults of the keys while LayerSync is off
    load("defaults", layersync_enabled=False, layersync_student_block=None, layersync_teacher_block=None,
         layersync_lambda=0.2)
    load("off", layersync_student_block=8, layersync_lambda=0.0)  # free while off
    with pytest.raises(ConfigError, match="layersync_enabled needs layersync_student_block"):
        load("no-student", layersync_enabled=True)
    # the teacher must be named (SimpleTuner's default, the student itself, teaches nothing) and deeper; 0 and 1
    # are both the first block, as SimpleTuner reads them
    for teacher, said in ((None, "which is unset"), (1, "which is 1"), (0, "which is 0")):
        with pytest.raises(ConfigError, match=f"layersync_teacher_block, {said}: set it above 1, e.g. 2"):
            load(f"teacher-{teacher}", **{**ON, "layersync_teacher_block": teacher})
    with pytest.raises(ConfigError, match="layersync_lambda 0 with layersync_enabled: the weight must be above 0"):
        load("zero", **ON, layersync_lambda=0)
    with pytest.raises(ConfigError, match="layersync_lambda"):
        load("negative", **ON, layersync_lambda=-1)
    # its block hooks would be traced inside a whole-model compile
    with pytest.raises(ConfigError, match="dynamo_use_regional_compilation false .* with layersync_enabled"):
        load("compile", **ON, compile=True, dynamo_use_regional_compilation=False)


def test_blocks_checked_before_caching_and_before_load(tmp_path, dataset, monkeypatch):
    def no_caching(*args, **kwargs):
        raise AssertionError("the blocks are checked before the caches fill")

    monkeypatch.setattr("difftune.train.setup.fill_caches", no_caching)
    with pytest.raises(layersync.LayerSyncError, match="layersync_teacher_block 3 is out of range: this model has 2 "
                                                       r"image/video blocks \(1 to 2\)"):
        build_run(load_config(write_config(tmp_path / "range", dataset, **{**ON, "layersync_teacher_block": 3})))
    with pytest.raises(layersync.LayerSyncError, match="layersync_teacher_block 2 lies inside the TREAD route of "
                                                       r"blocks 1-1 \(counted from 0\)"):
        build_run(load_config(write_config(tmp_path / "tread", dataset, **ON, tread_config={
            "routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 1}]})))
    # the real Lumina2 (26 blocks, from its known architecture): before any model loads, as difftune check does
    cfg = load_config(write_config(tmp_path / "real", dataset, **ON)).train
    real = cfg.model_copy(update={"model_flavour": "2.0", "layersync_student_block": 8, "layersync_teacher_block": 27})
    with pytest.raises(layersync.LayerSyncError, match="layersync_teacher_block 27 is out of range: this model has 26"):
        layersync.check_before_load(real)
    layersync.check_before_load(real.model_copy(update={"layersync_teacher_block": 26}))


def test_plan_and_check_refuse_a_block_past_the_last(tmp_path, dataset, capsys):
    from difftune.cli import main

    path = write_config(tmp_path, dataset, **{**ON, "layersync_student_block": 8, "layersync_teacher_block": 40},
                        model_flavour="2.0")
    for command in ("plan", "check"):
        assert main([command, "--config", str(path)]) == 2
        assert "layersync_teacher_block 40 is out of range: this model has 26" in capsys.readouterr().err


def _blocks_outputs(transformer, blocks, indexes):
    """Block outputs of the next call, taken by hooks of the test's own."""
    seen = {}
    handles = [blocks[i].register_forward_hook(lambda m, a, o, i=i: seen.setdefault(i, o[0] if isinstance(o, tuple)
                                                                                    else o)) for i in indexes]
    return seen, handles


def test_the_term_on_kandinsky5_video_reaches_the_student_only():
    """The similarity is the mean cosine of the two blocks' tokens, every latent frame's; its gradient reaches the
    student block and those before it, never the teacher block or those between."""
    family = get_family("kandinsky5-video")
    comps = family.load(str(tiny_model("kandinsky5-video", "tiny-random")), torch.float32)
    transformer = comps.transformer.train()
    sync = layersync.attach(cfg_of(2, 4), family, transformer)
    blocks = transformer.visual_transformer_blocks
    seen, handles = _blocks_outputs(transformer, blocks, (1, 3))
    torch.manual_seed(0)
    x0 = torch.randn(1, 16, 2, 8, 8)
    text = {"prompt_embeds": torch.randn(1, 5, transformer.config.in_text_dim),
            "pooled": torch.randn(1, transformer.config.in_text_dim2)}
    family.predict(transformer, x0, torch.tensor([0.5]), text)
    for handle in handles:
        handle.remove()
    expected = F.cosine_similarity(seen[1].reshape(1, -1, seen[1].shape[-1]).detach(),
                                   seen[3].reshape(1, -1, seen[3].shape[-1]).detach(), dim=-1).mean()
    assert seen[1].reshape(1, -1, seen[1].shape[-1]).shape[1] == 2 * 16  # 2 latent frames of 4x4 tokens
    transformer.zero_grad(set_to_none=True)
    recorded = {}
    loss = layersync.add_term(NS(layersync=sync, record=recorded.__setitem__), torch.zeros(()), x0)
    torch.testing.assert_close(loss.detach(), -0.2 * expected)
    torch.testing.assert_close(recorded["layersync_similarity"].detach(), expected)
    loss.backward()

    def reached(block):
        return any(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters())

    assert reached(blocks[0]) and reached(blocks[1])
    assert not reached(blocks[2]) and not reached(blocks[3])
    assert sync.taps.outputs == {}  # used once
    with torch.no_grad():  # sampling captures nothing
        family.predict(transformer, x0, torch.tensor([0.5]), text)
    assert sync.taps.outputs == {}


def test_lumina2_aligns_each_samples_image_tokens_with_and_without_checkpointing():
    """Lumina2's joint blocks hold each sample's caption tokens, then its image tokens: only the image tokens are
    aligned, sample by sample at its own caption length. Gradient checkpointing's recomputation changes nothing."""
    family = get_family("lumina2")
    comps = family.load(str(tiny_model("lumina2", "tiny-random")), torch.float32)
    transformer = comps.transformer.train()
    sync = layersync.attach(cfg_of(1, 2), family, transformer)
    torch.manual_seed(0)
    x0 = torch.randn(2, transformer.config.in_channels, 8, 8)
    dim = transformer.config.cap_feat_dim
    mask = torch.tensor([[1] * 3 + [0] * 2, [1] * 5])  # the captions differ in length
    text = {"prompt_embeds": torch.randn(2, 5, dim), "attention_mask": mask}
    similarities = []
    for checkpointing in (False, True):
        if checkpointing:
            transformer.enable_gradient_checkpointing()
        family.predict(transformer, x0, torch.tensor([0.3, 0.7]), text)
        similarities.append(sync.similarity(x0).detach())
    torch.testing.assert_close(similarities[0], similarities[1])
    # against the image tokens taken by hand: 16 (4x4 patches of 2) after each sample's caption
    seen, handles = _blocks_outputs(transformer, transformer.layers, (0, 1))
    family.predict(transformer, x0, torch.tensor([0.3, 0.7]), text)
    for handle in handles:
        handle.remove()
    student = torch.stack([seen[0][0, 3:19], seen[0][1, 5:21]])
    teacher = torch.stack([seen[1][0, 3:19], seen[1][1, 5:21]])
    torch.testing.assert_close(sync.similarity(x0).detach(), F.cosine_similarity(student, teacher, dim=-1).mean().detach())


def test_trains_and_saves_only_the_adapter(tmp_path, dataset):
    common = dict(max_train_steps=2, train_batch_size=2)
    plain = train(build_run(load_config(write_config(tmp_path / "off", dataset, **common))))
    run = build_run(load_config(write_config(tmp_path / "on", dataset, **common, **ON)))
    assert run.layersync is not None and run.crepa is None
    adapter = train(run)
    off, on = losses(tmp_path / "off" / "output"), losses(tmp_path / "on" / "output")
    # the logged loss includes the term: -0.2 times a similarity in (0, 1] here
    assert on[1] != off[1] and all(map(torch.isfinite, map(torch.tensor, on.values())))
    steps = [e for e in map(json.loads, (tmp_path / "on" / "output" / "events.jsonl").read_text().splitlines())
             if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2] and all(0 < e["layersync_similarity"] <= 1 for e in steps)
    assert "layersync_similarity" not in (tmp_path / "off" / "output" / "events.jsonl").read_text()
    assert load_file(adapter).keys() == load_file(plain).keys()
    saved = {p.name for p in (tmp_path / "on" / "output" / "checkpoints" / "checkpoint-0000002").iterdir()}
    assert saved == {p.name for p in (tmp_path / "off" / "output" / "checkpoints" / "checkpoint-0000002").iterdir()}


@pytest.mark.slow
def test_resumes_exactly(tmp_path, dataset, monkeypatch):
    common = dict(max_train_steps=4, train_batch_size=2, checkpoint_step_interval=2, resume_from_checkpoint="latest",
                  gradient_checkpointing=True, **ON)
    train(build_run(load_config(write_config(tmp_path / "whole", dataset, **common))))
    crash_then_resume(monkeypatch, write_config(tmp_path / "resumed", dataset, **common), at_step=3)
    assert losses(tmp_path / "resumed" / "output") == pytest.approx(losses(tmp_path / "whole" / "output"),
                                                                     rel=1e-6, abs=1e-7)


def test_block_streaming_with_checkpointing_equals_resident_blocks(tmp_path, dataset):
    """Streamed blocks (their weights visit the device in turn, recomputed under checkpointing): the same losses and
    adapter as resident blocks, the term included."""
    common = dict(max_train_steps=2, train_batch_size=2, gradient_checkpointing=True, **ON)
    plain = train(build_run(load_config(write_config(tmp_path / "plain", dataset, **common))))
    streamed = train(build_run(load_config(write_config(
        tmp_path / "streamed", dataset, **common, enable_group_offload=True, group_offload_type="block_level",
        group_offload_blocks_per_group=1, group_offload_use_stream=True))))
    assert losses(tmp_path / "streamed" / "output") == losses(tmp_path / "plain" / "output")
    expected, got = load_file(plain), load_file(streamed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow  # about 40 s on 2 cores
def test_fsdp_two_processes_equal_one(tmp_path):
    """FSDP2 shards the blocks (their weights gathered in its own hooks): two processes with half the batch each
    train as one process with the whole batch, the term included."""
    from difftune.demo import make_dataset
    from test_distributed import finish, launch
    from test_fsdp import same_run

    images = tmp_path / "images"
    make_dataset(images, count=8)
    settings = dict(max_train_steps=2, gradient_checkpointing=True, **ON)
    two = write_config(tmp_path / "two", images, train_batch_size=1, fsdp_enable=True, **settings)
    one = write_config(tmp_path / "one", images, train_batch_size=2, **settings)
    finish(launch(two, 29713))
    finish(launch(one, 0, processes=1))
    same_run(tmp_path / "one" / "output", tmp_path / "two" / "output")
