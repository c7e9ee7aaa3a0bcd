"""Training-engine options: schedules, timestep distributions, loss weighting, non-finite steps,
checkpoint limits, gradient checkpointing, epochs versus steps."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import load_config
from difftune.train import loop, objective
from difftune.train.loop import NonFiniteError, train
from difftune.train.setup import build_run
from test_train import losses


def lrs(output_dir):
    lines = (output_dir / "events.jsonl").read_text().splitlines()
    return [e["lr"] for e in map(json.loads, lines) if e["event"] == "step"]


@pytest.mark.parametrize("name", ["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
                                  "polynomial"])
def test_lr_schedules(tmp_path, dataset, name):
    train(build_run(load_config(write_config(tmp_path, dataset, max_train_steps=8, lr_scheduler=name,
                                             lr_warmup_steps=2, learning_rate=1e-3))))
    curve = lrs(tmp_path / "output")
    assert len(curve) == 8
    # every schedule warms up, 'constant' too (diffusers' 'constant' would drop lr_warmup_steps): each step logs
    # the rate it trained with, so step 1 trains at the warm-up's first rate (0), step 2 half way up the 2-step
    # warm-up, and step 3 at the peak
    assert curve[0] == 0.0 and curve[1] == pytest.approx(5e-4) and curve[2] == pytest.approx(1e-3)
    assert max(curve) == pytest.approx(1e-3)
    if name.startswith("constant"):
        assert curve[2:] == [pytest.approx(1e-3)] * 6
    if name in ("linear", "cosine", "polynomial"):
        assert curve[-1] < curve[2]


def test_timestep_distributions_and_weighting():
    g = torch.Generator().manual_seed(0)
    uniform = objective.sample_sigmas(20000, 1.0, g, objective.TimestepSampling("uniform"))
    assert 0.48 < uniform.mean() < 0.52 and uniform.min() >= 0 and uniform.max() <= 1
    logit = objective.sample_sigmas(20000, 1.0, g, objective.TimestepSampling("logit_normal", 1.0, 0.5))
    assert logit.mean() > 0.65  # a positive logit_mean favours noise
    mode = objective.sample_sigmas(20000, 1.0, g, objective.TimestepSampling("mode", mode_scale=1.29))
    assert 0.0 <= mode.min() and mode.max() <= 1.0
    shifted = objective.sample_sigmas(20000, 3.0, torch.Generator().manual_seed(0), objective.TimestepSampling("uniform"))
    assert shifted.mean() > uniform.mean() + 0.1
    s = torch.tensor([0.25, 0.5])
    torch.testing.assert_close(objective.loss_weights(s, "sigma_sqrt"), torch.tensor([16.0, 4.0]))
    pred, target = torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2)
    assert objective.flow_loss(pred, target, torch.tensor([1.0, 3.0])).item() == pytest.approx(2.0)


@pytest.mark.parametrize("options", [{"timestep_sampling": "uniform"}, {"timestep_sampling": "mode"},
                                     {"loss_weighting": "cosmap"}, {"flow_schedule_auto_shift": True}])
def test_objective_options_train(tmp_path, dataset, options):
    train(build_run(load_config(write_config(tmp_path, dataset, max_train_steps=3, **options))))
    assert all(math.isfinite(v) for v in losses(tmp_path / "output").values())


def test_nonfinite_steps_skipped_then_stop_with_checkpoint_intact(tmp_path, dataset, monkeypatch):
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=20, checkpoint_step_interval=2,
                                             max_nonfinite_steps=3)))
    real = loop.micro_step

    def poisoned(run, batch):
        loss = real(run, batch)
        return loss * float("nan") if run.state.step in (2, 5, 6, 7, 8) else loss

    monkeypatch.setattr(loop, "micro_step", poisoned)
    before = {n: p.detach().clone() for n, p in run.transformer.named_parameters() if p.requires_grad}
    with pytest.raises(NonFiniteError, match="3 steps in a row"):
        train(run)
    events = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e["event"] == "warning" and "not finite" in e.get("message", "")]
    assert len(skipped) == 4 and events[-1]["event"] == "error"
    newest = sorted((run.output_dir / "checkpoints").iterdir())[-1]
    weights = load_file(newest / "trainable.safetensors")
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert any(not torch.equal(weights[n], before[n]) for n in before)


def test_checkpoints_total_limit(tmp_path, dataset):
    train(build_run(load_config(write_config(tmp_path, dataset, max_train_steps=5, checkpoint_step_interval=1,
                                             checkpoints_total_limit=2))))
    names = sorted(p.name for p in (tmp_path / "output" / "checkpoints").iterdir())
    assert names == ["checkpoint-0000004", "checkpoint-0000005"]


def test_gradient_checkpointing_gives_the_same_losses(tmp_path, dataset):
    train(build_run(load_config(write_config(tmp_path / "a", dataset, max_train_steps=3))))
    train(build_run(load_config(write_config(tmp_path / "b", dataset, max_train_steps=3, gradient_checkpointing=True))))
    a, b = losses(tmp_path / "a" / "output"), losses(tmp_path / "b" / "output")
    assert all(a[k] == pytest.approx(b[k], rel=1e-5) for k in a)


@pytest.mark.parametrize("steps,epochs,batch,accum,expected", [(0, 2, 1, 1, 8), (5, 2, 1, 1, 5), (0, 1, 2, 1, 2),
                                                               (0, 3, 1, 2, 6), (100, 1, 1, 1, 4)])
def test_epochs_and_steps(tmp_path, dataset, steps, epochs, batch, accum, expected):
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=steps, num_train_epochs=epochs,
                                             train_batch_size=batch, gradient_accumulation_steps=accum)))
    assert run.total_steps == expected


@pytest.mark.parametrize("options", [{"mixed_precision": "bf16"}, {"mixed_precision": "bf16", "base_model_default_dtype": "fp32"},
                                     {"model_type": "full", "mixed_precision": "bf16", "optimizer": "adamw_bf16"}])
def test_bf16_training_on_cpu(tmp_path, dataset, options):
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=3, **options)))
    expected = torch.float32 if options.get("base_model_default_dtype") == "fp32" else torch.bfloat16
    assert run.comps.transformer.dtype == expected
    train(run)
    assert all(math.isfinite(v) for v in losses(tmp_path / "output").values())


def test_max_grad_norm_clips(tmp_path, dataset):
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=2, max_grad_norm=1e-6)))
    seen = []
    real_step = run.optimizer.step

    def spy(*args, **kwargs):  # the gradient the optimizer is about to apply
        seen.append(float(torch.nn.utils.get_total_norm([p.grad for p in run.params if p.grad is not None])))
        return real_step(*args, **kwargs)

    run.optimizer.step = spy
    train(run)
    assert len(seen) == 2 and all(0 < norm <= 1e-6 * 1.01 for norm in seen)
