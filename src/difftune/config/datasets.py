"""Schema of the dataset list (`multidatabackend.json`): a JSON list of image, video, conditioning and
text-embeds entries. Image and video datasets share one model (`ImageDataset`): captions, sizes, crops and
caching work the same; a video dataset adds its `video` block."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, field_validator, model_validator

from difftune.config.caption_shuffle_keys import CaptionShuffleOptions
from difftune.config.dataset_window_keys import DatasetSchedule
from difftune.config.fields import UnsetSpellings, expand_home, field, text_list
from difftune.config.generated_conditioning import GeneratedConditioning
from difftune.config.latent_cache_keys import ABOUT
from difftune.config.source_aws_keys import AwsSource
from difftune.config.source_csv_keys import CsvSource
from difftune.config.source_huggingface_keys import HuggingfaceSource


class ParquetCaptions(UnsetSpellings):  # "" and "none" as null, as in config.json
    """Captions (and optionally sizes) from a parquet or JSONL table instead of files beside the images."""

    model_config = ConfigDict(extra="forbid")

    path: str = field(..., "Parquet (.parquet) or JSON Lines (.jsonl) file; relative paths are tried "
                      "against instance_data_dir first.", "data")

    @field_validator("path", mode="before")
    @classmethod
    def _path_from_home(cls, v: object) -> object:
        return expand_home(v)
    filename_column: str = field("filename", "Column holding each image's file name (or id).", "data")
    caption_column: str = field("caption", "Column holding the caption (a string or a list of captions).", "data")
    fallback_caption_column: str | None = field(None, "Column used when the caption is empty.", "data")
    width_column: str | None = field(None, "Column with the image width (skips reading the file).", "data")
    height_column: str | None = field(None, "Column with the image height (skips reading the file).", "data")
    identifier_includes_extension: bool = field(
        True, "The file-name column includes the extension; if not, any image extension matches.", "data"
    )


def four_k_plus_one(n: int) -> str:
    """The two nearest frame counts the video VAE accepts ((frames - 1) % 4 == 0), for error messages."""
    low = (n - 1) // 4 * 4 + 1
    return f"{low} or {low + 4}" if low >= 1 else "1 or 5"


class VideoOptions(UnsetSpellings):  # "" and "none" as null, as in config.json
    """How clips become training samples (the `video` block of a video dataset)."""

    model_config = ConfigDict(extra="forbid")

    num_frames: int = field(
        61, "Frames per training clip (4k+1: 33, 49, 61, ...). bucket_strategy 'aspect_ratio': every clip "
        "trains on exactly this many; 'resolution_frames': the most a clip trains on.", "data", ge=1,
    )
    min_frames: int | None = field(
        None, "Clips with fewer frames (after resampling to frame_rate) are left out and reported.", "data", ge=1
    )
    max_frames: int | None = field(
        None, "Clips with more frames (after resampling to frame_rate) are left out and reported.", "data", ge=1
    )
    frame_rate: float | None = field(
        None, "Clips are resampled to this many frames per second (each frame the clip's nearest by timestamp, so "
        "variable frame rates work; a clip within 0.5% of it, such as 23.976 fps for 24, keeps every frame). Empty: "
        "the config's frame_rate (24 by default).", "data", gt=0,
    )
    bucket_strategy: Literal["aspect_ratio", "resolution_frames"] = field(
        "aspect_ratio", "'aspect_ratio': clips are grouped by shape only, all num_frames long (shorter clips are "
        "left out). 'resolution_frames': grouped by WxH@F, each clip as long as it is (up to num_frames), "
        "rounded down by frame_interval.", "data",
    )
    frame_interval: int = field(
        4, "With 'resolution_frames': frame counts are rounded down to 1 + a multiple of this (and of 4).",
        "data", ge=1, advanced=True,
    )
    is_i2v: bool | None = field(
        None, "SimpleTuner's image-to-video switch. Here the flavour decides: an i2v flavour trains every clip "
        "image-to-video. true is refused with a text-to-video flavour; false with an i2v flavour is overridden "
        "(as SimpleTuner does) with a note.", "data", advanced=True,
    )

    @model_validator(mode="after")
    def _frames(self) -> VideoOptions:
        if (self.num_frames - 1) % 4:
            raise ValueError(f"num_frames {self.num_frames} is not 4k+1 (the VAE compresses time 4x); use "
                             f"{four_k_plus_one(self.num_frames)}")
        step = math.lcm(4, self.frame_interval)
        if self.bucket_strategy == "resolution_frames" and 1 < self.num_frames < 1 + step:
            # counts round down to 1 + a multiple of step, and num_frames caps them: every clip would be a still
            divisors = [i for i in range(self.frame_interval, 0, -1) if (self.num_frames - 1) % math.lcm(4, i) == 0]
            raise ValueError(
                f"num_frames {self.num_frames} with frame_interval {self.frame_interval}: frame counts are 1 + a "
                f"multiple of {step} (of 4 and of {self.frame_interval}), so every clip would train on 1 frame; "
                f"use num_frames {1 + step} or more" + (f", or frame_interval {divisors[0]}" if divisors else ""))
        if self.min_frames is not None and self.max_frames is not None and self.min_frames > self.max_frames:
            raise ValueError("min_frames is larger than max_frames")
        if self.bucket_strategy == "aspect_ratio" and self.frame_interval != type(self).model_fields["frame_interval"].default:
            raise ValueError("frame_interval applies to bucket_strategy 'resolution_frames' (with 'aspect_ratio' "
                             "every clip has num_frames frames); remove it or change bucket_strategy")
        if self.bucket_strategy == "aspect_ratio" and self.max_frames is not None and self.max_frames < self.num_frames:
            raise ValueError(f"max_frames {self.max_frames} is below num_frames {self.num_frames}: with "
                             "bucket_strategy 'aspect_ratio' every clip needs num_frames frames; lower num_frames")
        return self


# Dataset types whose files are downloaded into instance_data_dir before discovery (data/sources/).
REMOTE_TYPES = ("huggingface", "csv", "aws")


def safe_id(value: str) -> str:
    """A dataset id names a folder (the default latent cache is cache/vae/<family>/<id>): no path parts."""
    if value in (".", "..") or any(c in value for c in "/\\\0"):
        raise ValueError(f"id {value!r} names a cache folder: it may not contain '/', '\\' or NUL, nor be "
                         "'.' or '..'; use letters, digits, '-' and '_'")
    return value


def folder_given(value: object) -> object:
    """An empty instance_data_dir would read the working folder: whatever images lie there would train."""
    if isinstance(value, str) and not value.strip():
        raise ValueError("instance_data_dir is empty, which would read the folder difftune runs in; give the folder "
                         "of the images")
    return value


class ImageDataset(HuggingfaceSource, CsvSource, AwsSource, DatasetSchedule, UnsetSpellings):
    """A folder of images (or, with dataset_type 'video', of clips) with captions. dataset_type 'eval': held-out
    images (or clips, with a video block) that are never trained on: train/eval_loss.py measures the loss on them."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # resolution inf passed gt=0
    # optional keys whose text may be the word "none" itself (a prompt, a name, a column): only "" or null unsets them
    FREE_TEXT = frozenset(("instance_prompt", "dataset_name", "dataset_config", "data_files", "revision",
                           "csv_caption_column", "fallback_caption_column", "aws_bucket_name", "aws_access_key_id",
                           "aws_secret_access_key", "aws_session_token"))

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        return safe_id(v)

    @field_validator("crop_aspect_buckets", mode="before")
    @classmethod
    def _buckets_text(cls, value: object) -> object:
        return text_list(value)  # the config-level default as the command line gives it: '0.75,1.0'

    id: str = field(..., "Unique name of the dataset (used in reports and cache paths).", "data", min_length=1)
    type: Literal["local", "huggingface", "csv", "aws"] = field(
        "local", "Where the files live: 'local' (a folder), 'huggingface' (a dataset on the Hugging Face hub or in "
        "a local folder in its layout), 'csv' (a table of image URLs or paths and captions) or 'aws' (an S3 bucket). "
        "The other types are downloaded into instance_data_dir before discovery, with a caption file beside each "
        "image, and then train like a local folder.", "data",
    )
    dataset_type: Literal["image", "video", "eval"] = field(
        "image", "Kind of entry: 'image', or 'video' (.mp4, .mov, .webm, .mkv, .avi, .m4v, .mpg, .mpeg; see the video block), or 'eval': "
        "held-out images (clips, with a video block) never trained on, cached like the others, on which the "
        "evaluation loss is measured (eval_timesteps; eval_loss_disable turns it off).", "data"
    )
    instance_data_dir: str = field(
        ..., "Folder of images or clips; sub-folders are searched too. For type 'huggingface', 'csv' or 'aws': the "
        "folder the files are downloaded into (default: cache/sources/<id>, or csv_cache_dir).", "data",
    )
    video: VideoOptions | None = field(
        None, "Video datasets: frame counts, frame rate and bucketing (defaults apply when left out).", "data"
    )
    caption_strategy: Literal["textfile", "filename", "instanceprompt", "parquet", "huggingface", "csv"] = field(
        "textfile",
        "'textfile': a .txt beside each image with the same name; each non-empty line is a caption, one "
        "drawn per sample. 'filename': the file name without its extension, each _ a space (hyphens kept, as in "
        "SimpleTuner). 'instanceprompt': instance_prompt for every image. 'parquet': a table (see parquet). 'huggingface' and 'csv': the caption "
        "column of a type 'huggingface' or 'csv' dataset (written as caption files when it is downloaded).",
        "data",
    )
    instance_prompt: str | None = field(None, "Caption (or trigger word) used by the instance-prompt options.", "data")
    prepend_instance_prompt: bool = field(False, "Put instance_prompt before every caption.", "data", advanced=True)
    only_instance_prompt: bool = field(False, "Replace every caption by instance_prompt.", "data", advanced=True)
    parquet: ParquetCaptions | None = field(None, "Table of captions for caption_strategy 'parquet'.", "data",
                                            advanced=True)
    resolution: float = field(1024, "Training size; its meaning depends on resolution_type.", "data", gt=0)
    resolution_type: Literal["pixel", "pixel_area", "area"] = field(
        "pixel_area",
        "'pixel': resolution is the short edge in pixels. 'pixel_area': images keep their aspect ratio "
        "at the area of a resolution x resolution square. 'area': the same, in megapixels (1.05 ~ 1024x1024).",
        "data",
    )
    crop: bool = field(False, "Crop images to crop_aspect (otherwise only trimmed to the bucket size).", "data")
    crop_style: Literal["center", "random", "corner"] = field(
        "center", "Where crops are taken from: the centre, a random place (drawn once per image and seed), "
        "or the top-left corner.", "data",
    )
    crop_aspect: Literal["square", "preserve", "closest", "random"] = field(
        "square", "With crop: 'square' (1:1), 'preserve' (each image's own aspect), 'closest' (the entry of "
        "crop_aspect_buckets nearest the image's), 'random' (an entry drawn once per image and seed).", "data",
    )
    crop_aspect_buckets: list[float] | None = field(
        None, "Aspect ratios (width/height) for crop_aspect 'closest' and 'random'.", "data", advanced=True
    )
    minimum_aspect_ratio: float | None = field(
        None, "Images narrower than this width/height are left out and reported.", "data", gt=0, advanced=True
    )
    maximum_aspect_ratio: float | None = field(
        None, "Images wider than this width/height are left out and reported.", "data", gt=0, advanced=True
    )
    minimum_image_size: float | None = field(
        None, "Images whose short edge (pixel) or area (pixel_area) is smaller are left out and reported (0: no "
        "minimum, not even the enlargement limit).", "data", ge=0, advanced=True,
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
    probability: float | None = field(
        None, "Relative weight of this dataset when several are mixed (each batch comes from one dataset): with "
        "data_backend_sampling 'auto-weighting' (the default) it scales the dataset's share of the images, with "
        "'uniform' it is the weight itself. Empty: 1.", "data", gt=0, advanced=True,
    )
    max_num_samples: int | None = field(
        None, "Use at most this many images: a fixed random subset (seeded by the dataset id).", "data", gt=0,
        advanced=True,
    )
    text_embeds: str | None = field(
        None, "Id of the text_embeds entry caching this dataset's captions. Empty: the default one.", "data",
        advanced=True,
    )
    vae_cache_disable: bool = field(
        False, "Encode this dataset's images on the fly during training; write no latents.", "data", advanced=True
    )
    vae_cache_ondemand: bool | None = field(
        None, ABOUT + " Unset: the config's vae_cache_ondemand. Not with this dataset's vae_cache_disable or "
        "vae_cache_clear_each_epoch, nor on an eval dataset.", "data", advanced=True,
    )
    vae_cache_clear_each_epoch: bool = field(
        False, "With crop: true and crop_style 'random': draw a new random crop of every image (or clip) each epoch "
        "of this dataset, instead of one crop per image and seed kept for the whole run. Its latents are then encoded "
        "during training (as with vae_cache_disable), once per use: the cost of re-caching them every epoch without "
        "the disk. The crop's position changes; its aspect (and so its bucket) stays the one drawn per image and seed, "
        "also with crop_aspect 'random'. With a crop that is not random (center, corner, crop: false) every "
        "epoch would encode the same latents: it is switched off with a note.", "data", advanced=True,
    )
    cache_dir_vae: str | None = field(
        None, "Folder of cached latents. Empty: cache/vae/<family>/<id>.", "data"
    )
    metadata_backend: Literal["discovery", "json", "parquet", "huggingface"] = field(
        "discovery", "How sizes are found: 'discovery' scans the files (their sizes are kept in a metadata file, so "
        "a second start reads only changed files); 'json' is SimpleTuner's older name for it. 'parquet' (with "
        "caption_strategy 'parquet'): sizes come from the table's parquet.width_column and parquet.height_column, "
        "so the files are not opened to measure them (the sizes as displayed: a file that decodes to another size, an "
        "EXIF-rotated photo's stored size, is left out while caching). 'huggingface' (type 'huggingface' only, as SimpleTuner "
        "writes it) is 'discovery' here: the dataset is downloaded first and its files are scanned.",
        "data", advanced=True,
    )
    conditioning_data: str | None = field(
        None, "Id of a 'conditioning' dataset whose images pair with these by file name (image-to-image).",
        "data",
    )
    conditioning: list[dict[str, Any]] | dict[str, Any] | None = field(
        None, "Input images generated from these images, for an image-to-image flavour (SimpleTuner's generated "
        "conditioning), instead of conditioning_data: one generator, such as [{\"type\": \"canny\"}]. Types: canny "
        "(low_threshold, high_threshold), superresolution (blur_radius, noise_level, downscale_factor, ...), "
        "jpeg_artifacts (quality, quality_mode, ...), random_masks (output_mode 'mask' or 'masked_image', "
        "min_coverage, max_coverage, ...); made before training into "
        "cache/conditioning_data/<id>_conditioning_<type>-<digest of the images' folder> (or the generator's "
        "instance_data_dir).", "data",
        advanced=True,
    )
    is_regularisation_data: bool = field(
        False, "Regularisation (prior preservation) data, e.g. generic photos of the subject's class: with a LoRA "
        "or LyCORIS adapter its samples are trained towards the base model's own prediction (the adapter switched "
        "off, same noisy input, no gradient) instead of towards their image, so the adapter learns to leave such "
        "prompts as the base model draws them. Also spelt is_regularization_data. Refused for a full fine-tune, "
        "where SimpleTuner trains it as ordinary data (no frozen base model is left to ask): remove it there.",
        "data", advanced=True,
    )
    disabled: bool = field(False, "Leave this dataset out. Also spelt disable.", "data")
    disable_multiline_split: bool = field(
        False, "caption_strategy 'textfile': the whole caption file is one caption, line breaks kept (by default each "
        "non-empty line is a caption of its own).", "data", advanced=True,
    )
    max_upscale_threshold: float | None = field(
        None, "With crop_aspect 'closest' or 'random': only the crop_aspect_buckets that enlarge an image by at most "
        "this fraction (0.2: 20%) are picked from; an image that every bucket would enlarge more is left out. "
        "Empty: no limit.", "data", ge=0, advanced=True,
    )
    caption_shuffle: CaptionShuffleOptions | None = field(
        None, "Shuffled variants of tag captions ({\"enable\": true, \"count\": 3, \"position_start\": 1}): each "
        "caption's tags in other orders, encoded before training with the caption, one drawn per sample, so the "
        "model does not learn one tag order.", "data", advanced=True,
    )
    compress_cache: bool | None = field(
        None, "Write this dataset's latents compressed (true) or plain (false). Empty: compress_disk_cache.", "data",
        advanced=True,
    )

    @field_validator("instance_data_dir", "cache_dir_vae", "cache_dir", "csv_file", "csv_cache_dir", "dataset_name",
                     mode="before")
    @classmethod
    def _entry_paths_from_home(cls, v: object) -> object:
        return expand_home(v)  # `~/data` is the home folder's data, as in a shell

    @field_validator("instance_data_dir")
    @classmethod
    def _folder_given(cls, v: object) -> object:
        return folder_given(v)

    @field_validator("crop_style", mode="before")
    @classmethod
    def _entry_crop_style_centre(cls, v: object) -> object:
        return "center" if v == "centre" else v  # SimpleTuner takes both spellings

    @field_validator("repeats", mode="before")
    @classmethod
    def _entry_repeats_null(cls, v: object) -> object:
        return 0 if v is None else v  # SimpleTuner reads a null (or 0) as no repeats

    @model_validator(mode="before")
    @classmethod
    def _source_folder(cls, data: object) -> object:
        """A downloaded dataset's folder defaults to cache/sources/<id> (csv: csv_cache_dir, as in SimpleTuner)."""
        if isinstance(data, dict) and data.get("type") in REMOTE_TYPES and not data.get("instance_data_dir"):
            folder = data.get("csv_cache_dir") if data.get("type") == "csv" else None
            data = {**data, "instance_data_dir": folder or f"cache/sources/{data.get('id')}"}
        return data

    @field_validator("is_regularisation_data", mode="before")
    @classmethod
    def _regularisation_null(cls, v: object) -> object:
        return False if v is None else v  # SimpleTuner writes null for "not set"

    @field_validator("vae_cache_clear_each_epoch", mode="before")
    @classmethod
    def _clear_each_epoch_null(cls, v: object) -> object:
        return False if v is None else v  # SimpleTuner writes null for "not set"

    @model_validator(mode="after")
    def _consistent(self) -> ImageDataset:
        if self.video is not None and self.dataset_type not in ("video", "eval"):
            raise ValueError("the video block applies to dataset_type 'video' (or 'eval': held-out clips); set "
                             "dataset_type or remove it")
        if self.dataset_type == "video" and self.video is None:
            self.video = VideoOptions()
        if self.dataset_type == "video" and self.conditioning_data is not None:
            raise ValueError("conditioning_data pairs images (input images or loss masks) with images; image-to-video "
                             "flavours take each clip's first frame as the input image by themselves, and loss masks "
                             "are for image datasets only: remove conditioning_data")
        if self.resolution_type == "area" and self.resolution >= 16:
            side = round((self.resolution * 1e6) ** 0.5)
            raise ValueError(f"resolution {self.resolution:g} with resolution_type 'area' is {self.resolution:g} "
                             f"megapixels (about {side}x{side} pixels); for {self.resolution:g}x{self.resolution:g} "
                             f"pixels set resolution_type 'pixel_area' (or keep 'area' with resolution "
                             f"{self.resolution ** 2 / 1e6:.2f})")
        if (self.maximum_image_size is None) != (self.target_downsample_size is None):
            raise ValueError("maximum_image_size and target_downsample_size go together: set both or neither")
        needs_prompt = self.caption_strategy == "instanceprompt" or self.prepend_instance_prompt or self.only_instance_prompt
        if needs_prompt and not self.instance_prompt:
            raise ValueError("instance_prompt is required by caption_strategy 'instanceprompt', "
                             "prepend_instance_prompt and only_instance_prompt; set it")
        if self.caption_strategy in REMOTE_TYPES and self.caption_strategy != self.type:
            raise ValueError(f"caption_strategy {self.caption_strategy!r} reads the captions of a type "
                             f"{self.caption_strategy!r} dataset; this one is type {self.type!r}: use 'textfile' "
                             f"or set type to {self.caption_strategy!r}")
        if self.metadata_backend == "parquet" and (
            self.caption_strategy != "parquet" or self.parquet is None
            or not (self.parquet.width_column and self.parquet.height_column)
        ):
            raise ValueError("metadata_backend 'parquet' reads each image's size from the caption table: use "
                             "caption_strategy 'parquet' with a parquet block that sets width_column and "
                             "height_column, or set metadata_backend to 'discovery' (the files are measured)")
        if self.caption_strategy == "parquet" and self.parquet is None:
            raise ValueError("caption_strategy 'parquet' needs a parquet block: {\"path\": ..., \"caption_column\": ...}")
        if self.crop and self.crop_aspect in ("closest", "random") and not self.crop_aspect_buckets:
            raise ValueError(f"crop_aspect {self.crop_aspect!r} picks from crop_aspect_buckets; give a list such as [0.75, 1.0, 1.33]")
        if self.crop_aspect_buckets and any(a <= 0 for a in self.crop_aspect_buckets):
            raise ValueError("crop_aspect_buckets must be positive width/height ratios")
        self._check_clear_each_epoch()
        self._check_ondemand()
        lo, hi = self.minimum_aspect_ratio, self.maximum_aspect_ratio
        if lo is not None and hi is not None and lo > hi:
            raise ValueError("minimum_aspect_ratio is larger than maximum_aspect_ratio")
        return self

    _clear_each_epoch_off: str | None = PrivateAttr(None)  # why vae_cache_clear_each_epoch was switched off

    def _check_clear_each_epoch(self) -> None:
        """vae_cache_clear_each_epoch needs a crop whose position is drawn (data/latents.crop_position): with any
        other, every epoch would encode the same latents, at the cost of encoding them during training."""
        if not self.vae_cache_clear_each_epoch:
            return
        key = f"vae_cache_clear_each_epoch on dataset {self.id!r}"
        if self.dataset_type == "eval":
            raise ValueError(f"{key}: an eval dataset is measured on the same crops every time; remove it")
        if not self.crop or self.crop_style != "random":
            # SimpleTuner's own DATALOADER.md example sets it with crop false: only time is lost, so it is switched
            # off with a note (config/dataset_entry_keys.notes) rather than refused
            what = "crop is false" if not self.crop else f"crop_style is {self.crop_style!r}"
            aspect = (" (crop_aspect 'random' draws each image's aspect, and so its bucket, once per image and seed "
                      "here, not each epoch)" if self.crop and self.crop_aspect == "random" else "")
            self.vae_cache_clear_each_epoch = False
            self._clear_each_epoch_off = (
                f"{key}: {what}, so every epoch would encode the same crops{aspect}: the latents are cached once "
                "instead (the same result, without encoding during training); set crop to true and crop_style to "
                "'random' for a new crop each epoch, or remove vae_cache_clear_each_epoch")

    def _check_ondemand(self) -> None:
        if not self.vae_cache_ondemand:
            return
        key = f"vae_cache_ondemand on dataset {self.id!r}"
        if self.dataset_type == "eval":
            raise ValueError(f"{key}: an eval dataset is cached before training (its loss is measured on every item "
                             "each time); remove it")
        for other in ("vae_cache_disable", "vae_cache_clear_each_epoch"):
            if getattr(self, other):
                raise ValueError(f"{key} with its {other}: that encodes on the fly and writes no latents, "
                                 "vae_cache_ondemand writes each one as it is first encoded; keep one")

    def vae_cache_root(self, family: str) -> str:
        return self.cache_dir_vae or f"cache/vae/{family}/{self.id}"


class TextEmbedsDataset(UnsetSpellings):  # "" and "none" as null, as in config.json
    """Where text embeddings are cached."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        return safe_id(v)

    @field_validator("cache_dir", "caption_filter_list", mode="before")
    @classmethod
    def _paths_from_home(cls, v: object) -> object:
        return expand_home(v)  # a filter list's file path; a list of filters is left alone

    id: str = field(..., "Unique name of the entry.", "data", min_length=1)
    type: Literal["local"] = field("local", "Where the cache lives; only 'local'.", "data")
    dataset_type: Literal["text_embeds"] = field("text_embeds", "Kind of entry.", "data")
    default: bool = field(False, "Use this cache for every dataset.", "data")
    cache_dir: str | None = field(
        None, "Folder of cached text embeddings. Empty: cache/text/<model_family> (SimpleTuner's example writes \"\").",
        "data")
    write_batch_size: int = field(
        128, "Captions encoded per text-encoder pass, unless text_encoder_batch_size is set. (SimpleTuner batches its "
        "cache writes by it; here each embedding is written as its own file.)", "data", gt=0, advanced=True,
    )
    text_encoder_batch_size: int | None = field(
        None, "Captions encoded per text-encoder pass (prompts with an input image go one at a time). Empty: "
        "write_batch_size.", "data", gt=0, advanced=True,
    )
    compress_cache: bool | None = field(
        None, "Write these text embeddings compressed (true) or plain (false). Empty: compress_disk_cache.", "data",
        advanced=True,
    )
    caption_filter_list: list[str] | str | None = field(
        None, "Filters for the captions this entry caches: a path to a .txt file (one filter a line, kept as written "
        "but for the line break) or a .json file (a list of strings), or the list itself. A relative path is taken "
        "from the working folder. They apply in order to every caption of every dataset using this entry (as in "
        "SimpleTuner, where the key lives on the text_embeds entry); instance_prompt and the validation prompts "
        "are not filtered. A filter 's/find/replace/' replaces the first match of the regular expression "
        "find (flags after the last '/': g every match, i ignore case; \\1 for a group, \\/ for a '/'); any "
        "other filter is removed where it occurs as written, then wherever it matches as a regular expression "
        "('arafed ', '(blurry)', '^there is', 'this .* has a'). A caption a filter changed is tidied (runs of spaces "
        "as one, ends stripped); one it empties is left out when its file has other lines, else trained as an empty "
        "caption, with a note in the data report. Each "
        "caption's text embedding is cached by its text, so changing the list encodes only the captions it "
        "changes.", "data", advanced=True,
    )
    disabled: bool = field(False, "Leave this entry out. Also spelt disable.", "data")

    @model_validator(mode="after")
    def _caption_filters(self) -> TextEmbedsDataset:
        """Every filter read and checked now, before any model loads (not on a disabled entry, whose files are
        not looked at, as a disabled dataset's folder is not)."""
        from difftune.config.caption_filter_keys import OFF, build

        if any(self.caption_filter_list == off for off in OFF):
            self.caption_filter_list = None
        elif not self.disabled:
            try:
                build(self.caption_filter_list)
            except ValueError as e:
                raise ValueError(f"caption_filter_list: {e}") from e
        return self

    def encode_batch(self) -> int:
        """Captions per text-encoder pass."""
        return self.text_encoder_batch_size or self.write_batch_size


class ConditioningDataset(UnsetSpellings):  # "" and "none" as null, as in config.json
    """Conditioning images (image-to-image): each pairs with the training image of the same file name."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        return safe_id(v)

    @field_validator("instance_data_dir", mode="before")
    @classmethod
    def _paths_from_home(cls, v: object) -> object:
        return folder_given(expand_home(v))

    id: str = field(..., "Unique name of the dataset; training sets name it in conditioning_data.", "data",
                    min_length=1)
    type: Literal["local"] = field("local", "Where the files live; only 'local' folders.", "data")
    dataset_type: Literal["conditioning"] = field("conditioning", "Kind of entry.", "data")
    instance_data_dir: str = field(..., "Folder of conditioning images, named like the training images.", "data")
    conditioning_type: Literal["reference_strict", "mask"] = field(
        "reference_strict", "'reference_strict': input images of image-to-image flavours, pixel-aligned with their "
        "targets. 'mask': loss masks (train/masked_loss.py): white is trained, black ignored, grey weighs in between "
        "(the red channel, 0..255 -> 0..1); each mask gets its image's resize and crop, is averaged over each latent "
        "cell, and multiplies the per-element loss, which is still averaged over every element (not over the mask's "
        "area), as in SimpleTuner. A mask of another size than its image is stretched to the image's size first. "
        "An image without a mask of the same name is left out and reported. Images only (not video datasets), and "
        "not with an image-to-image flavour (a dataset names one conditioning dataset).", "data",
    )
    source_dataset_id: str | None = field(
        None, "The image dataset these images pair with (SimpleTuner's link for pixel alignment). Pairs are made by "
        "that dataset's conditioning_data; when set, it must name a dataset whose conditioning_data names this "
        "entry.", "data", advanced=True,
    )
    disabled: bool = field(False, "Leave this dataset out. Also spelt disable.", "data")


DatasetEntry = ImageDataset | TextEmbedsDataset | ConditioningDataset
DATASET_MODELS: dict[str, type[BaseModel]] = {
    "image": ImageDataset, "video": ImageDataset, "eval": ImageDataset, "text_embeds": TextEmbedsDataset,
    "conditioning": ConditioningDataset,
}


class DatasetPlan(BaseModel):
    """The validated dataset list: the enabled image and video datasets and the text-embeds cache to use.
    `validation_only`: image datasets an image-to-video run uses only as validation input images. `evaluation`: the
    dataset_type 'eval' entries (held out: cached, never trained on; train/eval_loss.py)."""

    images: list[ImageDataset]
    evaluation: list[ImageDataset] = []
    validation_only: dict[str, ImageDataset] = {}
    text_embeds: TextEmbedsDataset | None  # the default entry
    conditioning: dict[str, ConditioningDataset] = {}
    all_text_embeds: dict[str, TextEmbedsDataset] = {}
    # conditioning id -> the generator making its images (config/generated_conditioning.py), for `conditioning`
    generated: dict[str, GeneratedConditioning] = {}
    notes: list[str] = []  # what the loader chose for the user (the default text cache), printed by check

    def discovered(self) -> list[ImageDataset]:
        """Every dataset discovered and cached at start-up: the trained ones first, then the eval ones."""
        return [*self.images, *self.evaluation]

    def text_embeds_for(self, dataset: ImageDataset) -> TextEmbedsDataset | None:
        if dataset.text_embeds is not None:  # a name of no entry: load_datasets reported it; None here
            return self.all_text_embeds.get(dataset.text_embeds)
        return self.text_embeds

    def text_cache_root(self, dataset: ImageDataset, family: str) -> str:
        """The folder of a dataset's text cache: its text_embeds entry's cache_dir, else cache/text/<family>
        (the trainer opens it; the web UI confines it without opening it)."""
        entry = self.text_embeds_for(dataset)
        return entry.cache_dir if entry and entry.cache_dir else f"cache/text/{family}"

    def metadata_file(self, dataset: ImageDataset, family: str) -> Path:
        """The file of a dataset's probed image sizes, in its latent cache folder. Datasets sharing one
        cache_dir_vae get one file each: in one file each dataset's scan pruned the other's entries, so every
        start probed every file again."""
        root = dataset.vae_cache_root(family)
        shared = any(other is not dataset and os.path.abspath(other.vae_cache_root(family)) == os.path.abspath(root)
                     for other in [*self.discovered(), *self.validation_only.values()])
        return Path(root) / (f"metadata-{dataset.id}.json" if shared else "metadata.json")

    def conditioning_dir(self, dataset: ImageDataset) -> str | None:
        """The folder of a dataset's input images (image-to-image), or None (a mask dataset is no input)."""
        entry = self.conditioning.get(dataset.conditioning_data) if dataset.conditioning_data else None
        return entry.instance_data_dir if entry is not None and entry.conditioning_type != "mask" else None

    def mask_dir(self, dataset: ImageDataset) -> str | None:
        """The folder of a dataset's loss masks (conditioning_type 'mask'), or None."""
        entry = self.conditioning.get(dataset.conditioning_data) if dataset.conditioning_data else None
        return entry.instance_data_dir if entry is not None and entry.conditioning_type == "mask" else None
