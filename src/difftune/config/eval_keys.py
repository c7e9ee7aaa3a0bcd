"""The evaluation loss on held-out data (SimpleTuner's `dataset_type: "eval"` entries): its keys, mixed into
TrainConfig, and the checks between them, the dataset list and the rest of the config, run by config/load.py
before any model loads. What the loss is and when it is measured: train/eval_loss.py.

SimpleTuner's names and meanings, with these differences (said in the descriptions too):
- the noise levels are the midpoints of `eval_timesteps` equal parts of (0, 1), shifted as training shifts them;
- without eval_steps_interval / eval_epoch_interval the loss is measured at each validation trigger (SimpleTuner
  measures it on eval_steps_interval only), and after the last step;
- every eval image is evaluated (SimpleTuner stops after num_eval_images batches per dataset): max_num_samples
  on the eval entry limits them instead;
- the noise comes from a seed of its own (`EVAL_SEED`), the same in every run, so runs compare.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, field_validator

from difftune.config.fields import field, unset

DEFAULT_TIMESTEPS = 28  # SimpleTuner's default
# Keys of an image entry that act only on training, which never sees an eval entry: set on one, each is refused
# (check_eval_datasets), and the web UI's form for dataset_type 'eval' leaves them out (ui.dataset_fields).
TRAINING_ONLY = ("repeats", "probability", "is_regularisation_data")
EVAL_SEED = 0  # the eval noise's seed: fixed, not `seed`, so runs with other seeds measure on the same noise


class EvalKeys(BaseModel):
    eval_timesteps: int = field(
        DEFAULT_TIMESTEPS, "Noise levels at which the evaluation loss of the eval datasets (dataset_type 'eval') is "
        "measured: the midpoints of this many equal parts of (0, 1), shifted as training shifts its noise levels "
        "(flow_schedule_shift, flow_schedule_auto_shift). Each costs one forward pass per eval image. (SimpleTuner "
        "takes its scheduler's timesteps instead.)", "validation", ge=1, advanced=True,
    )
    eval_loss_disable: bool = field(
        False, "Measure no evaluation loss: the eval datasets (dataset_type 'eval') are then left out, neither "
        "cached nor used.", "validation", advanced=True,
    )
    eval_dataset_pooling: bool = field(
        False, "Several eval datasets: report only their pooled loss (one chart, eval/loss), not each dataset's own "
        "(eval/loss/<id>) beside it.", "validation", advanced=True,
    )

    @field_validator("eval_timesteps", "eval_loss_disable", "eval_dataset_pooling", mode="before")
    @classmethod
    def _eval_null_is_default(cls, value: Any, info: Any) -> Any:
        """SimpleTuner configs may write null for these: it means the default."""
        return cls.model_fields[info.field_name].default if unset(value) else value


def eval_loss_on(train: Any, plan: Any) -> bool:
    """Whether the run measures an evaluation loss (an eval dataset, and eval_loss_disable off)."""
    return bool(plan.evaluation) and not train.eval_loss_disable


def _same_images(ds: Any, trained: list[Any]) -> Any:
    """The training dataset whose local folder is the eval dataset's, or holds it, or lies inside it (None)."""
    if ds.type != "local":
        return None
    mine = Path(ds.instance_data_dir).expanduser().resolve()
    for other in trained:
        if other.type == "local" and not other.disabled:
            theirs = Path(other.instance_data_dir).expanduser().resolve()
            if mine == theirs or mine.is_relative_to(theirs) or theirs.is_relative_to(mine):
                return other
    return None


