"""Optimizer offload (train/optimizer_offload.py; optimizer_cpu_offload_method 'cpu') on the CPU, where the same code
runs with plain copies: the optimizer really steps CPU copies (its state lives beside them, not beside the model's
weights), and runs equal runs without offload to the bit, with clipping, gradient accumulation, Prodigy's global
estimate and a crash and resume, in both directions between offloaded and plain checkpoints."""

from __future__ import annotations

import pytest
import torch

from conftest import config_problems, write_config
from difftune.config import load_config
from difftune.train import loop
from difftune.train.loop import train
from difftune.train.optimizer_offload import HostStepOptimizer, host_step
from difftune.train.optimizers import build_optimizer
from difftune.train.setup import build_run
from test_offload import events
from test_train import crash_then_resume, losses

CPU = torch.device("cpu")
OFF = dict(optimizer_cpu_offload_method="cpu")
# a full fine-tune of bf16 weights with Kahan-compensated AdamW (the spec's advice), clipped, accumulated
FULL = dict(model_type="full", mixed_precision="bf16", optimizer="adamw_bf16", learning_rate=1e-4, max_grad_norm=0.01,
            gradient_accumulation_steps=2, max_train_steps=4, checkpoint_step_interval=2,
            resume_from_checkpoint="latest")


def trained(tmp_path, dataset, name, **overrides):
    run = build_run(load_config(write_config(tmp_path / name, dataset, **overrides)))
    train(run)
    return run, {k: v.clone() for k, v in run.comps.transformer.state_dict().items()}


def assert_same(a, b) -> None:
    (run_a, weights_a), (run_b, weights_b) = a, b
    assert losses(run_a.output_dir) == losses(run_b.output_dir)
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def inner_optimizer(run) -> HostStepOptimizer:
    optimizer = run.optimizer.optimizer  # accelerate's wrapper
    assert isinstance(optimizer, HostStepOptimizer)
    return optimizer


def test_full_fine_tune_equals_training_without_offload(tmp_path, dataset):
    plain = trained(tmp_path, dataset, "plain", **FULL)
    offloaded = trained(tmp_path, dataset, "offload", **FULL, **OFF)
    assert_same(plain, offloaded)
    assert len(losses(offloaded[0].output_dir)) == 4
    optimizer = inner_optimizer(offloaded[0])
    model = {p.data_ptr() for p in offloaded[0].comps.transformer.parameters()}
    # the state belongs to the CPU copies: none of its tensors, nor the weights it steps, is the model's
    assert optimizer.state_bytes() > 0 and not model & {h.data_ptr() for h in optimizer.hosts}
    assert all(t.data_ptr() not in model for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))
    said = [e for e in events(offloaded[0].output_dir) if e.get("offloaded_bytes")]
    assert len(said) == 1 and "adamw_bf16 optimizer steps in CPU memory" in said[0]["message"]
    weights = sum(p.numel() * p.element_size() for p in offloaded[0].comps.transformer.parameters())
    assert said[0]["offloaded_bytes"] == 2 * weights  # the copies and the gradient buffers


def test_crashed_and_resumed_offloaded_run_repeats_the_plain_run(tmp_path, dataset, monkeypatch):
    plain = trained(tmp_path, dataset, "plain", **FULL)
    config = write_config(tmp_path / "offload", dataset, **FULL, **OFF)
    crash_then_resume(monkeypatch, config, at_step=3)
    assert losses(tmp_path / "offload" / "output") == losses(plain[0].output_dir)


@pytest.mark.parametrize("first,then", [(OFF, {}), ({}, OFF)])
def test_checkpoints_resume_across_turning_offload_on_or_off(tmp_path, dataset, first, then):
    """The state dict is the inner optimizer's own: a run resumes it with offload switched either way."""
    plain = trained(tmp_path, dataset, "plain", **FULL)
    half = {**FULL, "max_train_steps": 2}
    trained(tmp_path, dataset, "switched", **half, **first)
    resumed = trained(tmp_path, dataset, "switched", **FULL, **then)
    assert losses(resumed[0].output_dir) == losses(plain[0].output_dir)
    assert all(torch.equal(plain[1][k], resumed[1][k]) for k in plain[1])


GRADIENTS = dict(OFF, optimizer_offload_gradients=True)  # with gradient_accumulation_steps 1


@pytest.mark.parametrize("method", ["norm", "value"])
def test_offloaded_gradients_equal_training_without_offload(tmp_path, dataset, method, monkeypatch):
    """The gradients leave during the backward pass; clipping (by norm or by value) runs on the CPU copies."""
    common = {**FULL, "gradient_accumulation_steps": 1, "grad_clip_method": method,
              "max_grad_norm": 0.01 if method == "norm" else 1e-4}
    plain = trained(tmp_path, dataset, "plain", **common)
    seen: list[int] = []  # gradients left on the device when the loop clips
    real = loop.clip_gradients

    def counting(accelerator, params, *args):
        seen.append(sum(p.grad is not None for p in params))
        return real(accelerator, params, *args)

    monkeypatch.setattr(loop, "clip_gradients", counting)
    offloaded = trained(tmp_path, dataset, "offload", **common, **GRADIENTS)
    assert_same(plain, offloaded)
    assert seen == [0, 0, 0, 0]  # the device held none of them at the end of any backward pass
    said = next(e["message"] for e in events(offloaded[0].output_dir) if e.get("offloaded_bytes"))
    assert "optimizer_offload_gradients" in said


