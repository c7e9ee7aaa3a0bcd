"""Generated conditioning datasets: SimpleTuner's `"conditioning": [{"type": "canny"}]` on an image dataset entry.

Instead of a folder of input images made by hand, an image-to-image run can have them made from the training
images: edge maps (`canny`), degraded copies (`superresolution`: blurred, noised, optionally downscaled; and
`jpeg_artifacts`: compressed at a low quality), random masks or the image with them painted white
(`random_masks`, for inpainting). The entry then pairs with a conditioning dataset of id
`<dataset id>_conditioning_<type>` (SimpleTuner's id) whose images are generated into its folder
(`instance_data_dir` on the generator entry, default `cache/conditioning_data/<that id>`) before discovery, by
data/generated_conditioning.py.

What differs from SimpleTuner, on purpose:
- each image is generated from a seed of its own (the dataset and file name), so a second machine, a resumed run or a
  regenerated folder gets the same degraded image; SimpleTuner's draws follow its worker processes' order;
- the folder records the settings it was generated with: changed settings (or a changed source image) generate it
  again. SimpleTuner generates once and keeps the images until the folder is deleted by hand;
- the images are PNG whatever the source's format (a canny map or a JPEG-quality-10 image saved as a .jpg again at
  another quality is not what was asked for).
SimpleTuner's keys on a generator entry that do not change a single-conditioning run are accepted with a note:
`captions` (SimpleTuner uses them only when it draws one of several conditioning datasets at random; with one, the
pair trains with the image's own caption), `caption_strategy` and `instance_prompt` (the conditioning dataset's own
captions, which nothing trains on). Generators that need models (depth, segmentation, optical flow) and the HDR
ones are refused with what to do instead.

Import-light: no torch, no image libraries.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# SimpleTuner's spellings of each generator type -> the one here
KINDS = {"canny": "canny", "edges": "canny",
         "superresolution": "superresolution", "super_resolution": "superresolution", "lowres": "superresolution",
         "jpeg_artifacts": "jpeg_artifacts", "jpeg": "jpeg_artifacts", "compression": "jpeg_artifacts",
         "random_masks": "random_masks", "masks": "random_masks", "inpainting": "random_masks"}
_MAKE_THEM = ("; make the images yourself, put them in a folder named like the training images, add a "
              "dataset_type 'conditioning' entry for it and name that entry in conditioning_data")
NOT_YET = {
    **dict.fromkeys(("depth", "depth_map", "depth_midas"), "depth maps (a depth-estimation model) are not generated "
                                                           "yet"),
    **dict.fromkeys(("segmentation", "semantic_segmentation"), "segmentation maps (a segmentation model) are not "
                                                               "generated yet"),
    **dict.fromkeys(("optical_flow", "flow"), "optical flow maps are not generated yet"),
    **dict.fromkeys(("sdr", "sdr_downsample", "logc3_sdr", "hdr_to_sdr"), "HDR-to-SDR conversions are not generated "
                                                                          "yet"),
}
# keys of a generator entry besides its type's settings
COMMON = ("type", "instance_data_dir", "conditioning_type", "captions", "caption_strategy", "instance_prompt", "params",
          "id")


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class CannySettings(_Settings):
    """OpenCV's Canny on the greyscale image (hysteresis thresholds on the Sobel gradient of 0..255 pixels, as
    ControlNet's canny maps are made); the white-on-black edge map becomes the RGB input image."""

    # SimpleTuner's defaults (its CannyEdgeSampleGenerator and DATALOADER.md: 100 and 200)
    low_threshold: float = Field(100, ge=0, description="Edges weaker than this are dropped.")
    high_threshold: float = Field(200, ge=0, description="Edges stronger than this are kept; between the two, only "
                                                         "those connected to a strong edge.")

    @model_validator(mode="after")
    def _ordered(self) -> CannySettings:
        if self.low_threshold > self.high_threshold:
            raise ValueError(f"low_threshold {self.low_threshold:g} is above high_threshold {self.high_threshold:g}; "
                             "swap them")
        return self


class SuperResolutionSettings(_Settings):
    """A low-quality copy of the same size: downscaled and upscaled again (bilinear) when downscale_factor is set,
    then blurred, then Gaussian noise (std noise_level on 0..1 pixels), then a JPEG round trip when jpeg_quality is
    set. SimpleTuner's order and defaults."""

    blur_radius: float = Field(2.0, ge=0)
    blur_type: Literal["gaussian", "box", "both"] = "gaussian"  # both: box, then Gaussian, each at 0.7 x radius
    add_noise: bool = True
    noise_level: float = Field(0.02, ge=0, le=1)
    jpeg_quality: int | None = Field(None, ge=1, le=100)
    downscale_factor: float | None = Field(None, ge=1)


