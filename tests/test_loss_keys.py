"""loss_type (pseudo-Huber / smooth L1 with huber_c and huber_schedule) and input_perturbation (with
input_perturbation_steps): train/objective.py's math by hand, micro_step on the tiny Lumina2 replayed by hand,
scheduled sampling and ReflexFlow with both, and an exact resume."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace as NS

import pytest
import torch

from conftest import write_config
from difftune.config import load_config
from difftune.demo import make_dataset
from difftune.train import objective, rollout
from difftune.train.loop import micro_step, train
from difftune.train.setup import build_run
from test_train import crash_then_resume, losses
from test_tread import _reflex_cfg, drifted_batch


def keys(loss_type="l2", huber_schedule="snr", huber_c=0.1, input_perturbation=0.0, input_perturbation_steps=0):
    return NS(loss_type=loss_type, huber_schedule=huber_schedule, huber_c=huber_c,
              input_perturbation=input_perturbation, input_perturbation_steps=input_perturbation_steps)


def test_l2_is_the_squared_error_bit_for_bit():
    torch.manual_seed(0)
    pred, target = torch.randn(3, 4, 5, 6).bfloat16(), torch.randn(3, 4, 5, 6)
    weights, sigmas = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([0.1, 0.5, 0.9])
    element = objective.pointwise(keys(huber_c=0.3, huber_schedule="exponential"), sigmas)
    before = (pred.float() - target.float()) ** 2  # the loss as it was written before loss_type existed
    assert torch.equal(objective.flow_loss(pred, target, None, element), before.mean())
    assert torch.equal(objective.flow_loss(pred, target, weights, element),
                       (before.reshape(3, -1).mean(dim=1) * weights).mean())
    off = NS(scheduled_sampling_reflexflow=None)
    assert torch.equal(rollout.loss(off, pred, target, weights, rollout.Rolled(pred, pred), 0, element),
                       (before.reshape(3, -1).mean(dim=1) * weights).mean())


def test_huber_and_smooth_l1_by_hand():
    # one sample per threshold: c = 0.1 and c = 0.5; errors from tiny (quadratic) to large (linear)
    errors = torch.tensor([[0.0, 0.01, 0.3, -2.0], [0.0, 0.01, 0.3, -2.0]])
    c = torch.tensor([0.1, 0.5])
    target = torch.zeros(2, 4)
    huber = objective.Pointwise("huber", c)(errors, target)
    smooth = objective.Pointwise("smooth_l1", c)(errors, target)
    # 2c (sqrt(e^2 + c^2) - c), worked out: e = 0.3, c = 0.1: 0.2 (sqrt(0.1) - 0.1) = 0.0432455532;
    # e = -2, c = 0.5: sqrt(4.25) - 0.5 = 1.5615528128
    assert huber[0, 2].item() == pytest.approx(0.0432455532, rel=1e-6)
    assert huber[1, 3].item() == pytest.approx(1.5615528128, rel=1e-6)
    assert smooth[0, 2].item() == pytest.approx(0.432455532, rel=1e-6)  # the same over c
    assert smooth[1, 3].item() == pytest.approx(3.1231056256, rel=1e-6)
    e, cc = errors.double(), c.double().view(-1, 1)
    by_hand = 2 * cc * (torch.sqrt(e ** 2 + cc ** 2) - cc)
    torch.testing.assert_close(huber.double(), by_hand, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(smooth.double(), by_hand / cc, rtol=1e-6, atol=1e-12)
    # small errors: about the squared error (where c - sqrt(e^2 + c^2) would cancel in float32); large: 2c|e|
    assert huber[1, 1].item() == pytest.approx(1e-4, rel=1e-3) and huber[0, 0].item() == 0.0
    assert huber[0, 3].item() == pytest.approx(2 * 0.1 * 2.0, rel=0.05)
    # flow_loss averages the element loss and weights each sample
    weights = torch.tensor([1.0, 3.0])
    expected = (by_hand.mean(dim=1) * weights.double()).mean()
    got = objective.flow_loss(errors, target, weights, objective.Pointwise("huber", c))
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_huber_c_schedules_by_hand():
    s = torch.tensor([0.0, 0.25, 0.5, 1.0])
    # SimpleTuner's exp(-alpha t), alpha = -ln(c)/1000, at t = 1000 s: c ** s
    exponential = [1.0, 0.1 ** 0.25, 0.1 ** 0.5, 0.1]
    torch.testing.assert_close(objective.huber_c(s, "exponential", 0.1), torch.tensor(exponential))
    # (1 - c) / (1 + sigma)^2 + c with sigma = s / (1 - s): 0.1 + 0.9 (1 - s)^2
    snr = [1.0, 0.1 + 0.9 * 0.5625, 0.325, 0.1]
    torch.testing.assert_close(objective.huber_c(s, "snr", 0.1), torch.tensor(snr))
    ddpm = 0.9 / (1 + 0.25 / 0.75) ** 2 + 0.1  # SimpleTuner's formula at s = 0.25 (noise-to-signal ratio 1/3)
    assert objective.huber_c(s, "snr", 0.1)[1].item() == pytest.approx(ddpm)
    torch.testing.assert_close(objective.huber_c(s, "constant", 0.3), torch.full((4,), 0.3))
    assert objective.pointwise(keys("smooth_l1", "snr"), s).c.tolist() == pytest.approx(snr)
    assert objective.pointwise(keys("l2"), s) is objective.SQUARED


def test_perturbation_decays_linearly_to_zero():
    decaying = keys(input_perturbation=0.1, input_perturbation_steps=100)
    got = [objective.perturbation(decaying, step) for step in (0, 25, 50, 99, 100, 500)]
    assert got == pytest.approx([0.1, 0.075, 0.05, 0.001, 0.0, 0.0])
    assert [objective.perturbation(keys(input_perturbation=0.1), step) for step in (0, 10**6)] == [0.1, 0.1]
    assert objective.perturbation(keys(input_perturbation_steps=100), 0) == 0.0


def test_perturbed_noise_is_drawn_for_the_global_batch():
    noise = torch.randn(2, 4, 3, 3)
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    assert objective.perturbed_noise(noise, 0.0, g, 4, 2) is noise  # off: nothing drawn
    assert torch.equal(g.get_state(), state)
    got = objective.perturbed_noise(noise, 0.2, g, 4, 2)
    eps = torch.randn((4, 4, 3, 3), generator=torch.Generator().manual_seed(5))[2:4]
    torch.testing.assert_close(got, noise + 0.2 * eps)


def _fake_run(chance: float):
    """A run whose model predicts the clean velocity noise - x0 (test_tread's pattern)."""
    x0, noise = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    family = NS(predict=lambda model, x, s, text, cond: noise - x0)
    cfg = NS(scheduled_sampling_max_step_offset=3, scheduled_sampling_ramp_steps=0, scheduled_sampling_start_step=0,
             scheduled_sampling_probability=chance, scheduled_sampling_strategy="biased_late",
             validation_num_inference_steps=10)
    accelerator = NS(device=torch.device("cpu"), autocast=nullcontext, unwrap_model=lambda m: m)
    run = NS(cfg=cfg, state=NS(step=0), generator=torch.Generator().manual_seed(1), family=family,
             accelerator=accelerator, comps=NS(transformer=NS(dtype=torch.float32)), transformer=None)
    return run, NS(global_size=3, offset=0, text={}, conditioning=None), x0, noise


def test_rollouts_start_from_the_perturbed_input():
    sigmas = torch.tensor([0.2, 0.5, 0.9])
    run, batch, x0, noise = _fake_run(chance=0.0)
    perturbed = noise + 0.3 * torch.randn_like(noise)
    got = rollout.noisy_input(run, batch, x0, noise, sigmas, 3.0, perturbed)
    assert torch.equal(got.x, objective.noisy_input(x0, perturbed, sigmas))  # the input is perturbed
    assert got.noise is noise  # the target (noise - x0) is not
    run, batch, x0, noise = _fake_run(chance=1.0)  # biased_late: every sample rolled out by 1 to 3 steps
    perturbed = noise + 0.3 * torch.randn_like(noise)
    got = rollout.noisy_input(run, batch, x0, noise, sigmas, 3.0, perturbed)
    assert got.rolled.all()
    s = sigmas.view(-1, 1, 1, 1)
    torch.testing.assert_close((1 - s) * x0 + s * got.noise, got.x)  # the target leads from x~ to x0
    # the clean-velocity model keeps the start's perturbation (s_start times it) down to s, where teacher forcing
    # would have s times it: the drift, measured from the perturbed x_s, is that difference, and points along it
    drift = got.x - objective.noisy_input(x0, perturbed, sigmas)
    torch.testing.assert_close(got.drift, drift)
    along = torch.nn.functional.cosine_similarity(drift.flatten(1), (perturbed - noise).flatten(1), dim=1)
    torch.testing.assert_close(along, torch.ones(3))


def test_reflexflow_weights_the_chosen_element_loss():
    pred, target, rolled = drifted_batch()
    cfg = _reflex_cfg(alpha=1.0, beta1=3.0, beta2=0.7)
    c = torch.tensor([0.1, 0.4, 1.0])
    got = rollout.loss(cfg, pred, target, None, rolled, 0, objective.Pointwise("smooth_l1", c))
    e, cc = (pred - target).double(), c.double().view(-1, 1, 1, 1, 1)
    element = 2 * (torch.sqrt(e ** 2 + cc ** 2) - cc)
    w = torch.full((2, 6, 6), 0.5, dtype=torch.float64)
    w[:, :3] = 1.5  # (1 + |d| / mean|d|) / 2 on the drifted half and the other
    cosine = torch.nn.functional.cosine_similarity(pred[1].flatten(), target[1].flatten(), dim=0).double()
    per_sample = element.flatten(1).mean(dim=1)
    per_sample[1] = 0.7 * (w * element[1]).mean() + 3.0 * (2 - 2 * cosine)
    assert got.item() == pytest.approx(per_sample.mean().item(), rel=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_home):
    root = tmp_path_factory.mktemp("loss-keys")
    make_dataset(root / "images", count=2)
    run = build_run(load_config(write_config(root, root / "images", train_batch_size=2, max_train_steps=2)))
    return run, next(iter(run.data))


def _replay(run, batch, state, strength: float, schedule: str | None, c0: float, kind: str) -> torch.Tensor:
    """micro_step's loss computed again by hand (float64), from the generator's `state` before it."""
    g = run.generator
    g.set_state(state)
    x0, n, lo = batch.latents, batch.latents.shape[0], batch.offset
    size = max(batch.global_size, n)
    noise = torch.randn((size, *x0.shape[1:]), generator=g)[lo : lo + n]
    sigmas = objective.sample_sigmas(size, run.cfg.flow_schedule_shift, g, run.sampling)[lo : lo + n]
    if strength:
        noise_in = noise + strength * torch.randn((size, *x0.shape[1:]), generator=g)[lo : lo + n]
    else:
        noise_in = noise
    s = sigmas.view(-1, 1, 1, 1)
    pred = run.family.predict(run.transformer, (1 - s) * x0 + s * noise_in, sigmas, batch.text, None)
    target = noise - x0  # the target keeps the clean noise
    if kind == "l2":  # in float32, as the loss was written before loss_type existed
        return ((pred.float() - target.float()) ** 2).mean()
    error = (pred - target).double()
    t = sigmas.double()
    c = {"snr": c0 + (1 - c0) * (1 - t) ** 2, "exponential": c0 ** t, "constant": torch.full_like(t, c0)}[schedule]
    c = c.view(-1, 1, 1, 1)
    huber = 2 * c * (torch.sqrt(error ** 2 + c ** 2) - c)
    return (huber if kind == "huber" else huber / c).mean()


@pytest.mark.parametrize("kind,schedule,c0", [("huber", "snr", 0.1), ("smooth_l1", "exponential", 0.3),
                                              ("huber", "constant", 0.05)])
def test_micro_step_takes_the_loss_type(tiny, kind, schedule, c0):
    run, batch = tiny
    run.cfg.loss_type, run.cfg.huber_schedule, run.cfg.huber_c = "l2", schedule, c0
    state = run.generator.get_state()
    with torch.no_grad():
        l2 = micro_step(run, batch)
        assert torch.equal(l2, _replay(run, batch, state, 0.0, None, c0, "l2"))  # today's loss, bit for bit
        run.cfg.loss_type = kind
        run.generator.set_state(state)
        got = micro_step(run, batch)
        expected = _replay(run, batch, state, 0.0, schedule, c0, kind)
    run.cfg.loss_type = "l2"
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert abs(got.item() - l2.item()) > 1e-3 * l2.item()  # the key acts


def test_micro_step_perturbs_the_input_only(tiny):
    run, batch = tiny
    batch = replace(batch, global_size=5, offset=2)  # this process's slice of a bigger global batch
    state = run.generator.get_state()
    with torch.no_grad():
        run.cfg.input_perturbation, run.cfg.input_perturbation_steps = 0.0, 10
        plain = micro_step(run, batch)
        after = run.generator.get_state()
        expected = _replay(run, batch, state, 0.0, None, 0.1, "l2")
        assert torch.equal(plain, expected)  # 0: today's loss, bit for bit, and nothing more drawn
        assert torch.equal(run.generator.get_state(), after)
        run.cfg.input_perturbation, run.state.step = 0.2, 3  # 0.2 decaying over 10 steps: 0.14 at step 3
        run.generator.set_state(state)
        got = micro_step(run, batch)
        expected = _replay(run, batch, state, 0.14, None, 0.1, "l2")
    run.cfg.input_perturbation, run.cfg.input_perturbation_steps, run.state.step = 0.0, 0, 0
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert abs(got.item() - plain.item()) > 1e-4 * plain.item()


def test_resume_is_exact_with_huber_and_perturbation(tmp_path, monkeypatch):
    images = tmp_path / "images"
    make_dataset(images, count=4)
    common = dict(max_train_steps=4, checkpoint_step_interval=2, train_batch_size=2, resume_from_checkpoint="latest",
                  loss_type="huber", huber_schedule="snr", huber_c=0.2, input_perturbation=0.1,
                  input_perturbation_steps=3)
    train(build_run(load_config(write_config(tmp_path / "a", images, **common))))
    train_losses = losses(tmp_path / "a" / "output")
    assert all(math.isfinite(v) for v in train_losses.values()) and len(train_losses) == 4
    cut = write_config(tmp_path / "b", images, **common)
    crash_then_resume(monkeypatch, cut, at_step=3)  # dies after step 3, resumes from the checkpoint of step 2
    assert losses(tmp_path / "b" / "output") == train_losses
