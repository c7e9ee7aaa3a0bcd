"""SimpleTuner's smaller training keys (config/extra_train_keys.py): lr_scale / lr_scale_sqrt scale the rate that
trains, ignore_final_epochs lets max_train_steps alone end a run, and the noise-level schedules
(flow_use_uniform_schedule, flow_use_beta_schedule, flow_custom_timesteps) draw what they say, from the run's
generator, so that a resume repeats them. Each is refused, naming the key and the fix, where it would do nothing."""

import json
import math

import pytest
import torch

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.config.schema import TrainConfig
from difftune.train import noise_levels, objective
from difftune.train.loop import train
from difftune.train.lr_schedule import build_lr_scheduler
from difftune.train.objective import TimestepSampling, sample_sigmas, shift_sigmas
from difftune.train.setup import build_run, total_steps
from test_train import crash_then_resume, losses


def events(output) -> list[dict]:
    return [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()]


def problems(tmp_path, dataset, **keys) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, **keys))
    return "\n".join(info.value.problems)


def config(**keys) -> TrainConfig:
    return TrainConfig(model_family="lumina2", max_train_steps=10, **keys)


# --- lr_scale, lr_scale_sqrt


@pytest.mark.parametrize("keys, factor", [({}, 1.0), ({"lr_scale": True}, 4.0),
                                          ({"lr_scale": True, "lr_scale_sqrt": True}, 2.0)])
def test_lr_scale_sets_the_rate_of_every_step(tmp_path, dataset, keys, factor):
    """Batch 2 x accumulation 2 x 1 process: the steps train at 4x learning_rate (2x with the square root), and an
    info event says so once; off, the rate is learning_rate itself."""
    run = build_run(load_config(write_config(tmp_path, dataset, train_batch_size=2, gradient_accumulation_steps=2,
                                             max_train_steps=2, learning_rate=1e-3, **keys)))
    train(run)
    log = events(run.output_dir)
    assert [e["lr"] for e in log if e["event"] == "step"] == [pytest.approx(1e-3 * factor, rel=1e-12)] * 2
    said = [e for e in log if e["event"] == "info" and e["message"].startswith("lr_scale")]
    if not keys:
        assert not said
        return
    (info,) = said
    assert info["learning_rate"] == pytest.approx(1e-3 * factor)
    assert "train_batch_size 2 x gradient_accumulation_steps 2 x 1 process" in info["message"]
    assert ("sqrt(4)" if factor == 2.0 else "x 4 ") in info["message"]


def test_the_schedule_runs_from_the_scaled_rate():
    """A cosine with lr_end falls from the scaled rate to lr_end (the floor is taken against the rate that trains)."""
    cfg = config(lr_scheduler="cosine", lr_end=0.1, learning_rate=1.0, lr_scale=True)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=4.0)
    scheduler = build_lr_scheduler(cfg, optimizer, 4, rate=4.0)
    seen = []
    for _ in range(5):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert seen[0] == pytest.approx(4.0) and seen[2] == pytest.approx(0.1 + 3.9 * 0.5) and seen[4] == pytest.approx(0.1)


# --- ignore_final_epochs


def test_ignore_final_epochs_lets_max_train_steps_decide(tmp_path, dataset):
    assert total_steps(config(num_train_epochs=1), batches_per_epoch=4) == 4  # the epoch ends the run first
    assert total_steps(config(num_train_epochs=1, ignore_final_epochs=True), batches_per_epoch=4) == 10
    run = build_run(load_config(write_config(tmp_path, dataset, num_train_epochs=1, max_train_steps=6,
                                             ignore_final_epochs=True)))
    train(run)
    assert sorted(losses(run.output_dir)) == [1, 2, 3, 4, 5, 6]  # 4 images a epoch, 6 steps all the same


# --- the noise-level schedules


def ks_distance(draws: torch.Tensor, cdf) -> float:
    x = draws.double().sort().values
    n = x.numel()
    ranks = torch.arange(1, n + 1, dtype=torch.float64) / n
    return float(torch.maximum((ranks - cdf(x)).abs(), (ranks - 1 / n - cdf(x)).abs()).max())


