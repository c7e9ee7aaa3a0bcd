"""The scheduled sampling (rollout) keys (`scheduled_sampling_*`, train/rollout.py): the fields, mixed into
TrainConfig, and their cross-key checks, called from TrainConfig's validator. Import-light: no torch.

SimpleTuner's names and defaults, with two differences that the descriptions say: only the Euler sampler
is implemented (the others are refused while rollouts are on), and ReflexFlow is off unless
`scheduled_sampling_reflexflow` is true (SimpleTuner turns it on by itself with rollouts; difftune says so
at the start of such a run instead of changing the loss unasked).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from difftune.config.experimental import ROLLOUT_SAMPLERS
from difftune.config.fields import field

RAMP_SHAPES = ("linear", "cosine")
STRATEGIES = ("uniform", "biased_early", "biased_late")


class RolloutKeys(BaseModel):
    scheduled_sampling_max_step_offset: int = field(
        0, "Scheduled sampling (rollout): a rolled-out sample is denoised by the model itself, without gradient, "
        "for 1 to this many steps of the validation sampling schedule down to its training noise level, and the "
        "loss is taken on that latent (with the velocity that leads from it to the clean latent). 0: off.",
        "training", ge=0, advanced=True,
    )
    scheduled_sampling_probability: float = field(
        0.0, "Chance that a sample is rolled out (with scheduled_sampling_max_step_offset > 0). 0 changes nothing.",
        "training", ge=0.0, le=1.0, advanced=True,
    )
    scheduled_sampling_ramp_steps: int = field(
        0, "Ramp the rollout chance from scheduled_sampling_prob_start to scheduled_sampling_prob_end over this "
        "many optimizer steps (it stays at the end value after); replaces scheduled_sampling_probability. 0: no "
        "ramp.", "training", ge=0, advanced=True,
    )
    scheduled_sampling_prob_start: float = field(
        0.0, "Rollout chance at the start of the ramp (scheduled_sampling_ramp_steps).", "training", ge=0.0, le=1.0,
        advanced=True,
    )
    scheduled_sampling_prob_end: float = field(
        0.5, "Rollout chance at the end of the ramp (scheduled_sampling_ramp_steps).", "training", ge=0.0, le=1.0,
        advanced=True,
    )
    scheduled_sampling_start_step: int = field(
        0, "No rollouts before this optimizer step; the chance (or its ramp) starts here.", "training", ge=0,
        advanced=True,
    )
    scheduled_sampling_ramp_shape: Literal[RAMP_SHAPES] = field(  # type: ignore[valid-type]
        "linear", "Shape of the chance's ramp: 'linear', or 'cosine' (slow at both ends).", "training",
        advanced=True,
    )
    scheduled_sampling_strategy: Literal[STRATEGIES] = field(  # type: ignore[valid-type]
        "uniform", "How a rolled-out sample's number of steps k is drawn from 0..scheduled_sampling_max_step_offset: "
        "'uniform' (each equally likely; k = 0 is no rollout), 'biased_early' (chance falling linearly with k: "
        "short rollouts) or 'biased_late' (rising with k: long rollouts; both keep k >= 1).", "training",
        advanced=True,
    )
    scheduled_sampling_sampler: Literal[ROLLOUT_SAMPLERS] = field(  # type: ignore[valid-type]
        "euler", "Solver of the rollout steps: 'euler' (the flow sampler's own step); the spec's others are not "
        "implemented yet.", "training", advanced=True,
    )
    scheduled_sampling_order: int = field(
        2, "Order of a multistep rollout solver (SimpleTuner's unipc/dpm). The Euler sampler, the one implemented, "
        "is first order and has no order to set, so any value is accepted and changes nothing.", "training", ge=1,
        advanced=True,
    )
    scheduled_sampling_reflexflow: bool | None = field(
        None, "ReflexFlow on rolled-out samples (arXiv 2512.04904): their flow loss is weighted up where the rollout "
        "drifted from the true noisy latent (frequency compensation, scheduled_sampling_reflexflow_alpha and _beta2) "
        "and a direction term pulls the prediction's direction onto the velocity back to the clean latent "
        "(anti-drift, _beta1). Needs rollouts. Unset (null) or false: off (SimpleTuner turns it on by itself with "
        "rollouts; difftune says so in the log instead).", "training", advanced=True,
    )
    scheduled_sampling_reflexflow_alpha: float = field(
        1.0, "ReflexFlow: how strongly the drift map weights the loss (0: plain weights).", "training", ge=0.0,
        advanced=True,
    )
    scheduled_sampling_reflexflow_beta1: float = field(
        10.0, "ReflexFlow: weight of the anti-drift direction term (0: none).", "training", ge=0.0, advanced=True,
    )
    scheduled_sampling_reflexflow_beta2: float = field(
        1.0, "ReflexFlow: weight of the drift-weighted flow loss of rolled-out samples.", "training", ge=0.0,
        advanced=True,
    )


def rollout_checks(cfg: Any) -> None:
    """Raise ValueError for a rollout setting difftune cannot run (its settings are free while it is off)."""
    rollout = cfg.scheduled_sampling_max_step_offset > 0
    if cfg.scheduled_sampling_reflexflow and not rollout:
        raise ValueError("scheduled_sampling_reflexflow acts on rolled-out samples only; set "
                         "scheduled_sampling_max_step_offset above 0 (and a rollout chance), or remove "
                         "scheduled_sampling_reflexflow")
    if not rollout:
        return
    if cfg.scheduled_sampling_sampler != "euler":
        raise ValueError(f"not implemented yet: scheduled_sampling_sampler {cfg.scheduled_sampling_sampler!r}; "
                         "use 'euler' (the rollouts are a few short steps)")
    if cfg.scheduled_sampling_ramp_steps and cfg.scheduled_sampling_probability:
        raise ValueError("scheduled_sampling_ramp_steps replaces scheduled_sampling_probability with a ramp from "
                         "scheduled_sampling_prob_start to scheduled_sampling_prob_end; remove one of them")
    if cfg.scheduled_sampling_reflexflow and not (cfg.scheduled_sampling_reflexflow_beta1
                                                  or cfg.scheduled_sampling_reflexflow_beta2):
        raise ValueError("scheduled_sampling_reflexflow_beta1 and _beta2 are both 0: rolled-out samples would have no "
                         "loss at all; set _beta2 to 1 (the weighted flow loss) or turn scheduled_sampling_reflexflow off")


def rollout_notes(cfg: Any) -> list[str]:
    """What a SimpleTuner user would not expect, to print before the run starts."""
    if cfg.scheduled_sampling_max_step_offset <= 0:
        return []
    notes = []
    ramp = [k for k in ("scheduled_sampling_prob_start", "scheduled_sampling_prob_end", "scheduled_sampling_ramp_shape")
            if k in cfg.model_fields_set]
    if cfg.scheduled_sampling_ramp_steps <= 0 and ramp:
        notes.append(f"{', '.join(ramp)} not used: they ramp the rollout chance over scheduled_sampling_ramp_steps, "
                     f"which is 0, so the chance is scheduled_sampling_probability ({cfg.scheduled_sampling_probability:g})"
                     "; set scheduled_sampling_ramp_steps")
    if cfg.scheduled_sampling_ramp_steps <= 0 and cfg.scheduled_sampling_probability <= 0:
        notes.append("scheduled_sampling_max_step_offset is set but no sample is ever rolled out: "
                     "scheduled_sampling_probability is 0 and scheduled_sampling_ramp_steps 0; set either")
    if cfg.scheduled_sampling_reflexflow is None:
        notes.append("scheduled_sampling_reflexflow is unset, so ReflexFlow is off and rolled-out samples take the "
                     "plain flow loss (SimpleTuner turns ReflexFlow on by itself with rollouts); set it to true or "
                     "false to choose")
    return notes
