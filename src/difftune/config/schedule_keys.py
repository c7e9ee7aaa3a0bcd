"""The learning-rate schedule's settings beyond `lr_scheduler` and `lr_warmup_steps` (`lr_end`, `lr_power`,
`lr_num_cycles`; the schedules are built in train/lr_schedule.py): the fields, mixed into TrainConfig, and their
cross-key checks, this mixin's validator. Import-light: no torch.

SimpleTuner's names. What each acts on follows SimpleTuner: `lr_end` is the end of its polynomial schedule and the
floor (eta_min) of its cosine and sine ones, `lr_power` the polynomial's power, `lr_num_cycles` the hard restarts of
'cosine_with_restarts'. A setting for a schedule it does nothing for is refused, naming both keys, except at
SimpleTuner's own defaults (lr_end 4e-7, lr_power 0.8), which its configure tool writes into every config whatever
the schedule: those are notes. Defaults that differ from SimpleTuner's are said in the descriptions.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, field_validator, model_validator

from difftune.config.fields import default_if_unset, field

# lr_scheduler values each key acts on
LR_END_SCHEDULERS = ("polynomial", "cosine", "cosine_with_restarts", "sine")
LR_POWER_SCHEDULERS = ("polynomial",)
LR_CYCLES_SCHEDULERS = ("cosine_with_restarts",)
POLYNOMIAL_DEFAULT_END = 1e-7  # diffusers' get_polynomial_decay_schedule_with_warmup default
SIMPLETUNER_DEFAULTS = {"lr_end": 4e-7, "lr_power": 0.8}  # written by its configure tool for every schedule


class ScheduleKeys(BaseModel):
    lr_end: float | None = field(
        None, "The learning rate the schedule ends at: with lr_scheduler 'polynomial', where the decay lands after "
        "the last step; with 'cosine' and 'cosine_with_restarts', the floor each cosine falls to (after warm-up the "
        "rate is lr_end + (learning_rate - lr_end) x the cosine); with 'sine', the bottom of its waves. Below "
        "learning_rate. Empty: 1e-7 for 'polynomial' (diffusers' default), 0 for the others. (SimpleTuner's default "
        "is 4e-7.)", "training", ge=0,
        advanced=True,
    )
    lr_power: float = field(
        1.0, "With lr_scheduler 'polynomial': the power of the decay from learning_rate to lr_end (1: linear; 2: "
        "stays high longer, then falls faster). Default 1 (diffusers'; SimpleTuner's is 0.8).", "training", gt=0,
        advanced=True,
    )
    lr_num_cycles: int = field(
        1, "With lr_scheduler 'cosine_with_restarts': how many cosine cycles (each restarting at learning_rate) "
        "fill the steps after warm-up.", "training", ge=1, advanced=True,
    )

    @field_validator("lr_power", "lr_num_cycles", mode="before")
    @classmethod
    def _schedule_null_is_default(cls, value: Any, info: Any) -> Any:
        """SimpleTuner configs may write null for these: it means the default."""
        return default_if_unset(cls, value, info.field_name)

    @model_validator(mode="after")
    def _schedule_checks(self) -> ScheduleKeys:
        schedule_checks(self)
        return self


def schedule_checks(cfg: Any) -> None:
    """Raise ValueError for a schedule setting that the chosen lr_scheduler would not use, naming both keys."""
    name = cfg.lr_scheduler
    if cfg.lr_end is not None and name not in LR_END_SCHEDULERS and cfg.lr_end != SIMPLETUNER_DEFAULTS["lr_end"]:
        raise ValueError(f"lr_end applies to lr_scheduler {', '.join(map(repr, LR_END_SCHEDULERS))}; lr_scheduler "
                         f"{name!r} would ignore it: remove lr_end, or use lr_scheduler 'polynomial' (with lr_power "
                         "1 it decays linearly to lr_end)")
    if cfg.lr_power not in (1, SIMPLETUNER_DEFAULTS["lr_power"]) and name not in LR_POWER_SCHEDULERS:
        raise ValueError(f"lr_power {cfg.lr_power:g} applies to lr_scheduler 'polynomial' only; lr_scheduler {name!r} "
                         "would ignore it: remove lr_power (or set it to 1), or use lr_scheduler 'polynomial'")
    if cfg.lr_num_cycles != 1 and name not in LR_CYCLES_SCHEDULERS:
        raise ValueError(f"lr_num_cycles {cfg.lr_num_cycles} applies to lr_scheduler 'cosine_with_restarts' only; "
                         f"lr_scheduler {name!r} would ignore it: remove lr_num_cycles (or set it to 1), or use "
                         "lr_scheduler 'cosine_with_restarts'")
    if cfg.lr_end is not None and name in LR_END_SCHEDULERS and cfg.lr_end >= cfg.learning_rate:
        raise ValueError(f"lr_end {cfg.lr_end:g} must be below learning_rate {cfg.learning_rate:g} (the schedule "
                         "decays from learning_rate to lr_end)")
    if name == "sine" and cfg.lr_warmup_steps == 0:
        raise ValueError("lr_scheduler 'sine' takes half its wave's period from lr_warmup_steps (SimpleTuner's rule: "
                         "the rate starts half-way up, peaks at learning_rate after lr_warmup_steps / 2 steps and "
                         "is lowest at 1.5 x lr_warmup_steps), and it is 0: set lr_warmup_steps (e.g. 500)")
    if name == "polynomial" and cfg.lr_end is None and POLYNOMIAL_DEFAULT_END >= cfg.learning_rate:
        raise ValueError(f"lr_scheduler 'polynomial' decays to lr_end, 1e-7 when unset, which is not below "
                         f"learning_rate {cfg.learning_rate:g}: set lr_end below learning_rate")


def schedule_notes(cfg: Any) -> list[str]:
    """SimpleTuner's defaults of lr_end and lr_power where the schedule does not use them: its configure tool writes
    them for every schedule, so they are said, not refused (any other value is refused by schedule_checks)."""
    name, unused = cfg.lr_scheduler, []
    if cfg.lr_end == SIMPLETUNER_DEFAULTS["lr_end"] and name not in LR_END_SCHEDULERS:
        unused.append(f"lr_end {cfg.lr_end:g}")
    if cfg.lr_power == SIMPLETUNER_DEFAULTS["lr_power"] and name not in LR_POWER_SCHEDULERS:
        unused.append(f"lr_power {cfg.lr_power:g}")
    if not unused:
        return []
    return [f"{' and '.join(unused)} not used: lr_scheduler {name!r} has no end rate or power (SimpleTuner's "
            "defaults, which its configure tool writes); remove " + ("it" if len(unused) == 1 else "them")
            + ", or use lr_scheduler 'polynomial' to decay to lr_end"]
