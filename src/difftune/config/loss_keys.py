"""The loss-shape and input-noise keys (`loss_type`, `huber_schedule`, `huber_c`, `input_perturbation`,
`input_perturbation_steps`; the math is in train/objective.py): the fields, mixed into TrainConfig.
Import-light: no torch.

SimpleTuner's names and defaults. Two things differ and the descriptions say so: SimpleTuner's main loss path
keeps the squared error for flow-matching models whatever `loss_type` says (only its other model kinds use
Huber), while difftune applies the chosen loss; and its huber_c schedules are written for DDPM timesteps, so
difftune reads them on the flow noise level s (SimpleTuner's flow timestep is 1000·s):
- 'exponential': c(s) = huber_c ** s, SimpleTuner's exp(-alpha·t) with alpha = -ln(huber_c) / 1000, t = 1000·s;
- 'snr': c(s) = huber_c + (1 - huber_c)·(1 - s)², SimpleTuner's (1 - c) / (1 + sigma)² + c with sigma the
  noise-to-signal ratio of the noisy latent, sqrt(1 / SNR), which is s / (1 - s) on the flow path (SimpleTuner
  reads it from DDPM's alphas_cumprod, which a flow scheduler does not have).
Both go from 1 on clean latents to huber_c on pure noise.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, field_validator

from difftune.config.fields import field, unset

LOSS_TYPES = ("l2", "huber", "smooth_l1")
HUBER_SCHEDULES = ("snr", "exponential", "constant")


class LossKeys(BaseModel):
    loss_type: Literal[LOSS_TYPES] = field(  # type: ignore[valid-type]
        "l2", "Loss of each latent element: 'l2' (squared error), 'huber' (pseudo-Huber, 2c·(sqrt(e² + c²) - c): "
        "squared for errors well under c, linear above, so outliers pull less) or 'smooth_l1' (the same divided "
        "by c: 2·(sqrt(e² + c²) - c)), with c from huber_c and huber_schedule. The per-sample weights "
        "(loss_weighting) and ReflexFlow's weights apply to it alike. SimpleTuner keeps 'l2' for flow-matching "
        "models whatever this says; difftune applies it.", "training", advanced=True,
    )
    huber_schedule: Literal[HUBER_SCHEDULES] = field(  # type: ignore[valid-type]
        "snr", "With loss_type 'huber' or 'smooth_l1': how each sample's c follows its noise level s: 'snr' "
        "(huber_c + (1 - huber_c)·(1 - s)², from 1 on clean latents to huber_c on pure noise), 'exponential' "
        "(huber_c ** s, the same ends) or 'constant' (huber_c). SimpleTuner's schedules, read on the flow noise "
        "level (its timestep / 1000).", "training", advanced=True,
    )
    huber_c: float = field(
        0.1, "With loss_type 'huber' or 'smooth_l1': the pseudo-Huber threshold c (on pure noise, with a "
        "schedule).", "training", gt=0.0, advanced=True,
    )
    input_perturbation: float = field(
        0.0, "Input perturbation (exposure-bias training): the model's noisy input is built from noise + this × a "
        "second Gaussian draw, while the target keeps the first noise. 0.1 is the usual value; 0: off.",
        "training", ge=0.0, advanced=True,
    )
    input_perturbation_steps: int = field(
        0, "With input_perturbation: decay it linearly to 0 over this many optimizer steps (off after them); "
        "0: the full value for the whole run.", "training", ge=0, advanced=True,
    )

    @field_validator("loss_type", "huber_schedule", "huber_c", "input_perturbation", "input_perturbation_steps",
                     mode="before")
    @classmethod
    def _loss_null_is_default(cls, value: Any, info: Any) -> Any:
        """SimpleTuner configs may write null for these: it means the default."""
        return cls.model_fields[info.field_name].default if unset(value) else value
