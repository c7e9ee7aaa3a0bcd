"""SimpleTuner's smaller training keys: learning-rate scaling (`lr_scale`, `lr_scale_sqrt`), `ignore_final_epochs`,
and the noise-level schedules beside `timestep_sampling` (`flow_use_uniform_schedule`, `flow_use_beta_schedule` with
`flow_beta_schedule_alpha` / `_beta`, `flow_custom_timesteps`). The fields are mixed into TrainConfig; their cross-key
checks are this mixin's validators. Import-light: no torch.

Where they act: train/lr_schedule.py `learning_rate` (the scaled rate, for the optimizer and the schedule),
train/setup.py `total_steps` (ignore_final_epochs), train/noise_levels.py with objective.TimestepSampling (the
schedules). SimpleTuner's meanings; where difftune refuses what SimpleTuner would silently ignore, the description
says so.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, field_validator, model_validator

from difftune.config.fields import field, text_list, unset

BETA_DEFAULT = 2.0  # SimpleTuner's flow_beta_schedule_alpha and _beta
TIMESTEPS = 1000.0  # flow_custom_timesteps above 1 are timesteps of 0..1000: sigma = t / 1000


class ExtraTrainKeys(BaseModel):
    lr_scale: bool = field(
        False, "Multiply learning_rate by the samples of one optimizer step: train_batch_size x "
        "gradient_accumulation_steps x the number of processes (SimpleTuner's meaning). The rate that trains is "
        "written as an info event at the start, and the schedule (warm-up, decay, lr_end's floor) runs from it.",
        "training", advanced=True,
    )
    lr_scale_sqrt: bool = field(
        False, "With lr_scale: multiply learning_rate by the square root of that product instead. Without lr_scale "
        "it is refused (SimpleTuner would ignore it).", "training", advanced=True,
    )
    ignore_final_epochs: bool = field(
        False, "Let max_train_steps alone end the run: num_train_epochs no longer stops it first (SimpleTuner's key "
        "for runs whose epoch count changed when the data did). Needs max_train_steps.", "training", advanced=True,
    )
    flow_use_uniform_schedule: bool = field(
        False, "SimpleTuner's name for timestep_sampling 'uniform': noise levels drawn uniformly in (0, 1), then "
        "shifted. Refused beside another timestep_sampling.", "training", advanced=True,
    )
    flow_use_beta_schedule: bool = field(
        False, "Draw the noise levels from a Beta(flow_beta_schedule_alpha, flow_beta_schedule_beta) distribution, "
        "then shift them (flow_schedule_shift / _auto_shift), instead of timestep_sampling. The draws come from the "
        "run's seeded generator (two Gamma draws by Marsaglia and Tsang's method, on the accelerator), so a resumed "
        "run repeats them; SimpleTuner draws them from torch's global generator.", "training", advanced=True,
    )
    flow_beta_schedule_alpha: float = field(
        BETA_DEFAULT, "With flow_use_beta_schedule: the Beta distribution's alpha (larger: noisier levels). "
        "Default 2 (SimpleTuner's).", "training", gt=0, advanced=True,
    )
    flow_beta_schedule_beta: float = field(
        BETA_DEFAULT, "With flow_use_beta_schedule: the Beta distribution's beta (larger: cleaner levels). "
        "Default 2 (SimpleTuner's; alpha = beta = 2 is a bell around 0.5).", "training", gt=0, advanced=True,
    )
    flow_custom_timesteps: list[float] | None = field(
        None, "Train only at these noise levels, each sample drawing one of them uniformly (SimpleTuner's "
        "'fixed-list' mode): a comma-separated list of timesteps of 0..1000 (sigma = t / 1000), or of sigmas when "
        "every value is at most 1. No shift applies: the list is what trains, so flow_schedule_shift, "
        "flow_schedule_auto_shift, timestep_sampling and the Beta or uniform schedules are refused beside it.",
        "training", advanced=True,
    )
    flow_timesteps_mode: Literal["fixed-list", "round-robin"] = field(
        "fixed-list", "How flow_custom_timesteps are taken: 'fixed-list' draws one of them uniformly per sample; "
        "'round-robin' takes them in turn, in the list's order, sample after sample of the global batch (the first "
        "sample of the run takes the first level). The place in the cycle is computed from the optimizer step, the "
        "micro-batch and the sample's place in the global batch, so a resumed run continues the cycle exactly and "
        "several processes take their slices of it, as they do of the other draws (SimpleTuner keeps a cursor, "
        "re-initialised from the global step on resume, with a per-rank offset). Needs flow_custom_timesteps.",
        "training", advanced=True,
    )
    data_backend_sampling: Literal["auto-weighting", "uniform"] = field(
        "auto-weighting", "How batches are shared between several datasets. 'auto-weighting': in proportion to each "
        "dataset's size (an epoch is every batch of every dataset once); entries that set probability scale their "
        "share (probability x the dataset's share of the images, 1 unset, as SimpleTuner weighs them), and a "
        "dataset that runs out then starts its next epoch on its own. 'uniform': each batch comes from a dataset "
        "drawn by its probability alone (1 for an entry without one), whatever its size, so a small dataset is seen "
        "as often as a large one (SimpleTuner's meaning; it suits a small subject set beside a large regularisation "
        "set). An epoch still counts as many batches as all datasets hold.", "data", advanced=True,
    )

    @field_validator("data_backend_sampling", mode="before")
    @classmethod
    def _extra_sampling_null(cls, value: Any) -> Any:
        return "auto-weighting" if value is None else value

    @field_validator("flow_timesteps_mode", mode="before")
    @classmethod
    def _extra_timesteps_mode(cls, value: Any) -> Any:
        return "fixed-list" if value is None else value

    @field_validator("flow_custom_timesteps", mode="before")
    @classmethod
    def _extra_custom_list(cls, value: Any) -> Any:
        """'1000, 979.2, 957.5' (SimpleTuner's form) or a JSON list -> floats; empty -> not set."""
        return text_list(value)

    @field_validator("lr_scale", "lr_scale_sqrt", "ignore_final_epochs", "flow_use_uniform_schedule",
                     "flow_use_beta_schedule", mode="before")
    @classmethod
    def _extra_null_is_off(cls, value: Any) -> Any:
        return False if unset(value) else value  # SimpleTuner writes null for its default

    @field_validator("flow_beta_schedule_alpha", "flow_beta_schedule_beta", mode="before")
    @classmethod
    def _extra_null_is_default(cls, value: Any) -> Any:
        return BETA_DEFAULT if unset(value) else value

    @model_validator(mode="before")
    @classmethod
    def _extra_uniform_alias(cls, data: Any) -> Any:
        """flow_use_uniform_schedule: true is timestep_sampling 'uniform'; another timestep_sampling beside it is a
        contradiction (SimpleTuner would take the uniform one and say nothing)."""
        if not isinstance(data, dict) or not _true(data.get("flow_use_uniform_schedule")):
            return data
        chosen = data.get("timestep_sampling")
        if chosen not in (None, "uniform"):
            raise ValueError(f"flow_use_uniform_schedule is timestep_sampling 'uniform', but timestep_sampling is "
                             f"{chosen!r}: remove one of them")
        return {**data, "timestep_sampling": "uniform"}

    @model_validator(mode="after")
    def _extra_train_checks(self) -> ExtraTrainKeys:
        extra_train_checks(self)
        return self

    def custom_sigmas(self) -> list[float] | None:
        """flow_custom_timesteps as sigmas in [0, 1] (None when not set)."""
        levels = self.flow_custom_timesteps
        if not levels:
            return None
        return list(levels) if max(levels) <= 1.0 else [t / TIMESTEPS for t in levels]


def _true(value: Any) -> bool:
    """What pydantic reads as a true bool (True, 1, or the strings 1, on, t, true, y, yes in any case)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "on", "t", "true", "y", "yes")
    return value is True or (type(value) is int and value == 1)


def _explicit(cfg: Any, key: str) -> bool:
    return key in cfg.model_fields_set


def extra_train_checks(cfg: Any) -> None:
    """Raise ValueError for a setting these keys would make do nothing, or two that contradict each other."""
    if cfg.lr_scale_sqrt and not cfg.lr_scale:
        raise ValueError("lr_scale_sqrt takes the square root of lr_scale's factor and does nothing alone: set "
                         "lr_scale to true as well, or remove lr_scale_sqrt")
    if cfg.ignore_final_epochs and not cfg.max_train_steps:
        raise ValueError("ignore_final_epochs lets max_train_steps alone end the run, but max_train_steps is 0: set "
                         "max_train_steps, or remove ignore_final_epochs")
    beta_set = [key for key in ("flow_beta_schedule_alpha", "flow_beta_schedule_beta")
                if getattr(cfg, key) != BETA_DEFAULT]
    if beta_set and not cfg.flow_use_beta_schedule:
        raise ValueError(f"{beta_set[0]} shapes the Beta schedule, which is off: set flow_use_beta_schedule to true, "
                         f"or remove {beta_set[0]}")
    if cfg.flow_timesteps_mode == "round-robin" and not cfg.flow_custom_timesteps:
        raise ValueError("flow_timesteps_mode 'round-robin' takes flow_custom_timesteps in turn, but none are set: "
                         "set flow_custom_timesteps, or remove flow_timesteps_mode")
    replaces = "custom" if cfg.flow_custom_timesteps else "beta" if cfg.flow_use_beta_schedule else None
    if replaces is None:
        return
    switch = "flow_custom_timesteps" if replaces == "custom" else "flow_use_beta_schedule"
    rivals = [key for key, on in [("flow_use_beta_schedule", replaces == "custom" and cfg.flow_use_beta_schedule),
                                  ("flow_use_uniform_schedule", cfg.flow_use_uniform_schedule),
                                  ("timestep_sampling", _explicit(cfg, "timestep_sampling")),
                                  ("logit_mean", cfg.logit_mean != 0.0), ("logit_std (flow_sigmoid_scale)",
                                                                          cfg.logit_std != 1.0),
                                  ("mode_scale", _explicit(cfg, "mode_scale"))] if on]
    if replaces == "custom":
        rivals += [key for key, on in [("flow_schedule_shift", cfg.flow_schedule_shift != 1.0),
                                       ("flow_schedule_auto_shift", cfg.flow_schedule_auto_shift)] if on]
    if rivals:
        what = ("draws the noise levels from its list, unshifted" if replaces == "custom"
                else "draws the noise levels from a Beta distribution")
        raise ValueError(f"{switch} {what}; {rivals[0]} would be ignored beside it: remove {rivals[0].split()[0]} "
                         f"(or {switch})")
    if replaces == "custom":
        bad = [t for t in cfg.flow_custom_timesteps if not (math.isfinite(t) and 0.0 <= t <= TIMESTEPS)]
        if bad:
            raise ValueError(f"flow_custom_timesteps holds {bad[0]:g}: give timesteps of 0..1000 (or sigmas of 0..1)")
