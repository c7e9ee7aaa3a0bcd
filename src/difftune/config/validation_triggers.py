"""When validation samples, CLIP evaluations and checkpoints happen, beyond the step intervals: the base model's
samples before training (`disable_benchmark`, `validation_on_startup`), several samples per prompt
(`num_validation_images`) and the epoch intervals (`*_epoch_interval`). The fields are mixed into TrainConfig;
their cross-key checks are this mixin's validator. Import-light: no torch. The loop's side is train/triggers.py.

SimpleTuner's meanings, with the differences the descriptions say: difftune's `disable_benchmark` defaults to
true (SimpleTuner samples the base model unless told not to), and the images of one prompt are seeded
validation_seed, +1, +2, ... (SimpleTuner draws them as one batch from one generator).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError, field_validator, model_validator

from difftune.config.fields import field

# What validation_disable switches off (the prompt sources, and what samples them)
VALIDATION_OFF = {"validation_prompt": None, "user_prompt_library": None, "validation_prompt_library": False,
                  "validation_on_startup": False, "disable_benchmark": True, "num_validation_images": 1,
                  "validation_epoch_interval": None}


class ValidationTriggerKeys(BaseModel):
    disable_benchmark: bool = field(
        True, "Skip the samples of the base model (the adapter not trained yet) that SimpleTuner takes before the "
        "first step. false: before step 1 the validation prompts are sampled with the adapter switched off, into "
        "validation/base-model-*.png (events at step 0, so trackers chart them too), and every later validation "
        "image also gets a side-by-side <name>-vs-base.png (base model left, trained right). Not repeated when a "
        "run resumes. Default true here (SimpleTuner's default is false: a run starts faster without them). "
        "cuDNN benchmarking, which this key switched before, is cudnn_benchmark.", "validation",
    )
    validation_on_startup: bool = field(
        False, "Sample the validation prompts with the base model (the adapter switched off) before the first step, "
        "into validation/base-model-*.png, as disable_benchmark: false does but without the side-by-side "
        "comparison images. Not repeated when a run resumes.", "validation", advanced=True,
    )
    num_validation_images: int = field(
        1, "Samples per validation prompt and resolution, seeded validation_seed, validation_seed + 1, ... (the "
        "first is the sample a value of 1 gives; SimpleTuner draws them as one batch from one generator instead). "
        "Above 1, file names end in -1of3, -2of3, ...; CLIP evaluation scores the first of each prompt.",
        "validation", ge=1,
    )
    validation_epoch_interval: int | None = field(
        None, "Also sample the validation prompts at the end of every N-th epoch (with validation_step_interval "
        "too, both schedules apply). An epoch ending inside an optimizer step (gradient accumulation) triggers "
        "after that step. Empty or 0: off.", "validation", ge=0,
    )
    eval_epoch_interval: float | None = field(
        None, "With evaluation_type 'clip' or an eval dataset: also evaluate (CLIP scores, evaluation loss) every N "
        "epochs; fractions evaluate within an epoch (0.5: at each half). Evaluated after the optimizer step that "
        "reaches the point. Empty or 0: off.",
        "validation", ge=0, advanced=True,
    )
    checkpoint_epoch_interval: int | None = field(
        None, "Also write a resumable checkpoint at the end of every N-th epoch (with checkpoint_step_interval too, "
        "both schedules apply). An epoch ending inside an optimizer step (gradient accumulation) is saved after "
        "that step. Empty or 0: off.", "output", ge=0,
    )

    validation_disable: bool = field(
        False, "SimpleTuner's switch: true samples nothing during training, whatever the config says (validation "
        "prompts, prompt libraries, base-model samples and their schedules are switched off, with a note). The "
        "evaluation loss of eval datasets still runs.", "validation", advanced=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _validation_off(cls, data: Any) -> Any:
        """validation_disable: the prompt sources and what samples them before or between steps, off; everything
        downstream then sees a run without prompts (the samples, the checks, the planner, the model card)."""
        if not isinstance(data, dict) or data.get("validation_disable") in (None, False):
            return data
        try:  # read as the field reads it ("true", "on", 1, ...): a value the field takes for true is honoured
            on = TypeAdapter(bool).validate_python(data["validation_disable"])
        except ValidationError:
            return data  # the field's own error says what is wrong
        return {**data, **VALIDATION_OFF} if on else data

    @field_validator("num_validation_images", mode="before")
    @classmethod
    def _null_is_one(cls, v: object) -> object:
        return 1 if v is None else v  # SimpleTuner writes null for its default

    @model_validator(mode="after")
    def _trigger_checks(self) -> ValidationTriggerKeys:
        trigger_checks(self)
        return self


def samples_base_model(cfg: Any) -> bool:
    """Whether the run samples the base model before its first step (disable_benchmark: false samples nothing
    without a prompt, as in SimpleTuner, whose config.json.example writes it)."""
    return cfg.validation_on_startup or not cfg.disable_benchmark and bool(cfg.validation_prompts())


def trigger_checks(cfg: Any) -> None:
    """Raise ValueError for a setting that would do nothing (no prompt to sample, no evaluation to run).
    disable_benchmark: false without a prompt is a note (cross_checks.unsampled_notes): SimpleTuner's example
    config writes it, and a user who removes the prompt there switches validation off."""
    asked = [key for key, on in (("validation_on_startup", cfg.validation_on_startup),
                                 ("num_validation_images", cfg.num_validation_images > 1),
                                 ("validation_epoch_interval", bool(cfg.validation_epoch_interval))) if on]
    if asked and not cfg.validation_prompts():
        raise ValueError(f"{asked[0]} samples the validation prompts, but none is set: set validation_prompt (or "
                         f"user_prompt_library, or validation_prompt_library), or remove {asked[0]}")
    # eval_epoch_interval without evaluation_type 'clip' may schedule the evaluation loss of eval datasets, which
    # this mixin cannot see: config/eval_keys.check_eval_datasets checks it against the dataset list