@pytest.mark.parametrize("alpha, beta, cdf", [
    (2.0, 2.0, lambda x: 3 * x ** 2 - 2 * x ** 3),
    (0.5, 0.5, lambda x: 2 / math.pi * torch.asin(torch.sqrt(x))),
    (2.0, 5.0, None), (0.1, 3.0, None), (30.0, 10.0, None),
])
def test_beta_draws_follow_the_distribution(alpha, beta, cdf):
    g = torch.Generator().manual_seed(0)
    x = noise_levels.beta_draws(200_000, alpha, beta, g)
    assert x.dtype == torch.float32 and bool(((x >= 0) & (x <= 1)).all())
    mean, var = alpha / (alpha + beta), alpha * beta / ((alpha + beta) ** 2 * (alpha + beta + 1))
    assert float(x.mean()) == pytest.approx(mean, abs=4 * math.sqrt(var / x.numel()))
    assert float(x.var()) == pytest.approx(var, rel=0.02)
    if cdf is not None:  # Kolmogorov-Smirnov against the exact CDF; 1.63/sqrt(n) is its 1% critical value
        assert ks_distance(x, cdf) < 1.63 / math.sqrt(x.numel())
    again = noise_levels.beta_draws(200_000, alpha, beta, torch.Generator().manual_seed(0))
    assert torch.equal(x, again)  # a function of the generator's state only


def test_sampling_follows_the_keys():
    default = TimestepSampling.of(config())
    assert default == TimestepSampling("logit_normal", 0.0, 1.0, 1.29)  # as before these keys existed
    assert TimestepSampling.of(config(flow_use_uniform_schedule=True)).distribution == "uniform"
    beta = TimestepSampling.of(config(flow_use_beta_schedule=True, flow_beta_schedule_alpha=3.0))
    assert (beta.distribution, beta.beta_alpha, beta.beta_beta) == ("beta", 3.0, 2.0)
    # the beta draw is shifted like the others
    g = torch.Generator().manual_seed(1)
    state = g.get_state()
    got = sample_sigmas(64, 3.0, g, beta)
    g.set_state(state)
    assert torch.equal(got, shift_sigmas(noise_levels.beta_draws(64, 3.0, 2.0, g), 3.0))
    # a fixed list: timesteps of 0..1000 (or sigmas), each drawn about as often, never shifted
    for given in ("1000, 500,20", [1.0, 0.5, 0.02]):
        listed = TimestepSampling.of(config(flow_custom_timesteps=given))
        assert listed.distribution == "list" and listed.levels == (1.0, 0.5, 0.02)
    drawn = sample_sigmas(30_000, 3.0, torch.Generator().manual_seed(2), listed)
    values, counts = torch.unique(drawn, return_counts=True)
    assert values.tolist() == pytest.approx([0.02, 0.5, 1.0])
    assert (counts.double() / 30_000 - 1 / 3).abs().max() < 0.015


RESUMED = dict(max_train_steps=4, checkpoint_step_interval=2, train_batch_size=2, resume_from_checkpoint="latest")


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory, tiny_home):
    """The losses of RESUMED with the default schedule (logit-normal)."""
    from difftune.demo import make_dataset

    root = tmp_path_factory.mktemp("plain-schedule")
    make_dataset(root / "images", count=4)
    train(build_run(load_config(write_config(root, root / "images", **RESUMED))))
    return root / "images", losses(root / "output")


@pytest.mark.parametrize("keys", [{"flow_use_beta_schedule": True, "flow_beta_schedule_alpha": 0.7,
                                   "flow_beta_schedule_beta": 1.5},
                                  {"flow_custom_timesteps": "900,600,300"},
                                  {"flow_custom_timesteps": "900,600,300", "flow_timesteps_mode": "round-robin"}])
