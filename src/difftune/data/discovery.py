"""Find images and their captions in a dataset folder, and say what was left out and why."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from difftune.data.buckets import SizeRule, bucket_for, downsample_first, too_small
from difftune.data.images import IMAGE_EXTENSIONS, BadImage, probe_size


@dataclass(frozen=True)
class Sample:
    dataset_id: str
    path: Path
    caption: str
    width: int  # as displayed (EXIF applied)
    height: int
    bucket: tuple[int, int]
    downsample: tuple[int, int] | None
    conditioning: Path | None = None  # the paired input image (image-to-image), same relative name


@dataclass
class Discovery:
    dataset_id: str
    samples: list[Sample] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    notes: list[tuple[Path, str]] = field(default_factory=list)  # used, but worth telling the user


def walk_files(root: Path) -> list[Path]:
    """Every file under root, sorted, following symlinked folders once (no loops)."""
    seen: set[str] = set()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames.sort()
        found.extend(Path(dirpath) / name for name in filenames)
    return sorted(found)


def read_caption(path: Path) -> tuple[str | None, str | None]:
    """(caption, problem) by the textfile strategy: <name>.txt beside the image."""
    txt = path.with_suffix(".txt")
    if not txt.is_file():
        return None, f"no caption file {txt.name} (caption_strategy textfile needs one beside each image)"
    try:
        text = txt.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"caption file {txt.name} unreadable: {e}"
    return text, None


def image_files(root: Path) -> list[Path]:
    return [p for p in walk_files(root) if not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS]


def pair_index(root: Path) -> dict[Path, Path]:
    """Conditioning images by relative path without extension (a .png target may pair with a .jpg)."""
    return {p.relative_to(root).with_suffix(""): p for p in image_files(root)}


def discover(dataset_id: str, root: Path, rule: SizeRule, conditioning_root: Path | None = None) -> Discovery:
    result = Discovery(dataset_id)
    pairs = pair_index(conditioning_root) if conditioning_root is not None else None
    for path in image_files(root):
        conditioning = None
        if pairs is not None:
            conditioning = pairs.get(path.relative_to(root).with_suffix(""))
            if conditioning is None:
                result.skipped.append((path, f"no conditioning image of the same name in {conditioning_root}"))
                continue
        try:
            width, height = probe_size(path)
        except (BadImage, OSError) as e:
            result.skipped.append((path, str(e)))
            continue
        if too_small(width, height, rule):
            result.skipped.append((path, f"{width}x{height} is below minimum_image_size {rule.minimum_image_size:g}"))
            continue
        caption, problem = read_caption(path)
        if caption is None:
            result.skipped.append((path, problem or "no caption"))
            continue
        if caption == "":
            result.notes.append((path, "empty caption file: trained with an empty prompt"))
        down = downsample_first(width, height, rule)
        basis = down or (width, height)
        result.samples.append(
            Sample(dataset_id, path, caption, width, height, bucket_for(*basis, rule), down, conditioning)
        )
    return result