def test_offloaded_gradients_leave_in_the_backward_and_a_non_finite_one_is_measured():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64)
    reference = torch.nn.Linear(64, 64)
    reference.load_state_dict(layer.state_dict())
    optimizer = HostStepOptimizer(list(layer.parameters()), _build, CPU, offload_gradients=True)
    x = torch.randn(8, 64)
    layer(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    assert all(p.grad is None for p in layer.parameters())
    assert all(torch.equal(h.grad, r.grad) for h, r in zip(optimizer.hosts, reference.parameters(), strict=True))
    expected = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0)
    assert torch.equal(optimizer.clip(1.0, "norm"), expected)
    assert all(torch.equal(h.grad, r.grad) for h, r in zip(optimizer.hosts, reference.parameters(), strict=True))
    optimizer.zero_grad()
    (layer(x) * float("nan")).sum().backward()
    assert not torch.isfinite(optimizer.clip(1.0, "norm"))  # the loop then skips the step


def test_offloaded_gradients_refuse_several_processes():
    from types import SimpleNamespace

    cfg = SimpleNamespace(optimizer_cpu_offload_method="cpu", optimizer_offload_gradients=True, optimizer="adamw")
    with pytest.raises(ValueError, match="before the processes could average it"):
        host_step(cfg, [_pair()[0]], _build, CPU, lambda *a, **k: None, processes=2)


@pytest.mark.parametrize("optimizer,rate", [("prodigy", 1.0), ("adamw8bit", 1e-3)])
def test_lora_with_other_optimizers_equals_training_without(tmp_path, dataset, optimizer, rate):
    """Prodigy's step size is one estimate over all the weights: one inner optimizer keeps it so."""
    common = dict(optimizer=optimizer, learning_rate=rate, max_train_steps=3, train_batch_size=2)
    assert_same(trained(tmp_path, dataset, "plain", **common), trained(tmp_path, dataset, "offload", **common, **OFF))


def _pair(seed: int = 0) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))
    return torch.nn.Parameter(weight.clone()), torch.nn.Parameter(weight.clone())


def _build(params):
    return build_optimizer("adamw", params, 0.1, (0.9, 0.999), 0.0, 1e-8)


def test_a_weight_written_outside_the_step_is_read_back_before_the_next():
    """A checkpoint loaded into the model, DDP's broadcast, an EMA swap: the device weight is the truth."""
    expected, p = _pair()
    plain, offloaded = _build([expected]), HostStepOptimizer([p], _build, CPU)
    for step in range(3):
        for weight in (expected, p):
            weight.grad = torch.full_like(weight, 0.5 + step)
        if step == 1:
            with torch.no_grad():
                expected.mul_(2.0)
                p.mul_(2.0)
        plain.step()
        offloaded.step()
        assert torch.equal(expected, p)
    offloaded.zero_grad()
    assert p.grad is None and offloaded.hosts[0].grad is None


def test_unused_weights_are_skipped_as_on_the_device():
    (a, b), (c, d) = _pair(1), _pair(2)
    plain, offloaded = _build([a, c]), HostStepOptimizer([b, d], _build, CPU)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)  # c, d: no gradient this step
    plain.step()
    offloaded.step()
    assert torch.equal(a, b) and torch.equal(c, d) and len(offloaded.state) == len(plain.state) == 1


def test_lr_schedules_act_on_the_inner_optimizer():
    _, p = _pair()
    optimizer = HostStepOptimizer([p], _build, CPU)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    p.grad = torch.ones_like(p)
    optimizer.step()
    schedule.step()
    assert optimizer.inner.param_groups[0]["lr"] == pytest.approx(0.05)


def test_off_builds_the_plain_optimizer():
    from types import SimpleNamespace

    _, p = _pair()
    cfg = SimpleNamespace(optimizer_cpu_offload_method="none", optimizer="adamw")
    assert type(host_step(cfg, [p], _build, CPU, lambda *a, **k: None)) is torch.optim.AdamW


@pytest.mark.parametrize("overrides,needles", [
    (dict(fsdp_enable=True), ["fsdp_enable", "optimizer_cpu_offload_method"]),
    (dict(mixed_precision="fp16"), ["mixed_precision 'fp16'", "'bf16'"]),
    (dict(optimizer="adamw_schedulefree", lr_scheduler="constant"), ["adamw_schedulefree", "another optimizer"]),
    (dict(optimizer_offload_gradients=True, gradient_accumulation_steps=2), ["gradient_accumulation_steps 2",
                                                                             "set gradient_accumulation_steps to 1"]),
    (dict(optimizer_offload_gradients=True, optimizer_cpu_offload_method="none"), ["optimizer_cpu_offload_method to "
                                                                                   "'cpu' too"]),
])
def test_settings_it_cannot_serve_are_refused_before_loading(tmp_path, dataset, overrides, needles):
    problems = config_problems(write_config(tmp_path, dataset, model_type="full", **{**OFF, **overrides}))
    assert all(n in problems for n in needles), problems


def test_values(tmp_path, dataset):
    for value, expected in ((None, "none"), ("none", "none"), ("cpu", "cpu")):
        cfg = load_config(write_config(tmp_path / str(value), dataset, optimizer_cpu_offload_method=value)).train
        assert cfg.optimizer_cpu_offload_method == expected
    problems = config_problems(write_config(tmp_path / "bad", dataset, optimizer_cpu_offload_method="torchao"))
    assert "optimizer_cpu_offload_method" in problems and "'cpu'" in problems


def test_host_optimizer_bench_prints_a_rate_for_every_optimizer(capsys):
    from difftune import bench_host_optimizer

    bench_host_optimizer.main(["--tensors", "2", "--size", "5000", "--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "M/s" not in line]
    assert len(rows) == len(bench_host_optimizer.CASES)
    assert all(float(cell) > 0 for row in rows for cell in row.strip("| ").split(" | ")[1:])
