"""Aspect buckets and crop geometry as pure functions (no I/O, no torch).

A bucket is the exact (width, height) in pixels that an image is brought to: both multiples of the
family's pixel multiple. Images of one bucket share a latent shape, so they can share a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SizeRule:
    resolution: float
    resolution_type: str  # "pixel" (short edge), "pixel_area" (side of a square of equal area), "area" (megapixels)
    crop: bool
    crop_aspect: str  # "square", "preserve", "closest", "random"; used when crop is true
    multiple: int
    minimum_image_size: float | None = None
    maximum_image_size: float | None = None
    target_downsample_size: float | None = None
    crop_aspect_buckets: tuple[float, ...] = ()
    minimum_aspect_ratio: float | None = None
    maximum_aspect_ratio: float | None = None
    # crop_aspect 'closest' / 'random': only the buckets that enlarge the image by at most this fraction (0.2: 20%)
    max_upscale_threshold: float | None = None


def measure(width: float, height: float, resolution_type: str) -> float:
    """An image's size in the unit of `resolution`: short edge, side of the square of equal area, or megapixels."""
    if resolution_type == "pixel":
        return float(min(width, height))
    if resolution_type == "area":
        return width * height / 1e6
    return math.sqrt(width * height)


def _round_multiple(value: float, multiple: int) -> int:
    return max(multiple, int(round(value / multiple)) * multiple)


def scaled_to(width: float, height: float, size: float, resolution_type: str) -> tuple[float, float]:
    """(width, height) scaled so that `measure` equals `size`, aspect kept."""
    ratio = size / measure(width, height, resolution_type)
    factor = math.sqrt(ratio) if resolution_type == "area" else ratio  # area grows with the square
    return width * factor, height * factor


def upscale(width: float, height: float, bucket: tuple[int, int]) -> float:
    """How many times an image is enlarged to cover its bucket (below 1: reduced)."""
    return max(bucket[0] / width, bucket[1] / height)


def picks_buckets(rule: SizeRule) -> bool:
    """Whether the image's aspect is picked from crop_aspect_buckets (crop_aspect 'closest' or 'random')."""
    return rule.crop and rule.crop_aspect in ("closest", "random")


def allowed_aspects(width: float, height: float, rule: SizeRule) -> list[float]:
    """crop_aspect_buckets, sorted, less those max_upscale_threshold rules out for an image of this size."""
    buckets = sorted(rule.crop_aspect_buckets)
    if rule.max_upscale_threshold is None:
        return buckets
    limit = 1 + rule.max_upscale_threshold + 1e-9
    return [b for b in buckets if upscale(width, height, aspect_bucket(b, rule)) <= limit]


def upscale_problem(width: float, height: float, rule: SizeRule) -> str | None:
    """Why an image is left out under max_upscale_threshold: every crop_aspect_bucket would enlarge it more."""
    if rule.max_upscale_threshold is None or not picks_buckets(rule) or allowed_aspects(width, height, rule):
        return None
    least = min(upscale(width, height, aspect_bucket(b, rule)) for b in rule.crop_aspect_buckets)
    return (f"{width:g}x{height:g} would be enlarged {least:.2f}x at least to fill a crop_aspect_bucket, more than "
            f"max_upscale_threshold {rule.max_upscale_threshold:g} allows ({1 + rule.max_upscale_threshold:g}x)")


def target_aspect(width: int, height: int, rule: SizeRule, choice: float = 0.5) -> float:
    """Aspect (width/height) the image is brought to. `choice` in [0, 1) picks for crop_aspect 'random'."""
    aspect = width / height
    if not rule.crop or rule.crop_aspect == "preserve":
        return aspect
    if rule.crop_aspect == "square":
        return 1.0
    buckets = allowed_aspects(width, height, rule) or sorted(rule.crop_aspect_buckets)  # none: upscale_problem
    if rule.crop_aspect == "closest":
        return min(buckets, key=lambda b: (abs(math.log(b / aspect)), b))
    return buckets[min(int(choice * len(buckets)), len(buckets) - 1)]


def aspect_bucket(aspect: float, rule: SizeRule) -> tuple[int, int]:
    """The (width, height) bucket of an aspect at the rule's resolution."""
    w, h = scaled_to(aspect, 1.0, rule.resolution, rule.resolution_type)
    return _round_multiple(w, rule.multiple), _round_multiple(h, rule.multiple)


