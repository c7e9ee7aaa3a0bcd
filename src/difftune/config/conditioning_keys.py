"""Image settings written on a conditioning entry (input images of image-to-image flavours, loss masks).

SimpleTuner's examples (its Dreambooth masked-loss example among them) give a conditioning entry the same size and
crop settings as the image dataset it pairs with, plus caption and cache keys. In difftune a conditioning image
always takes its training image's geometry (the same resize and crop, pixel for pixel), so:
- a size or crop setting (`MIRRORED`) is accepted when it says what every image dataset naming the entry says, and
  refused, naming both datasets, when it differs: there it would promise a geometry the pair cannot have;
- a caption or cache setting (`UNUSED`) is accepted with a note saying it is not used: the captions and the cache
  are the training images' (a conditioning entry has neither).
`split` takes these keys out of a raw entry before it is validated; `check` compares them once every entry is read.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

MIRRORED = ("resolution", "resolution_type", "minimum_image_size", "maximum_image_size", "target_downsample_size",
            "crop", "crop_style", "crop_aspect", "crop_aspect_buckets")
UNUSED = ("caption_strategy", "instance_prompt", "only_instance_prompt", "prepend_instance_prompt", "cache_dir_vae",
          "cache_file_suffix", "disable_multiline_split", "compress_cache")


def split(entry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(the entry without them, its mirrored settings, the unused keys it had)."""
    mirrored = {k: v for k, v in entry.items() if k in MIRRORED}
    unused = [k for k in entry if k in UNUSED]
    return {k: v for k, v in entry.items() if k not in mirrored and k not in unused}, mirrored, unused


def check(path: Any, mirrored: dict[str, dict[str, Any]], unused: dict[str, list[str]], images: list[Any],
          problems: list[str], notes: list[str]) -> None:
    """`mirrored` / `unused`: by conditioning entry id; `images`: the validated image, video and eval datasets."""
    from difftune.config.datasets import ImageDataset

    for ident, keys in unused.items():
        if keys:
            notes.append(f"{path}: conditioning dataset {ident!r}: {', '.join(keys)} not used: a conditioning image "
                         "pairs with the training image of the same name, whose dataset holds the captions and the "
                         "cache")
    for ident, settings in mirrored.items():
        for ds in (ds for ds in images if ds.conditioning_data == ident):
            for key, given in settings.items():
                try:  # read as the image entry would read it (its validators: "true", 0 for none, ...)
                    value = getattr(ImageDataset.model_validate(ds.model_dump() | {key: given}), key)
                except ValidationError:
                    problems.append(f"{path}: conditioning dataset {ident!r}: {key}: {given!r} is not a valid {key}; "
                                    "remove it (conditioning images take their training image's size and crop)")
                    continue
                if getattr(ds, key) != value:
                    problems.append(
                        f"{path}: conditioning dataset {ident!r}: {key} {given!r} differs from {_plain(getattr(ds, key))!r} "
                        f"on dataset {ds.id!r}; a conditioning image takes its training image's size and crop, so "
                        f"remove {key} here or set it as on {ds.id!r}")


def _plain(value: Any) -> Any:
    """A value as the user would write it: a resolution kept as a float (64.0) shows as 64."""
    return int(value) if isinstance(value, float) and value.is_integer() else value
