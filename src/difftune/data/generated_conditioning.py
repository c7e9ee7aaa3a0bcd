"""Making a generated conditioning dataset's images (config/generated_conditioning.py: what, from which dataset,
into which folder), before discovery pairs them with their training images by name.

The folder is one of difftune's source folders (data/sources): its manifest says which generated dataset it holds,
with the generator's settings and, per source image, the size and modification time it was made from. So a second
start generates nothing, a changed or added image is generated again, changed settings regenerate every image, a
removed image's output is removed, and a killed run goes on where it stopped (each image is written under a
temporary name, then renamed). A folder of files difftune did not generate is refused, never overwritten.

Each output is `<the source's path below its dataset folder, suffix .png>`, the source's size, upright (EXIF applied)
and RGB (transparency on white), as data/images.load_rgb reads every training image. Random draws (noise, JPEG
qualities) come from a seed of the image's own: the dataset id, its path and the settings.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from difftune.config.datasets import ConditioningDataset
from difftune.config.generated_conditioning import GeneratedConditioning
from difftune.data.discovery import walk
from difftune.data.images import IMAGE_EXTENSIONS, BadImage, load_rgb
from difftune.data.sources import SourceError, open_folder, partial, read_folder, save_manifest

ALGORITHM = 1  # raised when an output of the same settings would change: every folder is generated again
SAVE_EVERY = 20.0  # seconds between manifest saves while generating (what a killed run keeps)


def output_name(rel: Path) -> Path:
    """The generated image of the source image at `rel` (below its dataset folder)."""
    return rel.with_suffix(".png")


def _open(gen: GeneratedConditioning, write: bool) -> dict[str, Any]:
    """The folder's manifest ({} for a new folder), refusing one that is another's or holds the user's files.
    `write`: also remove what a killed run left half written."""
    fix = ("delete that folder (difftune makes it again)" if gen.default else
           "give the generator another instance_data_dir, or remove its instance_data_dir for the default folder")
    opened = open_folder if write else read_folder
    return opened(manifest_owner(gen), Path(gen.folder),
                  {"generated_conditioning": gen.id}, fix, other=lambda m: f"another dataset's files ({_what(m)})",
                  strangers="difftune did not generate (generating would overwrite them)") or {}


def check_folder(gen: GeneratedConditioning) -> None:
    """Raise SourceError where generate would refuse the folder, writing nothing (the web UI's scan)."""
    _open(gen, write=False)


def generate(gen: GeneratedConditioning, source_root: Path, say: Callable[[str], None] = print) -> None:
    """Bring `gen.folder` up to date with the images of `source_root`; raises SourceError when the folder cannot
    be used (another dataset's, files of the user's, cannot be written). The manifest's `files` hold, per source
    image, the stamps (size, modification time) of the source and of its output: either changed, it is made again;
    `unreadable` holds the sources that could not be read, with why, tried again once they change."""
    folder = Path(gen.folder)
    found = _open(gen, write=True)
    same = (found.get("type"), found.get("settings"), found.get("algorithm")) == (gen.kind, gen.settings, ALGORITHM)
    sources, clashes = _sources(source_root, folder)
    for rel in [r for r in found.get("files") or {} if r not in sources]:  # its source image is gone
        (folder / output_name(Path(rel))).unlink(missing_ok=True)
    made: dict[str, list[int]] = {}
    unreadable: dict[str, list[Any]] = {}
    todo = []
    for rel, stamp in sources.items():
        before = (found.get("files") or {}).get(rel) if same else None
        failed = (found.get("unreadable") or {}).get(rel) if same else None
        if before is not None and before[:2] == stamp and before[2:] == _stamp(folder / output_name(Path(rel))):
            made[rel] = before
        elif failed is not None and failed[:2] == stamp:
            unreadable[rel] = failed
        else:
            todo.append(rel)
    manifest = {"generated_conditioning": gen.id, "source": gen.source_id, "type": gen.kind,
                "settings": gen.settings, "algorithm": ALGORITHM, "files": made, "unreadable": unreadable}
    for names in clashes:
        say(f"dataset {gen.id!r}: {', '.join(names)} in dataset {gen.source_id!r} would make one generated image "
            f"({output_name(Path(names[0])).name}): none is generated, so they are left out; rename one")
    if not todo:
        if manifest != found:
            save_manifest(manifest_owner(gen), folder, manifest)
        return
    why = " (its settings changed since the folder was generated)" if found and not same else ""
    say(f"dataset {gen.id!r}: generating {len(todo)} {gen.kind} image(s) from dataset {gen.source_id!r} into "
        f"{folder}{why}")
    save_manifest(manifest_owner(gen), folder, manifest)  # first: outputs without it would be refused as the user's
    skipped: list[str] = []
    saved = start = time.monotonic()

    def one(rel: str) -> tuple[str, list[int] | str]:
        return rel, make_one(gen, source_root / rel, folder / output_name(Path(rel)), rel)

    pool = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="difftune-generate")
    try:
        for done, (rel, result) in enumerate(pool.map(one, todo), 1):
            if isinstance(result, str):
                unreadable[rel] = [*sources[rel], result]
                skipped.append(f"{rel}: {result}")
            else:
                made[rel] = [*sources[rel], *result]
            if time.monotonic() - saved > SAVE_EVERY:
                save_manifest(manifest_owner(gen), folder, manifest)
                saved = time.monotonic()
                say(f"dataset {gen.id!r}: {done}/{len(todo)} generated")
    finally:  # Ctrl-C or a failed write: the images not started are not made, those made are kept
        pool.shutdown(wait=True, cancel_futures=True)
        save_manifest(manifest_owner(gen), folder, manifest)
    tail = f"; {len(skipped)} unreadable, left out: " + "; ".join(skipped[:3]) if skipped else ""
    say(f"dataset {gen.id!r}: {len(todo) - len(skipped)} image(s) generated in {time.monotonic() - start:.1f} s"
        f"{tail}")


