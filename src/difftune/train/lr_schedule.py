"""The learning-rate schedule of a run: `build_lr_scheduler(cfg, optimizer, total_steps)`.

Every schedule starts with `lr_warmup_steps` of linear warm-up from 0 to learning_rate, then, for the T - W steps after warm-up (T: the run's optimizer steps, W: warm-up; p goes from 0 to 1 over them):
- 'polynomial': diffusers' polynomial decay, lr_end + (learning_rate - lr_end) * (1 - p) ** lr_power, then lr_end
  (lr_end unset: 1e-7, diffusers' default);
- 'cosine': diffusers' half cosine, learning_rate * (1 + cos(pi * p)) / 2;
- 'cosine_with_restarts': diffusers' lr_num_cycles cosines, each restarting at learning_rate:
  learning_rate * (1 + cos(pi * (lr_num_cycles * p mod 1))) / 2, and 0 after the last step;
- 'sine': SimpleTuner's waves, with no warm-up: lr_warmup_steps W is half the period, and at step k the rate is
  lr_end + (learning_rate - lr_end) * (1 + sin(pi * k / W)) / 2: half-way up at the start, learning_rate at W / 2,
  half-way again at W, lr_end (unset: 0) at 1.5 W, and so on to the end of the run;
- 'linear', 'constant', 'constant_with_warmup': diffusers' own. diffusers' 'constant' has no warm-up, so with
  lr_warmup_steps it is built as 'constant_with_warmup': the warm-up a user set is never dropped.
With lr_end, the cosines fall to lr_end instead of 0: after warm-up the rate is lr_end + (learning_rate - lr_end) x
the curve above (SimpleTuner's eta_min floor); the warm-up still rises from 0. Without it every schedule is
exactly diffusers' `get_scheduler`, as before these keys existed.

The rate is a pure function of the step: a checkpoint holds the scheduler's step (train/checkpoint.py saves its
state_dict), and a resumed run rebuilds the same function from the config, so it continues the same curve.
config/schedule_keys.py refuses the keys with a schedule that would not use them.

With `optimizer: adamw_schedulefree` the rate is constant after lr_warmup_steps of the schedulefree library's own
warm-up (`schedule_free_warmup`), whether lr_scheduler is 'constant' or 'constant_with_warmup' (the only two it
takes): its averaging does what a decaying schedule would.

`lr_scale` (and `lr_scale_sqrt`) scale learning_rate by the samples of one optimizer step (train_batch_size x
gradient_accumulation_steps x processes, or its square root), SimpleTuner's rule: `learning_rate(cfg, processes)` is
the rate the optimizer is built with, and the schedule runs from it (warm-up to it, lr_end's floor below it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from diffusers.optimization import get_polynomial_decay_schedule_with_warmup, get_scheduler
from torch.optim.lr_scheduler import LambdaLR

from difftune.config.schedule_keys import POLYNOMIAL_DEFAULT_END


def learning_rate(cfg: Any, processes: int, emit: Callable[..., None] | None = None) -> float:
    """The peak rate that trains: learning_rate, times the step's samples with lr_scale (their square root with
    lr_scale_sqrt). `emit` (the run's events) is told the scaled rate, once."""
    if not cfg.lr_scale:
        return cfg.learning_rate
    samples = cfg.train_batch_size * cfg.gradient_accumulation_steps * processes
    factor = math.sqrt(samples) if cfg.lr_scale_sqrt else float(samples)
    rate = cfg.learning_rate * factor
    if emit is not None:
        how = f"sqrt({samples})" if cfg.lr_scale_sqrt else str(samples)
        emit("info", message=f"lr_scale{' and lr_scale_sqrt' if cfg.lr_scale_sqrt else ''}: learning rate "
                             f"{cfg.learning_rate:g} x {how} (train_batch_size {cfg.train_batch_size} x "
                             f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} x {processes} "
                             f"process{'es' if processes > 1 else ''}) = {rate:g} trains", learning_rate=rate)
    return rate


def build_lr_scheduler(cfg: Any, optimizer: Any, total_steps: int, rate: float | None = None) -> LambdaLR:
    """The schedule of a peak rate `rate` (default learning_rate; `learning_rate(cfg, ...)` with lr_scale)."""
    name, warmup = cfg.lr_scheduler, cfg.lr_warmup_steps
    if cfg.optimizer == "adamw_schedulefree":  # constant (config/optimizer_keys.py), with the library's warm-up
        return LambdaLR(optimizer, schedule_free_warmup(warmup))
    peak = cfg.learning_rate if rate is None else rate
    if name == "constant" and warmup:  # diffusers' 'constant' would ignore the warm-up
        name = "constant_with_warmup"
    if name == "polynomial":
        end = POLYNOMIAL_DEFAULT_END if cfg.lr_end is None else cfg.lr_end
        return get_polynomial_decay_schedule_with_warmup(optimizer, warmup, total_steps, lr_end=end,
                                                         power=cfg.lr_power)
    if name == "sine":
        return LambdaLR(optimizer, sine_waves(warmup, (cfg.lr_end or 0.0) / peak))
    if cfg.lr_end is not None and name in ("cosine", "cosine_with_restarts"):
        cycles = cfg.lr_num_cycles if name == "cosine_with_restarts" else None
        return LambdaLR(optimizer, floored_cosine(warmup, total_steps, cfg.lr_end / peak, cycles))
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                         num_cycles=cfg.lr_num_cycles)


def warmup_too_long(cfg: Any, total_steps: int) -> str | None:
    """A warning when lr_warmup_steps outlasts the run: the rate never reaches learning_rate and the schedule never
    starts (easy to get after shortening a run, or with num_train_epochs deciding its length)."""
    if cfg.lr_warmup_steps <= total_steps or cfg.lr_scheduler == "sine":  # sine: its wave's length, no warm-up
        return None
    return (f"lr_warmup_steps {cfg.lr_warmup_steps} is longer than the run ({total_steps} steps): the learning rate "
            f"never reaches learning_rate and lr_scheduler {cfg.lr_scheduler!r} never starts; lower lr_warmup_steps "
            f"(e.g. to {max(1, total_steps // 10)})")


def schedule_free_warmup(warmup: int) -> Callable[[int], float]:
    """adamw_schedulefree's multiplier of learning_rate: the schedulefree library's own warm-up, (k + 1) / warmup at
    step k < warmup (from 0), then 1. Applied here instead of through its `warmup_steps`, the numbers are the same
    and the logged rate is the one that trains."""
    return lambda step: (step + 1) / warmup if step < warmup else 1.0


def sine_waves(half_period: int, floor: float) -> Callable[[int], float]:
    """'sine': the multiplier of learning_rate at step k, floor + (1 - floor) (1 + sin(pi k / half_period)) / 2."""
    return lambda step: floor + (1.0 - floor) * 0.5 * (1.0 + math.sin(math.pi * step / half_period))


def floored_cosine(warmup: int, total: int, floor: float, cycles: int | None) -> Callable[[int], float]:
    """The multiplier of learning_rate at each step: linear warm-up, then a cosine from 1 down to `floor` (a half
    cosine when `cycles` is None, else `cycles` of them, each restarting at 1), and `floor` after `total` steps."""

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        if progress >= 1.0:
            return floor
        phase = progress if cycles is None else (cycles * progress) % 1.0
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * phase))

    return factor
