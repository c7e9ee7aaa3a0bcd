"""lr_end, lr_power and lr_num_cycles (config/schedule_keys.py, train/lr_schedule.py): the config accepts them for
the schedules that use them and refuses them, naming both keys, for the others (SimpleTuner's defaults: a note); the curves equal hand-computed
values (warm-up, end value, cycles, power 2); without them every schedule is diffusers' own; a resumed run
continues the same curve."""

import io
import json
import math

import pytest
import torch
from diffusers.optimization import get_scheduler

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.config.schema import LR_SCHEDULERS, TrainConfig
from difftune.train.lr_schedule import build_lr_scheduler
from test_train import crash_then_resume


def config(**keys) -> TrainConfig:
    return TrainConfig(model_family="lumina2", max_train_steps=10, **({"learning_rate": 1.0} | keys))


def rates(cfg: TrainConfig, total: int, steps: int | None = None) -> list[float]:
    """The learning rate at steps 0..steps (default: total + 2) of a scheduler built as build_run builds it."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.learning_rate)
    return walk(optimizer, build_lr_scheduler(cfg, optimizer, total), total + 2 if steps is None else steps)


def walk(optimizer, scheduler, steps: int) -> list[float]:
    """The scheduler's rate now and after each of `steps` optimizer steps."""
    out = [scheduler.get_last_lr()[0]]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        out.append(scheduler.get_last_lr()[0])
    return out


def cosine(p: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * p))


def test_keys_validate_with_the_schedules_that_use_them(tmp_path, dataset):
    # SimpleTuner's spellings: lr_end as a string (its UI default "4e-7"), null for the others' defaults
    cfg = load_config(write_config(tmp_path, dataset, lr_scheduler="polynomial", lr_end="4e-7", lr_power=None,
                                   lr_num_cycles=None)).train
    assert (cfg.lr_end, cfg.lr_power, cfg.lr_num_cycles) == (4e-7, 1.0, 1)
    cfg = load_config(write_config(tmp_path, dataset, lr_scheduler="cosine_with_restarts", lr_num_cycles="3",
                                   lr_end=1e-5)).train
    assert (cfg.lr_num_cycles, cfg.lr_end) == (3, 1e-5)
    assert config(lr_scheduler="polynomial", lr_power=2.0).lr_power == 2.0
    assert config(lr_scheduler="cosine", lr_end=0.1).lr_end == 0.1
    # a key the chosen schedule would ignore is refused, naming both keys and the fix
    for keys, named in [({"lr_end": 1e-6}, "lr_end"), ({"lr_scheduler": "linear", "lr_end": 1e-6}, "lr_end"),
                        ({"lr_scheduler": "cosine", "lr_power": 2}, "lr_power"),
                        ({"lr_scheduler": "constant_with_warmup", "lr_power": 0.5}, "lr_power"),
                        ({"lr_scheduler": "cosine", "lr_num_cycles": 3}, "lr_num_cycles"),
                        ({"lr_scheduler": "polynomial", "lr_num_cycles": 2}, "lr_num_cycles")]:
        text = problems(tmp_path, dataset, **keys)
        assert named in text and "lr_scheduler" in text and repr(keys.get("lr_scheduler", "constant")) in text
    # SimpleTuner's defaults, which its configure tool writes whatever the schedule, are one note
    notes = load_config(write_config(tmp_path, dataset, lr_scheduler="constant_with_warmup", lr_end="4e-07",
                                     lr_power=0.8, learning_rate=1e-7)).notes()
    assert [n for n in notes if n.startswith("lr_end 4e-07 and lr_power 0.8 not used: lr_scheduler "
                                             "'constant_with_warmup'")]
    assert not [n for n in load_config(write_config(tmp_path, dataset, lr_scheduler="polynomial", lr_end=4e-7,
                                                    lr_power=0.8)).notes() if "not used" in n and "lr_" in n]
    assert "must be below learning_rate" in problems(tmp_path, dataset, lr_scheduler="cosine", lr_end=1e-3)
    assert "lr_end" in problems(tmp_path, dataset, lr_scheduler="polynomial", learning_rate=1e-8)
    for bad in ({"lr_scheduler": "polynomial", "lr_power": 0}, {"lr_scheduler": "cosine_with_restarts",
                                                                "lr_num_cycles": 0},
                {"lr_scheduler": "cosine", "lr_end": -1e-5}):
        assert next(iter(set(bad) - {"lr_scheduler"})) in problems(tmp_path, dataset, **bad)


def problems(tmp_path, dataset, **keys) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, **keys))
    return "\n".join(info.value.problems)


