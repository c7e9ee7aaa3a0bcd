"""SimpleTuner's smaller validation and output keys: `validation_randomize`, `validation_lycoris_strength`,
`validation_stitch_input_location`, `validation_seed_source`, `logging_dir`, `model_card_safe_for_work`, the rolling
checkpoints (`checkpointing_rolling_steps`, `checkpoints_rolling_total_limit`) and the user scripts run after each
checkpoint and upload (`post_checkpoint_script`, `post_upload_script`). The fields are mixed into TrainConfig; their
cross-key checks are this mixin's validator. Import-light: no torch.

Where they act: train/validation.py (seeds, strength, stitching), models/base.py (the seed source),
train/trackers.py (logging_dir), train/model_card.py (safe for work), train/triggers.py and train/checkpoint.py (the rolling
series), train/scripts.py (the scripts). SimpleTuner's meanings; the descriptions say where difftune differs.
"""

from __future__ import annotations

import shlex
import string
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from difftune.config.fields import field

# What post_checkpoint_script and post_upload_script can name, besides any validation_* key (SimpleTuner's set)
SCRIPT_PLACEHOLDERS = ("local_checkpoint_path", "global_step", "tracker_run_name", "tracker_project_name",
                       "model_family", "model_type", "lora_type", "huggingface_path", "remote_checkpoint_path")
SCRIPT_KEYS = ("post_checkpoint_script", "post_upload_script")