def test_schedules_resume_exactly(tmp_path, plain_losses, monkeypatch, keys):
    """Dies after step 3, resumes from the step-2 checkpoint: the same losses as an uninterrupted run, which differ
    from the default schedule's (the key acts)."""
    dataset, plain = plain_losses
    common = RESUMED
    train(build_run(load_config(write_config(tmp_path / "a", dataset, **common, **keys))))
    whole = losses(tmp_path / "a" / "output")
    assert len(whole) == 4 and all(math.isfinite(v) for v in whole.values())
    assert whole != plain
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", dataset, **common, **keys), at_step=3)
    assert losses(tmp_path / "b" / "output") == whole


def test_micro_step_trains_at_the_listed_levels(tmp_path, dataset, monkeypatch):
    seen = []
    real = objective.sample_sigmas
    monkeypatch.setattr(objective, "sample_sigmas", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    train(build_run(load_config(write_config(tmp_path, dataset, train_batch_size=2, max_train_steps=3,
                                             flow_custom_timesteps="1000,250"))))
    assert set(torch.cat(seen).tolist()) <= {1.0, 0.25} and len(seen) == 3


# --- the config


def test_simpletuner_spellings_are_accepted(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, lr_scale=None, lr_scale_sqrt=None, ignore_final_epochs=None,
                                   flow_use_uniform_schedule="true", flow_use_beta_schedule=False,
                                   flow_beta_schedule_alpha=2.0, flow_beta_schedule_beta=None,
                                   flow_custom_timesteps="", flow_timesteps_mode="fixed-list")).train
    assert (cfg.lr_scale, cfg.ignore_final_epochs, cfg.timestep_sampling, cfg.flow_custom_timesteps) == (
        False, False, "uniform", None)


@pytest.mark.parametrize("keys, named", [
    ({"lr_scale_sqrt": True}, ["lr_scale_sqrt", "set lr_scale to true"]),
    ({"ignore_final_epochs": True, "max_train_steps": 0, "num_train_epochs": 2}, ["ignore_final_epochs",
                                                                                  "max_train_steps"]),
    ({"flow_use_uniform_schedule": True, "timestep_sampling": "mode"}, ["flow_use_uniform_schedule", "'mode'"]),
    ({"flow_beta_schedule_beta": 4.0}, ["flow_beta_schedule_beta", "flow_use_beta_schedule to true"]),
    ({"flow_use_beta_schedule": True, "flow_use_uniform_schedule": True}, ["flow_use_beta_schedule",
                                                                           "remove flow_use_uniform_schedule"]),
    ({"flow_use_beta_schedule": True, "timestep_sampling": "logit_normal"}, ["remove timestep_sampling"]),
    ({"flow_use_beta_schedule": True, "flow_sigmoid_scale": 2.0}, ["logit_std (flow_sigmoid_scale)"]),
    ({"flow_custom_timesteps": "500", "flow_schedule_shift": 3}, ["flow_custom_timesteps", "remove flow_schedule_shift"]),
    ({"flow_custom_timesteps": "500", "flow_schedule_auto_shift": True}, ["flow_schedule_auto_shift"]),
    ({"flow_custom_timesteps": "500", "flow_use_beta_schedule": True}, ["remove flow_use_beta_schedule"]),
    ({"flow_custom_timesteps": "500,1001"}, ["flow_custom_timesteps holds 1001"]),
    ({"flow_custom_timesteps": "a,b"}, ["flow_custom_timesteps"]),
    ({"flow_use_beta_schedule": True, "flow_beta_schedule_alpha": 0}, ["flow_beta_schedule_alpha"]),
    ({"flow_timesteps_mode": "round-robin"}, ["flow_timesteps_mode 'round-robin'", "set flow_custom_timesteps"]),
    ({"flow_custom_timesteps": "500", "flow_timesteps_mode": "cyclic"}, ["flow_timesteps_mode"]),
])
def test_misuse_is_a_config_error(tmp_path, dataset, keys, named):
    text = problems(tmp_path, dataset, **keys)
    for words in named:
        assert words in text, text
