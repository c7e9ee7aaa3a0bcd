"""Config-level dataset settings (SimpleTuner's `--resolution`, `--crop`, `--caption_strategy`, ...): each is
the default of every image or video dataset that does not set its own; the dataset's own value wins.

Mixed into TrainConfig so that the CLI, the wizard and the web UI show them like every key. Unset (None)
means no default: the dataset's own default applies. `config/load.py` hands the set ones to each dataset
entry before the entry is validated, so a bad combination (crop_aspect 'closest' without
crop_aspect_buckets) is reported on the dataset where it lands. Import-light: no torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, field_validator

from difftune.config.fields import field, text_list

_DEFAULT = "Default {} of every dataset that does not set its own"


def _about(key: str, more: str = "") -> str:
    return _DEFAULT.format(key) + (f" ({more})." if more else ".")


class DatasetDefaultKeys(BaseModel):
    resolution: float | None = field(None, _about("resolution"), "data", gt=0, advanced=True)
    resolution_type: Literal["pixel", "pixel_area", "area"] | None = field(
        None, _about("resolution_type"), "data", advanced=True
    )
    minimum_image_size: float | None = field(
        None, _about("minimum_image_size", "0: no minimum"), "data", ge=0, advanced=True
    )
    maximum_image_size: float | None = field(
        None, _about("maximum_image_size", "with target_downsample_size"), "data", gt=0, advanced=True
    )
    target_downsample_size: float | None = field(
        None, _about("target_downsample_size", "with maximum_image_size"), "data", gt=0, advanced=True
    )
    caption_strategy: Literal["textfile", "filename", "instanceprompt", "parquet"] | None = field(
        None, _about("caption_strategy", "'parquet' also needs each dataset's parquet block; 'instance_prompt', "
                     "SimpleTuner's command-line spelling, is 'instanceprompt'"), "data", advanced=True
    )
    instance_prompt: str | None = field(None, _about("instance_prompt"), "data", advanced=True)
    prepend_instance_prompt: bool | None = field(None, _about("prepend_instance_prompt"), "data", advanced=True)
    only_instance_prompt: bool | None = field(None, _about("only_instance_prompt"), "data", advanced=True)
    crop: bool | None = field(None, _about("crop"), "data", advanced=True)
    crop_style: Literal["center", "random", "corner"] | None = field(None, _about("crop_style"), "data", advanced=True)
    max_upscale_threshold: float | None = field(
        None, _about("max_upscale_threshold", "crop_aspect 'closest' or 'random': the most an image is enlarged, 0.2 "
                     "for 20%"), "data", ge=0, advanced=True,
    )
    crop_aspect: Literal["square", "preserve", "closest", "random"] | None = field(
        None, _about("crop_aspect"), "data", advanced=True
    )
    crop_aspect_buckets: list[float] | None = field(None, _about("crop_aspect_buckets"), "data", advanced=True)
    disable_multiline_split: bool | None = field(
        None, _about("disable_multiline_split", "true: a caption file is one caption, its line breaks kept; "
                     "false: each non-empty line is a caption of its own"), "data", advanced=True,
    )
    aws_max_pool_connections: int | None = field(
        None, "Default aws_max_pool_connections of every dataset of type 'aws' that does not set its own (its "
        "connections to the store at once; 128 when neither is set).", "data", ge=1, advanced=True,
    )

    @field_validator("crop_aspect_buckets", mode="before")
    @classmethod
    def _buckets_text(cls, value: Any) -> Any:
        return text_list(value)  # '0.75,1.0' or '[0.75, 1.0]' on the command line

    @field_validator("caption_strategy", mode="before")
    @classmethod
    def _caption_strategy_spelling(cls, value: Any) -> Any:
        # SimpleTuner's --caption_strategy choices spell it 'instance_prompt'; its dataset entries 'instanceprompt'
        return "instanceprompt" if value == "instance_prompt" else value


DATASET_DEFAULT_KEYS = tuple(DatasetDefaultKeys.model_fields)