class JpegArtifactsSettings(_Settings):
    """JPEG compression at a low quality: optional pre-blur, compression_rounds round trips (round i > 0 at the
    drawn quality x round_quality_decay^i, within 1..95), then optional noise, then optional noise along the 8-pixel
    block edges. quality_mode 'fixed' takes quality, 'range' draws a whole number in quality_range (both ends
    included), 'random' one of quality_list; each round draws again. SimpleTuner's defaults."""

    quality_mode: Literal["fixed", "range", "random"] = "fixed"
    quality: int = Field(25, ge=1, le=100)
    quality_range: tuple[int, int] = (10, 50)
    quality_list: list[int] = Field([10, 20, 30, 40], min_length=1)
    compression_rounds: int = Field(1, ge=1, le=20)
    round_quality_decay: float = Field(0.9, gt=0, le=1)
    subsampling: Literal["4:4:4", "4:2:2", "4:2:0"] | None = None
    optimize: bool = False
    progressive: bool = False
    pre_blur: bool = False
    pre_blur_radius: float = Field(0.5, ge=0)
    add_noise: bool = False
    noise_level: float = Field(0.01, ge=0, le=1)
    enhance_blocks: bool = False
    block_noise_level: float = Field(0.02, ge=0, le=1)

    @model_validator(mode="after")
    def _qualities(self) -> JpegArtifactsSettings:
        low, high = self.quality_range
        if not 1 <= low <= high <= 100:
            raise ValueError(f"quality_range {list(self.quality_range)}: two qualities from 1 to 100, the lower first")
        if any(not 1 <= q <= 100 for q in self.quality_list):
            raise ValueError(f"quality_list {self.quality_list}: each quality from 1 to 100")
        return self


MaskType = Literal["rectangle", "circle", "brush", "irregular"]


class RandomMasksSettings(_Settings):
    """Random inpainting masks: between min_masks and max_masks shapes of mask_types (drawn by
    mask_type_weights) until a coverage drawn from [min_coverage, max_coverage] is reached (checked between
    shapes, so the last may pass it). Sizes are fractions of the image's side (rectangles), of its shorter side
    (circle radii, brush lengths), brush widths in pixels. edge_blur blurs the mask; edge_feather adds a linear
    fall-off over 10 pixels outside the shapes. output_mode 'mask' gives the mask (white: masked) as the input
    image, 'masked_image' the training image with the masked area painted white (an inpainting edit)."""

    mask_types: list[MaskType] = Field(["rectangle", "circle", "brush", "irregular"], min_length=1)
    mask_type_weights: list[float] | None = None
    min_coverage: float = Field(0.1, ge=0, le=1)
    max_coverage: float = Field(0.5, ge=0, le=1)
    min_masks: int = Field(1, ge=1, le=100)
    max_masks: int = Field(5, ge=1, le=100)
    rect_min_size: float = Field(0.1, gt=0, le=1)
    rect_max_size: float = Field(0.4, gt=0, le=1)
    circle_min_radius: float = Field(0.05, gt=0, le=0.5)
    circle_max_radius: float = Field(0.2, gt=0, le=0.5)
    brush_min_width: int = Field(5, ge=1)
    brush_max_width: int = Field(40, ge=1)
    brush_min_length: float = Field(0.1, gt=0, le=2)
    brush_max_length: float = Field(0.5, gt=0, le=2)
    irregular_min_points: int = Field(5, ge=3, le=200)
    irregular_max_points: int = Field(20, ge=3, le=200)
    edge_blur: bool = True
    edge_blur_radius: float = Field(2.0, ge=0)
    edge_feather: bool = True
    output_mode: Literal["mask", "masked_image"] = "mask"
    mask_value: int = Field(255, ge=1, le=255)
    invert_mask: bool = False

    @model_validator(mode="after")
    def _ranges(self) -> RandomMasksSettings:
        for low, high in [("min_coverage", "max_coverage"), ("min_masks", "max_masks"),
                          ("rect_min_size", "rect_max_size"), ("circle_min_radius", "circle_max_radius"),
                          ("brush_min_width", "brush_max_width"), ("brush_min_length", "brush_max_length"),
                          ("irregular_min_points", "irregular_max_points")]:
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"{low} {getattr(self, low):g} is above {high} {getattr(self, high):g}; swap them")
        weights = self.mask_type_weights
        if weights is not None and (len(weights) != len(self.mask_types) or min(weights) < 0 or sum(weights) <= 0):
            raise ValueError(f"mask_type_weights {weights}: one weight (0 or more, not all 0) per entry of mask_types "
                             f"{self.mask_types}")
        return self