def bucket_for(width: int, height: int, rule: SizeRule, choice: float = 0.5) -> tuple[int, int]:
    """The (width, height) bucket of an image of this size."""
    return aspect_bucket(target_aspect(width, height, rule, choice), rule)


def aspect_problem(width: int, height: int, rule: SizeRule) -> str | None:
    aspect = width / height
    if rule.minimum_aspect_ratio is not None and aspect < rule.minimum_aspect_ratio:
        return f"aspect {aspect:.2f} is below minimum_aspect_ratio {rule.minimum_aspect_ratio:g}"
    if rule.maximum_aspect_ratio is not None and aspect > rule.maximum_aspect_ratio:
        return f"aspect {aspect:.2f} is above maximum_aspect_ratio {rule.maximum_aspect_ratio:g}"
    return None


def too_small(width: int, height: int, rule: SizeRule) -> bool:
    return rule.minimum_image_size is not None and measure(width, height, rule.resolution_type) < rule.minimum_image_size


# The unit of resolution, minimum_image_size, maximum_image_size and target_downsample_size per resolution_type.
UNITS = {"pixel": "pixels of the short edge", "pixel_area": "pixels of the side of a square of equal area",
         "area": "megapixels"}


def in_unit(width: int, height: int, resolution_type: str) -> str:
    """An image's size with its measure in the unit of `resolution`: '96x96 = 0.00922 MP', '96x64 (short edge 64 px)'."""
    value = measure(width, height, resolution_type)
    if resolution_type == "area":
        return f"{width}x{height} = {value:.3g} MP"
    if resolution_type == "pixel":
        return f"{width}x{height} (short edge {value:g} px)"
    return f"{width}x{height} (a square of equal area has {value:.0f} px sides)"


def unit_of(rule: SizeRule) -> str:
    return f"{UNITS.get(rule.resolution_type, rule.resolution_type)}, as resolution_type is '{rule.resolution_type}'"


def too_small_problem(width: int, height: int, rule: SizeRule) -> str | None:
    """Why an image is below minimum_image_size, in the rule's unit, or None."""
    if not too_small(width, height, rule):
        return None
    return f"{in_unit(width, height, rule.resolution_type)} is below minimum_image_size {rule.minimum_image_size:g} " \
           f"({unit_of(rule)})"


def minimum_above_resolution(rule: SizeRule) -> str | None:
    """A warning when minimum_image_size is above resolution (both in one unit): every image smaller than the
    minimum is left out, though the training size is smaller still; often a minimum written in another unit
    (pixels with resolution_type 'area')."""
    if rule.minimum_image_size is None or rule.minimum_image_size <= rule.resolution:
        return None
    short = "MP" if rule.resolution_type == "area" else "px"
    return (f"minimum_image_size {rule.minimum_image_size:g} is above resolution {rule.resolution:g}, both in "
            f"{unit_of(rule)}: every image below {rule.minimum_image_size:g} {short} is left out, though the training "
            f"size is {rule.resolution:g} {short}; lower minimum_image_size (in the same unit) unless that is what you "
            "want")


def downsample_first(width: int, height: int, rule: SizeRule) -> tuple[int, int] | None:
    """Size to bring an oversized image to before bucketing (maximum_image_size), or None."""
    if rule.maximum_image_size is None or rule.target_downsample_size is None:
        return None
    if measure(width, height, rule.resolution_type) <= rule.maximum_image_size:
        return None
    w, h = scaled_to(width, height, rule.target_downsample_size, rule.resolution_type)
    return max(1, round(w)), max(1, round(h))


def cover_resize(width: int, height: int, bucket: tuple[int, int]) -> tuple[int, int]:
    """Smallest aspect-preserving size that covers the bucket (then cropped to it)."""
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    return max(bw, math.ceil(width * scale - 1e-6)), max(bh, math.ceil(height * scale - 1e-6))


def crop_box(width: int, height: int, bucket: tuple[int, int], style: str, u: float = 0.5, v: float = 0.5):
    """(left, top, right, bottom) of a bucket-sized crop from a width x height image.

    style 'center' ignores u, v; 'corner' takes the top-left; 'random' places the crop at fractions
    u, v in [0, 1] of the slack.
    """
    bw, bh = bucket
    if bw > width or bh > height:
        raise ValueError(f"crop {bw}x{bh} does not fit in {width}x{height}")
    if style == "center":
        u = v = 0.5
    elif style == "corner":
        u = v = 0.0
    left = int(round((width - bw) * u))
    top = int(round((height - bh) * v))
    return left, top, left + bw, top + bh