class ExtraOutputKeys(BaseModel):
    model_config = ConfigDict(protected_namespaces=())  # model_card_* keys: pydantic<2.10 warns on "model_"
    validation_randomize: bool = field(
        False, "Sample each validation from fresh random seeds instead of validation_seed, so the samples vary from "
        "one validation to the next (SimpleTuner's meaning). Each image's seed is in its \"sample\" event: sampling "
        "it again with that validation_seed gives the same image. The live and EMA samples of one validation share "
        "their seeds; the -vs-base comparison images of disable_benchmark: false are not written (their base "
        "sample had another seed); CLIP evaluations on their own schedule keep the fixed seeds, so scores compare.",
        "validation", advanced=True,
    )
    validation_lycoris_strength: float | None = field(
        None, "With lora_type 'lycoris': the network's multiplier while validation samples (0: the base model, 1: "
        "full strength); training keeps its own (lycoris_config's multiplier), bit for bit. Empty: the training "
        "multiplier (SimpleTuner's default is 1.0, which is the same unless lycoris_config sets another).",
        "validation", ge=0, advanced=True,
    )
    validation_seed_source: Literal["gpu", "cpu"] = field(
        "gpu", "Where validation noise is drawn from its seed: 'gpu' on the accelerator the model samples on (the "
        "default), 'cpu' from a CPU generator, then moved there, so that a seed gives the same sample on any GPU "
        "model and driver, and on a machine without one (SimpleTuner's meaning and names; its default is 'cpu'). "
        "The model card's diffusers code draws it the same way.", "validation", advanced=True,
    )
    validation_stitch_input_location: Literal["left", "right"] | None = field(
        None, "Image-to-image and image-to-video flavours: also write each sample beside its input image, as "
        "<name>-with-input.png (the input image on the left or the right, scaled to the sample's height; a video's "
        "contact sheet gets it beside its first row). The sample itself and what trackers and the web UI show stay as they "
        "are, as with the -vs-base comparisons. Empty: none (SimpleTuner's web UI writes 'left').", "validation",
        advanced=True,
    )
    logging_dir: str | None = field(
        None, "With report_to 'tensorboard' or 'all': the folder of TensorBoard's logs, under output_dir (a relative "
        "path, as SimpleTuner's 'logs'); they go to <output_dir>/<logging_dir>/<tracker_project_name>. Empty: "
        "'tensorboard'.", "output", advanced=True,
    )
    model_card_safe_for_work: bool = field(
        True, "With push_to_hub: false puts a warning that the model may make content not safe for work at the top "
        "of the model card, and the hub's not-for-all-audiences tag in its metadata (SimpleTuner's meaning; its "
        "default is false, difftune's true: no warning).", "output", advanced=True,
    )
    checkpointing_rolling_steps: int = field(
        0, "Also write a checkpoint every N optimizer steps into a second series, checkpoint-NNNNNNN-rolling, pruned "
        "to its own checkpoints_rolling_total_limit: frequent, cheap-to-keep restore points beside the regular "
        "checkpoints (checkpoint_step_interval, pruned by checkpoints_total_limit). Pruning one series never deletes "
        "the other's; resume_from_checkpoint 'latest' takes the newest of both. A step due for both writes the "
        "regular one. 0: off.", "output", ge=0, advanced=True,
    )
    checkpoints_rolling_total_limit: int = field(
        1, "With checkpointing_rolling_steps: how many rolling checkpoints to keep (the newest). Default 1 "
        "(SimpleTuner's).", "output", ge=1, advanced=True,
    )
    post_checkpoint_script: str | None = field(
        None, "A command run after each checkpoint is complete on disk (regular, rolling, manual and the final one), "
        "in the background on process 0, e.g. '/opt/hooks/copy.sh {local_checkpoint_path} {global_step}'. "
        "Placeholders (SimpleTuner's): {local_checkpoint_path}, {global_step}, {tracker_run_name}, "
        "{tracker_project_name}, {model_family}, {model_type}, {lora_type}, {huggingface_path}, any validation_* "
        "key; {remote_checkpoint_path} is empty here. The command is split like a shell line and each argument "
        "filled in afterwards (a path with spaces stays one argument); no shell runs it. A failure or a non-zero "
        "exit is a warning event with its output's end; training goes on. The end of the run waits for running "
        "scripts (at most 30 min).", "output", advanced=True,
    )
    post_upload_script: str | None = field(
        None, "A command run after each hub upload (push_to_hub: the result, and each checkpoint with "
        "push_checkpoints_to_hub) with {remote_checkpoint_path} the uploaded folder's hub URL; without push_to_hub, "
        "once after the result is saved, with {remote_checkpoint_path} empty and {local_checkpoint_path} the "
        "output_dir (SimpleTuner runs it without uploads too). Same placeholders and handling as "
        "post_checkpoint_script.", "output", advanced=True,
    )

    @field_validator("checkpointing_rolling_steps", mode="before")
    @classmethod
    def _extra_rolling_null(cls, value: Any) -> Any:
        return 0 if value is None else value  # SimpleTuner writes null for "off"

    @field_validator("checkpoints_rolling_total_limit", mode="before")
    @classmethod
    def _extra_rolling_limit_null(cls, value: Any) -> Any:
        return 1 if value is None else value

    @field_validator("validation_randomize", mode="before")
    @classmethod
    def _extra_randomize_null(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("validation_stitch_input_location", "validation_seed_source", mode="before")
    @classmethod
    def _extra_choice_spelling(cls, value: Any, info: Any) -> Any:
        """Case and spaces as typed; empty (or null for the seed source) is the default."""
        if isinstance(value, str):
            value = value.strip().lower() or None
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("logging_dir")
    @classmethod
    def _extra_logging_dir(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        path = PurePath(value.strip())
        # inside output_dir only: the web UI confines output_dir to its roots, and a run's logs stay with the run
        if path.is_absolute() or value.strip().startswith("~") or ".." in path.parts:
            raise ValueError(f"{value!r}: TensorBoard's logs go under output_dir; give a folder name there, such as "
                             "'logs' (move the whole run with output_dir)")
        return path.as_posix()

    @field_validator("model_card_safe_for_work", mode="before")
    @classmethod
    def _extra_card_null(cls, value: Any) -> Any:
        return True if value is None else value

    @field_validator(*SCRIPT_KEYS)
    @classmethod
    def _extra_script(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        try:
            words = shlex.split(value)
        except ValueError as e:
            raise ValueError(f"{value!r} cannot be split into arguments ({e}); check its quotes") from e
        for word in words:
            try:
                list(string.Formatter().parse(word))
            except ValueError as e:
                raise ValueError(f"{word!r}: {e}; write {{{{ and }}}} for a literal brace") from e
        return value

    @model_validator(mode="after")
    def _extra_output_checks(self) -> ExtraOutputKeys:
        extra_output_checks(self)
        return self


def script_placeholders(command: str) -> list[str]:
    """The {names} a script command fills in (after shell-like splitting)."""
    return [name for word in shlex.split(command) for _, name, _, _ in string.Formatter().parse(word)
            if name is not None]


def extra_output_checks(cfg: Any) -> None:
    """Raise ValueError for a setting these keys would make do nothing, naming the key and the fix."""
    if cfg.validation_randomize and not cfg.validation_prompts():
        raise ValueError("validation_randomize draws the seeds of validation samples, but no validation prompt is "
                         "set: set validation_prompt, or remove validation_randomize")
    if cfg.validation_randomize and cfg.validation_seed is not None:
        raise ValueError("validation_randomize draws new seeds at each validation, so validation_seed would be "
                         "ignored: remove one of them")
    strength = cfg.validation_lycoris_strength
    if strength is not None and not (cfg.model_type == "lora" and cfg.lora_type == "lycoris") and strength != 1.0:
        raise ValueError(f"validation_lycoris_strength {strength:g} sets a LyCORIS network's multiplier, but "
                         "lora_type is not 'lycoris': remove validation_lycoris_strength")
    if strength is not None and strength != 1.0 and not cfg.validation_prompts():
        raise ValueError("validation_lycoris_strength acts while validation samples, but no validation prompt is "
                         "set: set validation_prompt, or remove validation_lycoris_strength")
    if cfg.checkpoints_rolling_total_limit != 1 and not cfg.checkpointing_rolling_steps:
        raise ValueError("checkpoints_rolling_total_limit prunes the rolling checkpoints, which are off: set "
                         "checkpointing_rolling_steps, or remove checkpoints_rolling_total_limit")
    rolling, regular = cfg.checkpointing_rolling_steps, cfg.checkpoint_step_interval
    if rolling and regular and rolling % regular == 0:  # a step due for both writes only the regular checkpoint
        raise ValueError(f"checkpointing_rolling_steps {rolling} is a multiple of checkpoint_step_interval {regular}, "
                         "so every rolling step is also a regular checkpoint step and no rolling checkpoint would be "
                         "written: make checkpointing_rolling_steps smaller than checkpoint_step_interval (and not a "
                         "multiple of it), or remove it")
    known = set(SCRIPT_PLACEHOLDERS) | {key for key in type(cfg).model_fields if key.startswith("validation_")}
    for key in SCRIPT_KEYS:
        command = getattr(cfg, key)
        unknown = [name for name in script_placeholders(command) if name not in known] if command else []
        if unknown:
            raise ValueError(f"{key}: {{{unknown[0]}}} is not a placeholder difftune fills (write {{{{ and }}}} for a "
                             "literal brace); known: " + ", ".join("{" + name + "}" for name in SCRIPT_PLACEHOLDERS)
                             + " and any validation_* key")