def test_polynomial_warm_up_power_2_and_end_value():
    # warm-up 2 steps to 1.0, then (1 - 0.1)·(1 - p)² + 0.1 over the 8 steps left, then 0.1
    got = rates(config(lr_scheduler="polynomial", lr_warmup_steps=2, lr_end=0.1, lr_power=2.0), total=10)
    want = [0.0, 0.5] + [0.1 + 0.9 * (1 - k / 8) ** 2 for k in range(9)] + [0.1, 0.1]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[6] == pytest.approx(0.325)  # halfway: 0.1 + 0.9·0.25; linear (power 1) would be 0.55
    linear = rates(config(lr_scheduler="polynomial", lr_warmup_steps=2, lr_end=0.1), total=10)
    assert linear[6] == pytest.approx(0.55)
    # unset, lr_end is diffusers' 1e-7
    assert rates(config(lr_scheduler="polynomial"), total=4)[4] == pytest.approx(1e-7)


def test_cosine_falls_to_lr_end():
    got = rates(config(lr_scheduler="cosine", lr_end=0.2), total=4)
    assert got == pytest.approx([1.0, 0.2 + 0.8 * cosine(0.25), 0.6, 0.2 + 0.8 * cosine(0.75), 0.2, 0.2, 0.2])
    # the warm-up still rises from 0; the cosine starts after it
    warm = rates(config(lr_scheduler="cosine", lr_end=0.2, lr_warmup_steps=2), total=6)
    assert warm[:5] == pytest.approx([0.0, 0.5, 1.0, 0.2 + 0.8 * cosine(0.25), 0.6])
    # lr_end 0 is exactly diffusers' cosine
    assert rates(config(lr_scheduler="cosine", lr_end=0.0, lr_warmup_steps=3), total=20, steps=20) == \
        pytest.approx(diffusers_rates("cosine", warmup=3, total=20, steps=20), abs=1e-12)


def test_cosine_with_restarts_cycles():
    # 8 steps after a 2-step warm-up, in 2 cycles of 4: each restarts at 1.0 and falls to lr_end 0.1
    got = rates(config(lr_scheduler="cosine_with_restarts", lr_num_cycles=2, lr_warmup_steps=2, lr_end=0.1),
                total=10)
    fall = [0.1 + 0.9 * cosine(k / 4) for k in range(4)]
    assert got == pytest.approx([0.0, 0.5] + fall + fall + [0.1, 0.1, 0.1])
    assert got[6] == 1.0  # the restart (one cycle would be at its middle: 0.55)
    # without lr_end: diffusers' hard restarts, down to 0
    plain = rates(config(lr_scheduler="cosine_with_restarts", lr_num_cycles=2, lr_warmup_steps=2), total=10)
    assert plain == pytest.approx([0.0, 0.5] + [cosine(k / 4) for k in range(4)] * 2 + [0.0] * 3, abs=1e-12)
    assert plain == pytest.approx(diffusers_rates("cosine_with_restarts", 2, 10, cycles=2), abs=1e-12)


def diffusers_rates(name: str, warmup: int, total: int, cycles: int = 1, steps: int | None = None) -> list[float]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total, num_cycles=cycles)
    return walk(optimizer, scheduler, total + 2 if steps is None else steps)


@pytest.mark.parametrize("name", [n for n in LR_SCHEDULERS if n != "sine"])  # sine: SimpleTuner's, below
def test_without_the_keys_each_schedule_is_diffusers_own(name):
    # diffusers' 'constant' drops a warm-up; difftune's warms up (test_constant_with_a_warmup_warms_up)
    same = "constant_with_warmup" if name == "constant" else name
    assert rates(config(lr_scheduler=name, lr_warmup_steps=3), total=12) == diffusers_rates(same, 3, 12)


@pytest.mark.parametrize("keys", [{"lr_scheduler": "polynomial", "lr_end": 0.05, "lr_power": 2.0},
                                  {"lr_scheduler": "cosine", "lr_end": 0.05},
                                  {"lr_scheduler": "cosine_with_restarts", "lr_end": 0.05, "lr_num_cycles": 3},
                                  {"lr_scheduler": "sine", "lr_end": 0.05}],
                         ids=lambda k: k["lr_scheduler"])