SETTINGS: dict[str, type[_Settings]] = {"canny": CannySettings, "superresolution": SuperResolutionSettings,
                                         "jpeg_artifacts": JpegArtifactsSettings, "random_masks": RandomMasksSettings}


class GeneratedConditioning(BaseModel):
    """One generated conditioning dataset: what data/generated_conditioning.py makes, from which dataset, where."""

    id: str  # <source id>_conditioning_<type as written>
    source_id: str
    kind: Literal["canny", "superresolution", "jpeg_artifacts", "random_masks"]
    settings: dict[str, Any]  # every setting of the kind, defaults filled in (the folder's record of them)
    folder: str
    default: bool = False  # `folder` is the default one (no instance_data_dir): deleting it is harmless


def _defaults_only(kind: str, params: Any) -> bool:
    """Whether a generator's `params` block holds only its settings' defaults (SimpleTuner's web UI writes them)."""
    try:
        return isinstance(params, dict) and SETTINGS[kind].model_validate(params) == SETTINGS[kind]()
    except ValidationError:
        return False


def default_folder(ident: str, source_dir: str) -> str:
    """SimpleTuner's <cache_dir>/conditioning_data/<id>, and a digest of the source folder: two configs in one
    working folder whose datasets share an id but not their images (config environments) get a folder each, where
    each start regenerated the other's images into the shared one."""
    where = str(Path(os.path.expanduser(source_dir)).resolve())
    return f"cache/conditioning_data/{ident}-{hashlib.sha256(where.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}"


def take(entry: dict[str, Any], where: str, problems: list[str]) -> tuple[dict[str, Any], list[Any]]:
    """The image entry and its `conditioning` list (a single generator as a list of one). With one generator, the
    entry's conditioning_data names the dataset it generates (the id is checked with the entry's own id). The
    entries of the list are checked by `build`; a value of another shape is refused here (and cleared, so that
    the field's validation does not refuse it a second time)."""
    if entry.get("conditioning") is None:
        return entry, []
    out = dict(entry)
    raw = out["conditioning"]
    generators = [raw] if isinstance(raw, dict) else raw if isinstance(raw, list) and all(
        isinstance(g, dict) for g in raw) else None
    if generators == []:
        return out, []
    ident = out.get("id") if isinstance(out.get("id"), str) else None
    if out.get("dataset_type") == "video" or out.get("video") is not None:
        problems.append(f"{where}: conditioning: generated conditioning images are for image datasets; an "
                        "image-to-video flavour takes each clip's first frame by itself: remove conditioning")
        return out, []
    if out.get("conditioning_data") not in (None, "", []):
        problems.append(f"{where}: conditioning and conditioning_data are both set: the generated images are this "
                        "dataset's conditioning dataset; remove one")
        return out, []
    kind = generators[0].get("type") if generators else None
    # the id the generated dataset gets (build checks the type); a stand-in where it has none, so that an
    # image-to-image flavour's "needs conditioning_data" does not follow the problem said here
    out["conditioning_data"] = f"{ident}_conditioning_{kind}" if isinstance(kind, str) else f"{ident}_conditioning"
    if generators is None:
        out["conditioning"] = None  # said here: not again by the field's validation
        problems.append(f"{where}: conditioning: {raw!r} must be a list of generator entries such as "
                        "[{\"type\": \"canny\"}]")
        return out, []
    if len(generators) > 1:
        problems.append(f"{where}: conditioning: {len(generators)} generators: a dataset pairs with one conditioning "
                        "dataset (SimpleTuner's several, drawn at random or stitched, are not implemented yet); keep one")
        return out, []
    return out, generators