def check_eval_datasets(train: Any, plan: Any, path: Path, where_of: Callable[[str], str], problems: list[str]) -> None:
    """Misuse of eval entries and of the eval keys, each naming the key and the fix. With eval_loss_disable the eval
    entries are dropped from `plan` (with a note): they are neither cached nor used."""
    from difftune.models.registry import FAMILY_FACTS

    facts, flavour = FAMILY_FACTS[train.model_family], train.flavour()
    for ds in plan.evaluation:
        where = f"{path}: dataset {ds.id!r}"
        unused = [key for key in TRAINING_ONLY if getattr(ds, key) != type(ds).model_fields[key].default]
        problems += [f"{where}: {key}: an eval dataset is never trained on, so {key} would change nothing; remove "
                     "it (or make the entry an 'image' dataset to train on it)" for key in unused]
        if ds.video is not None and not facts.video:
            problems.append(f"{where}: video: {train.model_family} trains on images, so its eval datasets hold "
                            "images; remove the video block")
        elif ds.video is None and facts.first_frame(flavour):
            problems.append(f"{where}: image-to-video flavour {flavour!r} is evaluated on clips (their first frame "
                            "is the input image): add a video block (\"video\": {\"num_frames\": 17}) to this eval "
                            "dataset")
        elif ds.video is not None and facts.first_frame(flavour) and ds.video.num_frames < 5:
            problems.append(f"{where}: video.num_frames {ds.video.num_frames}: image-to-video evaluates the frames "
                            "after the first latent frame, so clips need at least 5 frames; set num_frames to 5 or "
                            "more")
        if (trained := _same_images(ds, plan.images)) is not None:  # the "held-out" loss would be a training loss
            plan.notes.append(f"{where}: its folder {ds.instance_data_dir!r} holds images dataset {trained.id!r} trains "
                              "on (the same folder, or one inside the other): its loss is then not a held-out one; "
                              "give it images the run does not train on")
        if facts.needs_conditioning(flavour) and ds.conditioning_data is None:
            problems.append(f"{where}: flavour {flavour!r} is evaluated on image pairs; set conditioning_data to the "
                            "id of a dataset_type 'conditioning' entry holding this dataset's input images")
        elif not facts.needs_conditioning(flavour) and ds.conditioning_data is not None and plan.mask_dir(ds) is None:
            problems.append(f"{where}: conditioning_data is only used by image-to-image flavours; remove it")
    if plan.evaluation and train.eval_loss_disable:
        names = ", ".join(repr(ds.id) for ds in plan.evaluation)
        plan.notes.append(f"{path}: eval_loss_disable: the eval dataset(s) {names} are left out (not cached, no "
                          "evaluation loss)")
        plan.evaluation = []
    if eval_loss_on(train, plan):
        return
    if train.eval_epoch_interval and train.evaluation_type != "clip":
        # moved here from config/validation_triggers.py: whether it schedules anything depends on the dataset list
        fix = "set eval_loss_disable to false" if train.eval_loss_disable else "add an eval dataset"
        problems.append(f"{where_of('eval_epoch_interval')}: eval_epoch_interval schedules CLIP evaluations; set "
                        f"evaluation_type to 'clip' (it schedules the evaluation loss of eval datasets too: {fix}), "
                        "or remove eval_epoch_interval")
    if train.eval_steps_interval and train.evaluation_type != "clip":
        # accepted (SimpleTuner's presets set it alone), but said: it schedules nothing in this run
        fix = "set eval_loss_disable to false" if train.eval_loss_disable else "add an eval dataset"
        plan.notes.append(f"{where_of('eval_steps_interval')}: eval_steps_interval {train.eval_steps_interval} "
                          f"schedules nothing in this run: set evaluation_type to 'clip' for CLIP scores, or {fix} "
                          "for the evaluation loss")
    if train.eval_loss_disable:  # the feature's switch is off: its settings are accepted, as everywhere
        return
    why = "the dataset list has no entry of dataset_type 'eval'"
    if train.eval_timesteps != DEFAULT_TIMESTEPS:
        problems.append(f"{where_of('eval_timesteps')}: eval_timesteps: sets the noise levels of the evaluation loss, "
                        f"which this run does not measure ({why}); remove eval_timesteps or add an eval dataset")
    if train.eval_dataset_pooling:
        problems.append(f"{where_of('eval_dataset_pooling')}: eval_dataset_pooling: pools the evaluation losses of "
                        f"eval datasets, which this run does not measure ({why}); remove it or add eval datasets")