def test_a_restored_scheduler_continues_the_curve(keys):
    """What a resume does (train/checkpoint.py): the state_dict through torch.save / torch.load(weights_only),
    into a scheduler built afresh from the config."""
    cfg = config(lr_warmup_steps=2, **keys)
    whole = rates(cfg, total=12)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    first = build_lr_scheduler(cfg, optimizer, 12)
    for _ in range(5):
        optimizer.step()
        first.step()
    saved = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "lr_scheduler": first.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.learning_rate)  # as build_run does
    second = build_lr_scheduler(cfg, optimizer, 12)
    optimizer.load_state_dict(state["optimizer"])
    second.load_state_dict(state["lr_scheduler"])
    later = []
    for _ in range(9):
        optimizer.step()
        second.step()
        later.append(second.get_last_lr()[0])
    assert later == pytest.approx(whole[6:], abs=1e-12)


def test_training_follows_the_curve_across_a_resume(tmp_path, dataset, monkeypatch):
    """A real tiny run: polynomial to lr_end with power 2; it dies after step 3 and resumes from the step-2
    checkpoint. Every logged rate (both processes') is the hand-computed one."""
    path = write_config(tmp_path, dataset, lr_scheduler="polynomial", lr_warmup_steps=1, lr_end=1e-4, lr_power=2,
                        learning_rate=1e-3, max_train_steps=5, checkpoint_step_interval=2,
                        resume_from_checkpoint="latest")
    crash_then_resume(monkeypatch, path, at_step=3)
    events = [json.loads(line) for line in (tmp_path / "output" / "events.jsonl").read_text().splitlines()]
    logged = [(e["step"], e["lr"]) for e in events if e["event"] == "step"]
    assert [step for step, _ in logged] == [1, 2, 3, 3, 4, 5]  # steps 1-3, then 3-5 again from the step-2 checkpoint
    # the rate each step trained with, the one after step - 1 steps: 0 for step 1 (the warm-up's start), then
    # (1e-3 - 1e-4)·(1 - (step - 2)/4)² + 1e-4
    for step, lr in logged:
        assert lr == pytest.approx(0.0 if step == 1 else 1e-4 + 9e-4 * (1 - (step - 2) / 4) ** 2, rel=1e-6), step


def test_constant_with_a_warmup_warms_up():
    """diffusers' 'constant' has no warm-up: lr_warmup_steps with it must not be dropped, and without one it stays
    diffusers' constant."""
    assert rates(config(lr_scheduler="constant", lr_warmup_steps=4), 10) == [0.0, 0.25, 0.5, 0.75] + [1.0] * 9
    assert rates(config(lr_scheduler="constant"), 10) == [1.0] * 13


def test_a_warmup_longer_than_the_run_is_a_warning(tmp_path, dataset):
    """lr_warmup_steps 20 in a 3-step run: the rate never reaches learning_rate and the cosine never starts."""
    from difftune.train.setup import build_run

    run = build_run(load_config(write_config(tmp_path, dataset, lr_scheduler="cosine", lr_warmup_steps=20,
                                             max_train_steps=3)))
    events = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
    warned = [e["message"] for e in events if e["event"] == "warning" and "lr_warmup_steps" in e["message"]]
    assert warned == ["lr_warmup_steps 20 is longer than the run (3 steps): the learning rate never reaches "
                      "learning_rate and lr_scheduler 'cosine' never starts; lower lr_warmup_steps (e.g. to 1)"]
    run = build_run(load_config(write_config(tmp_path / "fits", dataset, lr_warmup_steps=3, max_train_steps=3)))
    assert "lr_warmup_steps" not in (run.output_dir / "events.jsonl").read_text()


def test_sine_is_simpletuners_wave():
    """lr_end + (learning_rate - lr_end)(1 + sin(pi k / W)) / 2, W = lr_warmup_steps: half-way at 0, the peak at W / 2,
    lr_end at 1.5 W, and on in waves; no warm-up from 0."""
    got = rates(config(lr_scheduler="sine", lr_warmup_steps=4, lr_end=0.2), total=12)
    assert got == pytest.approx([0.2 + 0.8 * 0.5 * (1 + math.sin(math.pi * k / 4)) for k in range(15)])
    assert got[0] == pytest.approx(0.6) and got[2] == pytest.approx(1.0) and got[6] == pytest.approx(0.2)
    assert rates(config(lr_scheduler="sine", lr_warmup_steps=4), total=8)[6] == pytest.approx(0.0, abs=1e-12)


def test_sine_needs_lr_warmup_steps(tmp_path, dataset):
    with pytest.raises(ConfigError, match="lr_scheduler 'sine' takes half its wave's period from lr_warmup_steps"):
        load_config(write_config(tmp_path, dataset, lr_scheduler="sine"))
    cfg = load_config(write_config(tmp_path, dataset, lr_scheduler="sine", lr_warmup_steps=500, lr_end=4e-7)).train
    assert cfg.lr_scheduler == "sine" and cfg.lr_end == 4e-7  # SimpleTuner's written default: the wave's bottom