def build(source: Any, raw: dict[str, Any], where: str, problems: list[str], notes: list[str]) -> GeneratedConditioning | None:
    """The generated dataset of a validated image dataset entry `source` from its generator entry `raw` (take)."""
    where = f"{where}: conditioning[0]"
    written = raw.get("type")
    if not isinstance(written, str) or not written:
        problems.append(f"{where}: type is missing; use one of {', '.join(sorted(set(KINDS.values())))}")
        return None
    name = written.strip().lower()  # "Canny" is canny (its id keeps the spelling)
    if name in NOT_YET:
        problems.append(f"{where}: type {written!r}: {NOT_YET[name]}{_MAKE_THEM}")
        return None
    if name == "i2v_first_frame":
        problems.append(f"{where}: type 'i2v_first_frame': an image-to-video flavour takes each clip's first frame "
                        "by itself; remove this generator")
        return None
    if name not in KINDS:
        problems.append(f"{where}: type {written!r} is unknown; use one of {', '.join(sorted(set(KINDS.values())))} "
                        f"(SimpleTuner's other spellings: {', '.join(k for k in KINDS if k not in KINDS.values())})")
        return None
    kind = KINDS[name]
    settings = {k: v for k, v in raw.items() if k not in COMMON}
    if raw.get("params") and _defaults_only(kind, raw["params"]):  # SimpleTuner's web UI writes them so
        notes.append(f"{where}: params {raw['params']!r} is not used: {kind}'s settings are read from the generator "
                     "entry itself, as SimpleTuner reads them, and these are their defaults anyway; remove params")
    elif raw.get("params"):  # SimpleTuner reads params only for its sdr generator: the settings here are ignored there
        problems.append(f"{where}: params: {kind}'s settings are read from the generator entry itself, as SimpleTuner "
                        f"reads them (it ignores params for {kind}); move {', '.join(sorted(raw['params']))} up one "
                        "level")
        return None
    if raw.get("conditioning_type") == "controlnet":  # SimpleTuner's own Kandinsky 5 i2i example writes it
        notes.append(f"{where}: conditioning_type 'controlnet' is read as 'reference_strict': the generated images are "
                     "the input images of the image-to-image flavour (Kandinsky 5 has no ControlNet); remove it")
    elif raw.get("conditioning_type", "reference_strict") not in ("reference_strict", None):
        problems.append(f"{where}: conditioning_type {raw['conditioning_type']!r}: generated images are input images "
                        "of an image-to-image flavour ('reference_strict'); remove conditioning_type")
        return None
    try:
        checked = SETTINGS[kind].model_validate(settings)
    except ValidationError as e:
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = f"unknown setting of {kind} (it takes {', '.join(SETTINGS[kind].model_fields)})"
            elif "input" in err and err["type"] != "value_error":
                msg = f"{err['input']!r}: {msg}"
            problems.append(f"{where}: {loc + ': ' if loc else ''}{msg}")
        return None
    ident = f"{source.id}_conditioning_{written}"
    if raw.get("id") not in (None, "", ident):  # SimpleTuner's web UI names each generator; it names the dataset so
        notes.append(f"{where}: id {raw['id']!r} is not used: the generated dataset's id is {ident!r} (as SimpleTuner "
                     "names it); remove id")
    folder = raw.get("instance_data_dir") or default_folder(ident, source.instance_data_dir)
    if not isinstance(folder, str):
        problems.append(f"{where}: instance_data_dir: {folder!r} must be a folder path")
        return None
    captions = raw.get("captions")
    if captions not in (None, False, "", []):
        notes.append(f"{where}: captions {captions!r} is not used: with one conditioning dataset each pair trains "
                     "with its image's own caption (SimpleTuner uses a generator's captions only when it draws one "
                     "of several conditioning datasets at random); to train every pair with one prompt, set "
                     "instance_prompt and only_instance_prompt on the dataset")
    unused = [k for k in ("caption_strategy", "instance_prompt") if raw.get(k) not in (None, "")]
    if unused:
        notes.append(f"{where}: {' and '.join(unused)} not used: the generated images take their pair's captions; "
                     f"remove {'them' if len(unused) > 1 else 'it'}")
    return GeneratedConditioning(id=ident, source_id=source.id, kind=kind, folder=os.path.expanduser(folder),
                                 settings=checked.model_dump(mode="json"), default=not raw.get("instance_data_dir"))


def add(source: Any, raw: dict[str, Any], where: str, seen: set[str], generated: dict[str, GeneratedConditioning],
        conditioning: dict[str, Any], problems: list[str], notes: list[str]) -> None:
    """Build the generated dataset of `source` (validated, enabled) and enter it in the plan's `generated` and
    `conditioning` (as the conditioning entry its images make), its id in `seen`."""
    from difftune.config.datasets import ConditioningDataset
    from difftune.files import file_in_the_way

    made = build(source, raw, where, problems, notes)
    if made is None:
        return
    if made.id in seen:
        problems.append(f"{where}: conditioning: the generated dataset's id {made.id!r} is used by another entry; "
                        "rename that entry")
    elif (blocker := file_in_the_way(Path(made.folder))) is not None:
        problems.append(f"{where}: conditioning[0]: instance_data_dir: {str(blocker)!r} is a file, so the folder "
                        f"{made.folder!r} cannot be made; choose another folder")
    seen.add(made.id)
    generated[made.id] = made
    conditioning[made.id] = ConditioningDataset(id=made.id, instance_data_dir=made.folder, source_dataset_id=source.id)
