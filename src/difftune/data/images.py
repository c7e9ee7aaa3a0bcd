"""Decoding images safely: EXIF orientation, every colour mode to RGB, clear errors for bad files."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from difftune.data.buckets import cover_resize, crop_box

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".avif"}
_ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height


class BadImage(Exception):
    """A file that cannot be used as an image; the message is the reason shown in the report."""


def _open(path: Path) -> Image.Image:
    if path.stat().st_size == 0:
        raise BadImage("empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            # PIL warns above MAX_IMAGE_PIXELS (89.5 MP) and refuses above twice that: a 102 MP camera's photos
            # (Fujifilm GFX100) are ordinary data here, so only the refusal counts
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(path)
    except Image.DecompressionBombError as e:
        raise BadImage(f"too many pixels (over {2 * (Image.MAX_IMAGE_PIXELS or 0) / 1e6:.0f} MP, PIL's "
                       f"decompression bomb guard): {e}") from e
    except Exception as e:  # noqa: BLE001 - PIL raises many types for non-images
        raise BadImage(f"not a readable image: {type(e).__name__}: {e}") from e


def probe_size(path: Path) -> tuple[int, int]:
    """(width, height) as displayed (EXIF rotation applied), reading only the header."""
    with _open(path) as img:
        width, height = img.size
        # A PNG's getexif() decodes the whole image to look for an eXIf chunk after the pixels; a
        # header-only probe reads the EXIF only when it came before them (in img.info).
        has_exif = img.format != "PNG" or "exif" in img.info
        orientation = img.getexif().get(0x0112, 1) if has_exif else 1
    return (height, width) if orientation in _ROTATED else (width, height)


def load_rgb(path: Path) -> Image.Image:
    """Fully decoded RGB image with EXIF orientation applied. Transparency is composited on white."""
    img = _open(path)
    try:
        img.load()
        img = ImageOps.exif_transpose(img)
        if img.mode in ("I;16", "I;16B", "I;16L", "I"):
            arr = np.asarray(img, dtype=np.float64)
            peak = 65535.0 if arr.max() > 255 else 255.0
            img = Image.fromarray((arr / peak * 255.0).clip(0, 255).astype(np.uint8), "L")
        if img.mode == "P":
            img = img.convert("RGBA")
        if img.mode in ("RGBA", "LA", "PA"):
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            img = Image.alpha_composite(background, rgba)
        return img.convert("RGB")
    except BadImage:
        raise
    except Exception as e:  # noqa: BLE001 - truncated data surfaces here, as OSError or others
        raise BadImage(f"cannot decode: {type(e).__name__}: {e}") from e


def fit(
    img: Image.Image, bucket: tuple[int, int], crop_style: str, uv: tuple[float, float],
    downsample: tuple[int, int] | None = None,
) -> Image.Image:
    """Resize to cover the bucket, then crop to exactly the bucket. Done in one resize of the crop's source region
    (PIL's `box`, whose filter still reads the pixels around it: the same pixels, bit for bit): resizing the whole
    image first made a 20000x20 strip bound for a 1024 bucket a 5 GB intermediate image."""
    if downsample is not None:
        img = img.resize(downsample, Image.Resampling.LANCZOS)
    size = cover_resize(img.width, img.height, bucket)
    box = crop_box(size[0], size[1], bucket, crop_style, *uv)
    if size == img.size:
        return img.crop(box)
    sx, sy = img.width / size[0], img.height / size[1]
    return img.resize(bucket, Image.Resampling.LANCZOS, box=(box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy))


def to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB PIL -> [3, H, W] float32 in [-1, 1]."""
    arr = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def prepare(
    img: Image.Image, bucket: tuple[int, int], crop_style: str, uv: tuple[float, float],
    downsample: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`fit` then `to_tensor`: [3, H, W] in [-1, 1]."""
    return to_tensor(fit(img, bucket, crop_style, uv, downsample))
