"""Schema of the dataset list (`multidatabackend.json`): a JSON list of image and text-embeds entries."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from difftune.config.fields import field


class ImageDataset(BaseModel):
    """A folder of images with captions."""

    model_config = ConfigDict(extra="forbid")

    id: str = field(..., "Unique name of the dataset (used in reports and cache paths).", "data", min_length=1)
    type: Literal["local"] = field("local", "Where the files live; only 'local' folders.", "data")
    dataset_type: Literal["image"] = field("image", "Kind of entry.", "data")
    instance_data_dir: str = field(..., "Folder of images; sub-folders are searched too.", "data")
    caption_strategy: Literal["textfile"] = field(
        "textfile", "'textfile': a .txt beside each image with the same name holds its caption.", "data"
    )
    resolution: float = field(1024, "Training size; its meaning depends on resolution_type.", "data", gt=0)
    resolution_type: Literal["pixel", "pixel_area"] = field(
        "pixel_area",
        "'pixel': resolution is the short edge in pixels. 'pixel_area': images keep their aspect ratio "
        "at the area of a resolution x resolution square.",
        "data",
    )
    crop: bool = field(False, "Crop images to crop_aspect (otherwise only trimmed to the bucket size).", "data")
    crop_style: Literal["center", "random"] = field("center", "Where crops are taken from.", "data")
    crop_aspect: Literal["square", "preserve"] = field(
        "square", "With crop: 'square' crops to 1:1, 'preserve' keeps each image's aspect.", "data"
    )
    minimum_image_size: float | None = field(
        None, "Images whose short edge (pixel) or area (pixel_area) is smaller are left out and reported.",
        "data", gt=0, advanced=True,
    )
    maximum_image_size: float | None = field(
        None, "Images larger than this (same unit as minimum_image_size) are first downsampled to "
        "target_downsample_size.", "data", gt=0, advanced=True,
    )
    target_downsample_size: float | None = field(
        None, "Size that images above maximum_image_size are brought to before cropping.", "data", gt=0,
        advanced=True,
    )
    repeats: int = field(0, "Extra passes over this dataset per epoch (0: each image once).", "data", ge=0)
    cache_dir_vae: str | None = field(
        None, "Folder of cached latents. Empty: cache/vae/<family>/<id>.", "data"
    )
    metadata_backend: Literal["discovery"] = field(
        "discovery", "How sizes are found: 'discovery' scans the files.", "data", advanced=True
    )
    conditioning_data: str | None = field(
        None, "Id of a 'conditioning' dataset whose images pair with these by file name (image-to-image).",
        "data",
    )
    disabled: bool = field(False, "Leave this dataset out.", "data")

    @model_validator(mode="after")
    def _sizes(self) -> ImageDataset:
        if (self.maximum_image_size is None) != (self.target_downsample_size is None):
            raise ValueError("maximum_image_size and target_downsample_size go together: set both or neither")
        return self


class TextEmbedsDataset(BaseModel):
    """Where text embeddings are cached."""

    model_config = ConfigDict(extra="forbid")

    id: str = field(..., "Unique name of the entry.", "data", min_length=1)
    type: Literal["local"] = field("local", "Where the cache lives; only 'local'.", "data")
    dataset_type: Literal["text_embeds"] = field("text_embeds", "Kind of entry.", "data")
    default: bool = field(False, "Use this cache for every dataset.", "data")
    cache_dir: str = field(..., "Folder of cached text embeddings.", "data")
    write_batch_size: int = field(128, "Captions encoded per text-encoder pass.", "data", gt=0, advanced=True)
    disabled: bool = field(False, "Leave this entry out.", "data")


class ConditioningDataset(BaseModel):
    """Conditioning images (image-to-image): each pairs with the training image of the same file name."""

    model_config = ConfigDict(extra="forbid")

    id: str = field(..., "Unique name of the dataset; training sets name it in conditioning_data.", "data",
                    min_length=1)
    type: Literal["local"] = field("local", "Where the files live; only 'local' folders.", "data")
    dataset_type: Literal["conditioning"] = field("conditioning", "Kind of entry.", "data")
    instance_data_dir: str = field(..., "Folder of conditioning images, named like the training images.", "data")
    disabled: bool = field(False, "Leave this dataset out.", "data")


DatasetEntry = ImageDataset | TextEmbedsDataset | ConditioningDataset
DATASET_MODELS: dict[str, type[BaseModel]] = {
    "image": ImageDataset, "text_embeds": TextEmbedsDataset, "conditioning": ConditioningDataset,
}


class DatasetPlan(BaseModel):
    """The validated dataset list: the enabled image datasets and the text-embeds cache to use."""

    images: list[ImageDataset]
    text_embeds: TextEmbedsDataset | None
    conditioning: dict[str, ConditioningDataset] = {}

    def conditioning_dir(self, dataset: ImageDataset) -> str | None:
        if dataset.conditioning_data is None:
            return None
        return self.conditioning[dataset.conditioning_data].instance_data_dir
