"""The input image of image-to-image and image-to-video validation: which file, and that it decodes.

The first candidate that decodes is used; a candidate that does not is named in a warning and the next one tried,
and a run whose candidates all fail stops before any model loads (`difftune check` says so too), naming the files."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from difftune.config import RunConfig
from difftune.data.discovery import VIDEO_SUFFIXES, Discovery, image_files
from difftune.data.images import BadImage, load_rgb
from difftune.data.video import BadVideo, decode_frames
from difftune.models.registry import FAMILY_FACTS
from difftune.train.plan import DataError


class ValidationInputError(DataError):
    """No candidate of the validation input image decodes (exit code 2 with the message)."""


def needed(run_cfg: RunConfig) -> bool:
    """Whether the run validates an image-conditioned flavour, which samples from an input image."""
    cfg = run_cfg.train
    return FAMILY_FACTS[cfg.model_family].takes_input_image(cfg.flavour()) and bool(cfg.validation_prompts())


def candidates(run_cfg: RunConfig, found: list[Discovery]) -> list[Path]:
    """Validation input candidates in order: the images of eval_dataset_id, or the training pairs' input images, or
    (image-to-video) the training clips, whose first frame is taken."""
    cfg = run_cfg.train
    trained = [d for d in found if not d.held_out]  # not an eval dataset's input (they sort among the others)
    if cfg.validation_using_datasets:
        plan = run_cfg.datasets
        named = [d for d in found if d.dataset_id == cfg.eval_dataset_id]
        if named:  # a discovered dataset (a training set of clips, for image-to-video): its usable files
            # a dataset of image-to-image pairs holds the targets: its pairs' input images are the inputs
            return sorted(s.conditioning if s.conditioning is not None else s.path for s in named[0].samples)
        roots = {ds.id: ds.instance_data_dir for ds in [*plan.images, *plan.validation_only.values()]} | {
            cid: c.instance_data_dir for cid, c in plan.conditioning.items()
        }
        files = image_files(Path(roots[cfg.eval_dataset_id]))
        if not files:
            raise ValidationInputError(f"eval_dataset_id {cfg.eval_dataset_id!r}: no image in "
                                       f"{roots[cfg.eval_dataset_id]}; add the validation input images there, or name "
                                       "another dataset")
        return files
    if FAMILY_FACTS[cfg.model_family].first_frame(cfg.flavour()):
        return sorted(s.path for d in trained for s in d.samples if s.frames)
    return sorted(s.conditioning for d in trained for s in d.samples if s.conditioning is not None)


def load_input_image(path: Path) -> Image.Image:
    """An image file, or the first frame of a clip."""
    if path.suffix.lower() in VIDEO_SUFFIXES:
        return decode_frames(path, [0.0])[0]
    return load_rgb(path)


def first_readable(paths: list[Path], what: str) -> tuple[Path | None, Image.Image | None, list[str]]:
    """The first of `paths` that decodes, its image, and a warning for each one before it that did not. None when
    `paths` is empty; ValidationInputError when none decodes."""
    skipped: list[str] = []
    for path in paths:
        try:
            image = load_input_image(path)
        except (BadImage, BadVideo, OSError) as e:
            skipped.append(f"validation input image {path} cannot be read ({e}); the next one is tried")
            continue
        more = [f"... and {len(skipped) - 20} more unreadable validation input images"] if len(skipped) > 20 else []
        return path, image, skipped[:20] + more
    if not paths:
        return None, None, []
    shown = [s.removesuffix("; the next one is tried") for s in skipped[:20]]
    more = f"; ... and {len(skipped) - 20} more" if len(skipped) > 20 else ""
    raise ValidationInputError(f"no validation input image can be read ({what}): " + "; ".join(shown) + more
                               + ". Replace or remove those files, or name another dataset in eval_dataset_id")


def source(run_cfg: RunConfig) -> str:
    """Where the candidates come from, for the messages."""
    cfg = run_cfg.train
    if cfg.validation_using_datasets:
        return f"eval_dataset_id {cfg.eval_dataset_id!r}"
    if FAMILY_FACTS[cfg.model_family].first_frame(cfg.flavour()):
        return "the first frames of the training clips"
    return "the training pairs' input images"


def pick(run_cfg: RunConfig, found: list[Discovery]) -> tuple[Path | None, Image.Image | None, list[str]]:
    """The validation input image of an image-conditioned flavour that validates: (path, image, warnings); (None,
    None, []) for a run that needs none."""
    return first_readable(candidates(run_cfg, found), source(run_cfg)) if needed(run_cfg) else (None, None, [])