def manifest_owner(gen: GeneratedConditioning) -> ConditioningDataset:
    return ConditioningDataset(id=gen.id, instance_data_dir=gen.folder)


def _stamp(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def make_one(gen: GeneratedConditioning, source: Path, target: Path, rel: str) -> list[int] | str:
    """Generate one image: the output's stamp, or why not (an unreadable source). A failed write raises
    SourceError."""
    try:
        image = load_rgb(source)
    except (BadImage, OSError) as e:
        return str(e)
    out = transform(gen.kind, gen.settings, image, _rng(gen, rel))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with partial(target) as tmp:
            out.save(tmp, format="PNG", compress_level=1)  # a cache: fast to write matters more than its size
            os.replace(tmp, target)
        stamp = _stamp(target)
    except OSError as e:
        raise SourceError(f"dataset {gen.id!r}: {target} cannot be written ({e}); free some space or give the "
                          "generator another instance_data_dir") from e
    return stamp or [0, 0]


def transform(kind: str, settings: dict[str, Any], image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """The conditioning image `kind` makes of an RGB image (the same size, RGB)."""
    if kind == "canny":
        return _canny(image, settings)
    if kind == "superresolution":
        return _low_quality(image, settings, rng)
    if kind == "jpeg_artifacts":
        return _jpeg_artifacts(image, settings, rng)
    if kind == "random_masks":
        return _random_masks(image, settings, rng)
    raise ValueError(f"unknown generator {kind!r}")


def _canny(image: Image.Image, s: dict[str, Any]) -> Image.Image:
    import cv2  # opencv-python-headless: the Canny implementation ControlNet's edge maps are made with

    grey = cv2.cvtColor(np.asarray(image), cv2.COLOR_RGB2GRAY)
    edges = cv2.Canny(grey, float(s["low_threshold"]), float(s["high_threshold"]))
    return Image.fromarray(np.repeat(edges[:, :, None], 3, axis=2), "RGB")


def _low_quality(image: Image.Image, s: dict[str, Any], rng: np.random.Generator) -> Image.Image:
    size = image.size
    factor = s["downscale_factor"]
    if factor and factor > 1:
        small = (max(1, round(size[0] / factor)), max(1, round(size[1] / factor)))
        image = image.resize(small, Image.Resampling.BILINEAR).resize(size, Image.Resampling.BILINEAR)
    radius = s["blur_radius"]
    if radius > 0:
        if s["blur_type"] == "box":
            image = image.filter(ImageFilter.BoxBlur(radius))
        elif s["blur_type"] == "both":
            image = image.filter(ImageFilter.BoxBlur(0.7 * radius)).filter(ImageFilter.GaussianBlur(0.7 * radius))
        else:
            image = image.filter(ImageFilter.GaussianBlur(radius))
    if s["add_noise"] and s["noise_level"] > 0:
        image = _noisy(image, s["noise_level"], rng)
    if s["jpeg_quality"]:
        image = _jpeg(image, s["jpeg_quality"])
    return image


def _jpeg_artifacts(image: Image.Image, s: dict[str, Any], rng: np.random.Generator) -> Image.Image:
    if s["pre_blur"] and s["pre_blur_radius"] > 0:
        image = image.filter(ImageFilter.GaussianBlur(s["pre_blur_radius"]))
    for i in range(s["compression_rounds"]):
        if s["quality_mode"] == "range":
            base = int(rng.integers(s["quality_range"][0], s["quality_range"][1] + 1))
        elif s["quality_mode"] == "random":
            base = int(rng.choice(s["quality_list"]))
        else:
            base = s["quality"]
        quality = base if i == 0 else min(95, max(1, int(base * s["round_quality_decay"] ** i)))
        image = _jpeg(image, quality, s["subsampling"], s["optimize"], s["progressive"])
    if s["add_noise"] and s["noise_level"] > 0:
        image = _noisy(image, s["noise_level"], rng)
    if s["enhance_blocks"] and s["block_noise_level"] > 0:  # noise along the 8x8 block edges: harsher blocking
        pixels = np.asarray(image, dtype=np.float32) / 255.0
        edges = np.zeros(pixels.shape[:2], dtype=bool)
        edges[::8, :] = True
        edges[:, ::8] = True
        pixels[edges] += s["block_noise_level"] * rng.standard_normal(pixels[edges].shape, dtype=np.float32)
        image = _to_image(pixels)
    return image


FEATHER = 10  # pixels of edge_feather's fall-off outside the shapes


def _random_masks(image: Image.Image, s: dict[str, Any], rng: np.random.Generator) -> Image.Image:
    w, h = image.size
    mask = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(mask)
    weights = np.asarray(s["mask_type_weights"], dtype=np.float64) if s["mask_type_weights"] else None
    target = rng.uniform(s["min_coverage"], s["max_coverage"])
    for _ in range(int(rng.integers(s["min_masks"], s["max_masks"] + 1))):
        if np.count_nonzero(np.asarray(mask)) >= target * w * h:
            break
        shape = str(rng.choice(s["mask_types"], p=None if weights is None else weights / weights.sum()))
        _SHAPES[shape](draw, w, h, s, rng)
    if s["edge_blur"] and s["edge_blur_radius"] > 0:
        mask = mask.filter(ImageFilter.GaussianBlur(s["edge_blur_radius"]))
    amount = np.asarray(mask, dtype=np.float32) / 255.0
    if s["edge_feather"]:
        import cv2

        outside = (amount <= 0.5).astype(np.uint8)
        if not outside.all():  # each outside pixel's distance to the nearest shape
            distance = cv2.distanceTransform(outside, cv2.DIST_L2, 5)
            amount = np.maximum(amount, np.clip(1.0 - distance / FEATHER, 0.0, 1.0) * (s["mask_value"] / 255.0))
    if s["invert_mask"]:
        amount = 1.0 - amount
    if s["output_mode"] == "mask":
        return _to_image(np.repeat(amount[:, :, None], 3, axis=2))
    pixels = np.asarray(image, dtype=np.float32) / 255.0  # masked_image: the masked area painted white
    return _to_image(pixels * (1.0 - amount[:, :, None]) + amount[:, :, None])


def _draw_rectangle(draw: ImageDraw.ImageDraw, w: int, h: int, s: dict[str, Any], rng: np.random.Generator) -> None:
    rw = max(1, int(w * rng.uniform(s["rect_min_size"], s["rect_max_size"])))
    rh = max(1, int(h * rng.uniform(s["rect_min_size"], s["rect_max_size"])))
    x, y = int(rng.integers(0, max(0, w - rw) + 1)), int(rng.integers(0, max(0, h - rh) + 1))
    draw.rectangle([x, y, x + rw - 1, y + rh - 1], fill=s["mask_value"])


def _draw_circle(draw: ImageDraw.ImageDraw, w: int, h: int, s: dict[str, Any], rng: np.random.Generator) -> None:
    r = max(1, int(min(w, h) * rng.uniform(s["circle_min_radius"], s["circle_max_radius"])))
    cx, cy = int(rng.integers(r, max(r, w - r) + 1)), int(rng.integers(r, max(r, h - r) + 1))
    draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=s["mask_value"])


def _draw_brush(draw: ImageDraw.ImageDraw, w: int, h: int, s: dict[str, Any], rng: np.random.Generator) -> None:
    """A random walk of straight strokes with round joints, within the image."""
    width = min(int(rng.integers(s["brush_min_width"], s["brush_max_width"] + 1)), max(1, min(w, h) // 2))
    length = min(w, h) * rng.uniform(s["brush_min_length"], s["brush_max_length"])
    steps = max(1, round(length / 20))
    lo_x, hi_x, lo_y, hi_y = width / 2, max(width / 2, w - width / 2), width / 2, max(width / 2, h - width / 2)
    points = [(rng.uniform(lo_x, hi_x), rng.uniform(lo_y, hi_y))]
    for _ in range(steps):
        angle = rng.uniform(0.0, 2.0 * np.pi)
        x, y = points[-1]
        points.append((min(hi_x, max(lo_x, x + length / steps * np.cos(angle))),
                       min(hi_y, max(lo_y, y + length / steps * np.sin(angle)))))
    draw.line(points, fill=s["mask_value"], width=width, joint="curve")
    for x, y in points:
        draw.ellipse([x - width / 2, y - width / 2, x + width / 2, y + width / 2], fill=s["mask_value"])


def _draw_irregular(draw: ImageDraw.ImageDraw, w: int, h: int, s: dict[str, Any], rng: np.random.Generator) -> None:
    """A polygon around a point of the image's middle half, its corners at jittered angles and random radii."""
    n = int(rng.integers(s["irregular_min_points"], s["irregular_max_points"] + 1))
    cx, cy = rng.uniform(w / 4, 3 * w / 4), rng.uniform(h / 4, 3 * h / 4)
    points = []
    for i in range(n):
        angle = 2.0 * np.pi * i / n + rng.uniform(-0.3, 0.3)
        radius = rng.uniform(0.1, 0.3) * min(w, h)
        points.append((min(w - 1.0, max(0.0, cx + radius * np.cos(angle))),
                       min(h - 1.0, max(0.0, cy + radius * np.sin(angle)))))
    draw.polygon(points, fill=s["mask_value"])


_SHAPES = {"rectangle": _draw_rectangle, "circle": _draw_circle, "brush": _draw_brush, "irregular": _draw_irregular}


def _noisy(image: Image.Image, level: float, rng: np.random.Generator) -> Image.Image:
    pixels = np.asarray(image, dtype=np.float32) / 255.0
    return _to_image(pixels + level * rng.standard_normal(pixels.shape, dtype=np.float32))  # float32: 2x faster


def _to_image(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(np.rint(np.clip(pixels, 0.0, 1.0) * 255.0).astype(np.uint8), "RGB")


def _jpeg(image: Image.Image, quality: int, subsampling: str | None = None, optimize: bool = False,
          progressive: bool = False) -> Image.Image:
    """A JPEG round trip in memory."""
    buffer = io.BytesIO()
    options: dict[str, Any] = {"quality": int(quality), "optimize": optimize, "progressive": progressive}
    if subsampling is not None:
        options["subsampling"] = subsampling
    image.save(buffer, format="JPEG", **options)
    buffer.seek(0)
    with Image.open(buffer) as decoded:
        return decoded.convert("RGB")


def _rng(gen: GeneratedConditioning, rel: str) -> np.random.Generator:
    text = f"{gen.source_id}/{rel}|{gen.kind}|{json.dumps(gen.settings, sort_keys=True)}"
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()  # a non-UTF-8 file name too
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _sources(root: Path, folder: Path) -> tuple[dict[str, list[int]], list[list[str]]]:
    """The source images by path below `root` (with their size and modification time), and the groups of them
    that would make one output (cat.jpg and cat.png), which are left out."""
    skip = (folder,) if folder.resolve().is_relative_to(root.resolve()) else ()
    found: dict[str, list[int]] = {}
    by_output: dict[Path, list[str]] = {}
    for path in walk(root, skip).files:
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            continue
        rel = path.relative_to(root)
        try:
            st = path.stat()
        except OSError:
            continue  # discovery reports it
        found[rel.as_posix()] = [st.st_size, st.st_mtime_ns]
        by_output.setdefault(output_name(rel), []).append(rel.as_posix())
    clashes = [names for names in by_output.values() if len(names) > 1]
    for names in clashes:
        for rel in names:
            del found[rel]
    return found, clashes


def _what(manifest: dict[str, Any]) -> str:
    if "generated_conditioning" in manifest:
        return f"generated for {manifest['generated_conditioning']!r}"
    return "a downloaded dataset" if manifest else "unknown"
