"""When a dataset is sampled (SimpleTuner's `start_epoch`, `start_step`, `end_epoch`, `end_step` on an image or video
entry): curriculum learning in one dataset list, such as low-resolution data for the first steps and high-resolution
data after. A mixin of ImageDataset; data/sampler.py applies the windows, train/setup.py checks the whole run.

SimpleTuner's meaning: a dataset is sampled once both its start conditions hold (epoch >= start_epoch, optimizer step
>= start_step) until either end condition passes (epoch > end_epoch or step > end_step). Epochs count from 1, steps
from 1 (the optimizer step the batch trains in, after gradient accumulation). At least one dataset must be sampled
from the first step. Import-light: no torch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, field_validator, model_validator

from difftune.config.fields import default_if_unset, field

SCHEDULE_KEYS = ("start_epoch", "start_step", "end_epoch", "end_step")


class DatasetSchedule(BaseModel):
    start_epoch: int = field(1, "Sample this dataset from this epoch on (1: from the start).", "data", ge=1,
                             advanced=True)
    start_step: int = field(0, "Sample this dataset from this optimizer step on (0 or 1: from the start). With "
                            "start_epoch, both must be reached.", "data", ge=0, advanced=True)
    end_epoch: int | None = field(None, "Stop sampling this dataset after this epoch (empty: never).", "data", ge=1,
                                  advanced=True)
    end_step: int | None = field(None, "Stop sampling this dataset after this optimizer step (empty: never); e.g. "
                                 "end_step 300 here and start_step 301 on another dataset hand over at step 301.",
                                 "data", ge=1, advanced=True)

    @field_validator("start_epoch", "start_step", mode="before")
    @classmethod
    def _schedule_null_is_start(cls, value: Any, info: Any) -> Any:
        """SimpleTuner's configs write null (or "") for "from the start"."""
        return default_if_unset(cls, value, info.field_name)

    @model_validator(mode="after")
    def _schedule_order(self) -> Any:
        if self.end_epoch is not None and self.end_epoch < self.start_epoch:
            raise ValueError(f"end_epoch {self.end_epoch} comes before start_epoch {self.start_epoch}: the dataset "
                             "would never be sampled")
        if self.end_step is not None and self.end_step < max(self.start_step, 1):
            raise ValueError(f"end_step {self.end_step} comes before start_step {self.start_step}: the dataset would "
                             "never be sampled")
        if getattr(self, "dataset_type", None) == "eval" and self.scheduled():
            raise ValueError("an eval dataset is measured at every evaluation, not sampled for training: remove "
                             f"{', '.join(k for k in SCHEDULE_KEYS if k in self.model_fields_set)}")
        return self

    def scheduled(self) -> bool:
        """Whether the dataset is sampled for less than the whole run."""
        return self.window() != (1, 0, None, None)

    def window(self) -> tuple[int, int, int | None, int | None]:
        """(start_epoch, start_step, end_epoch, end_step), as data/sampler.py takes it; start_step 1 is the first
        step, as 0 is."""
        return self.start_epoch, 0 if self.start_step <= 1 else self.start_step, self.end_epoch, self.end_step


def schedule_problems(images: list[Any]) -> list[str]:
    """The run-level check SimpleTuner makes: some training dataset is sampled from the first step."""
    training = [ds for ds in images if ds.dataset_type != "eval"]
    if not any(ds.scheduled() for ds in training):
        return []
    if any(ds.start_epoch <= 1 and ds.start_step <= 1 for ds in training):
        return []
    starts = ", ".join(f"{ds.id!r} (start_epoch {ds.start_epoch}, start_step {ds.start_step})" for ds in training)
    return [f"no dataset is sampled from the first step: {starts}; give one of them start_epoch 1 and start_step 0"]
