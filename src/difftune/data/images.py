"""Decoding images safely: EXIF orientation, every colour mode to RGB, clear errors for bad files."""

from __future__ import annotations

import re
import struct
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
        # PIL names the file by its full path: the reason is shown beside the path already, and kept in the metadata
        # cache, where a dataset folder moved elsewhere would replay the old path
        why = str(e).replace(f" '{path}'", "").replace(str(path), path.name)
        raise BadImage(f"not a readable image: {type(e).__name__}: {why}") from e


_CHECKED_AT_OPEN = ("WEBP", "AVIF", "HEIF")  # PIL's plugins for these decode or parse the whole file in open()


def probe_size(path: Path) -> tuple[int, int]:
    width, height, _ = probe_image(path)
    return width, height


def probe_image(path: Path) -> tuple[int, int, bool]:
    """(width, height, animated): the size as displayed (EXIF rotation applied), reading only the header, and
    whether it is an animation (GIF, APNG, WebP: training reads its first frame; an MPO phone photo's second image
    is a depth map or a preview, not a frame); plus a look at the file's end:
    a JPEG not ending in its EOI marker, or a PNG whose chunks stop before IEND, is decoded in full to decide
    (it is most often cut off by a copy or download; data appended after the image, as phones' motion photos have,
    decodes fine), so a truncated file is left out here rather than failing at training."""
    with _open(path) as img:
        width, height = img.size
        try:
            exif = img.getexif() if img.format != "PNG" else None
            if img.format == "PNG":
                # PIL fills img.info only with the chunks before the pixels; load_rgb's full decode sees an eXIf
                # chunk after them too, so walk the chunk headers for it (seeks, no decode)
                exif_data, complete = _png_tail(path)
                if exif_data is not None:
                    exif = Image.Exif()
                    exif.load(exif_data if exif_data.startswith(b"Exif") else b"Exif\x00\x00" + exif_data)
                elif "exif" in img.info:  # an eXIf chunk before the pixels
                    exif = img.getexif()
                elif (turned := _xmp_orientation(img)) is not None:  # XMP's tiff:Orientation, which exif_transpose
                    exif = {0x0112: turned}  # also reads (PNG's getexif would decode the pixels to look for eXIf)
            elif img.format in ("JPEG", "MPO"):
                complete = _jpeg_ends_with_eoi(path)
            else:  # WEBP, AVIF, HEIF: their decoders read the whole file when it opens. TIFF, BMP, GIF: where the
                # pixel data should end, from the header; anything else is decoded in full to decide
                complete = img.format in _CHECKED_AT_OPEN or _data_within_file(img, path)
        except (SyntaxError, ValueError, struct.error) as e:  # what PIL raises for EXIF that is not TIFF data
            raise BadImage(f"damaged EXIF data ({type(e).__name__}: {e}); remove it (e.g. exiftool -all= FILE) or "
                           "re-save the image") from e
        if not complete:
            marker = {"PNG": "its IEND chunk", "JPEG": "its EOI marker", "MPO": "its EOI marker"}.get(img.format)
            try:
                img.load()  # ImageFile.LOAD_TRUNCATED_IMAGES is left False: a short file raises
            except Exception as e:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ... for damaged data
                where = f"the file ends before {marker} and " if marker else ""
                raise BadImage(f"truncated or damaged: {where}it does not decode ({type(e).__name__}: {e}); re-copy or "
                               "re-download it") from e
        orientation = exif.get(0x0112, 1) if exif is not None else 1
        animated = bool(getattr(img, "is_animated", False)) and img.format != "MPO"
    return (height, width, animated) if orientation in _ROTATED else (width, height, animated)


def _xmp_orientation(img: Image.Image) -> int | None:
    """tiff:Orientation of the XMP packet in the image's header, read as PIL's getexif reads it."""
    xmp = img.info.get("XML:com.adobe.xmp") or img.info.get("xmp")
    if isinstance(xmp, bytes):
        xmp = xmp.decode("utf-8", "replace")
    found = re.search(r'tiff:Orientation(="|>)([0-9])', xmp) if isinstance(xmp, str) else None
    return int(found[2]) if found else None


def _data_within_file(img: Image.Image, path: Path) -> bool:
    """Whether a TIFF's strips or tiles, an uncompressed BMP's rows, or a GIF's trailer lie within the file, from
    the header alone (a full decode of a 3000x2000 LZW TIFF takes 60 ms; this, well under 1). False: not known, so
    the caller decodes it."""
    size = path.stat().st_size
    try:
        if img.format == "TIFF":
            tags = img.tag_v2
            for offsets, counts in ((273, 279), (324, 325)):  # StripOffsets/ByteCounts, TileOffsets/ByteCounts
                if offsets in tags and counts in tags:
                    starts, lengths = tags[offsets], tags[counts]
                    starts = starts if isinstance(starts, tuple) else (starts,)
                    lengths = lengths if isinstance(lengths, tuple) else (lengths,)
                    return len(starts) == len(lengths) and all(a + n <= size for a, n in zip(starts, lengths, strict=True))
            return False
        if img.format == "BMP" and len(img.tile) == 1 and img.tile[0][0] == "raw":
            offset, args = img.tile[0][2], img.tile[0][3]
            stride = args[1] if isinstance(args, tuple) and len(args) > 1 and isinstance(args[1], int) else 0
            return stride > 0 and offset + stride * img.size[1] <= size
        if img.format == "GIF":
            with open(path, "rb") as f:
                f.seek(-1, 2)
                return f.read(1) == b";"  # the trailer: a GIF cut short lacks it
    except (AttributeError, IndexError, KeyError, TypeError, OSError):
        return False
    return False


def _jpeg_ends_with_eoi(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-2, 2)
        return f.read(2) == b"\xff\xd9"


def _png_tail(path: Path) -> tuple[bytes | None, bool]:
    """(the last eXIf chunk's data or None, whether the chunks reach IEND within the file), from chunk headers."""
    exif, size = None, path.stat().st_size
    with open(path, "rb") as f:
        f.seek(8)  # the signature
        while True:
            head = f.read(8)
            if len(head) < 8:
                return exif, False
            length, kind = int.from_bytes(head[:4], "big"), head[4:]
            if kind == b"IEND":
                return exif, True
            if f.tell() + length + 4 > size:  # the chunk (and its CRC) runs past the end of the file
                return exif, False
            if kind == b"eXIf":
                exif = f.read(length)
                f.seek(4, 1)
            else:
                f.seek(length + 4, 1)


def load_rgb(path: Path) -> Image.Image:
    """Fully decoded RGB image with EXIF orientation applied. Transparency (alpha, a palette's or a colour key's)
    is composited on white. 16-bit data scales by the file's bit depth (65535 is white); float data (TIFF mode F)
    in [0, 1] scales by 255, other float data is read as 0..255 and clipped."""
    img = _open(path)
    try:
        img.load()
        # by the file's bit depth, not its data: a dark 16-bit PNG stays dark (older PIL opens 16-bit grey PNG as I)
        peak = 65535.0 if img.mode.startswith("I;16") or img.format == "PNG" and img.mode == "I" else None
        img = ImageOps.exif_transpose(img)
        if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
            arr = np.asarray(img, dtype=np.float64)
            key = img.info.get("transparency")  # a 16-bit PNG's colour key, in the file's values
            if img.mode == "F":
                arr = np.nan_to_num(arr)
                arr = arr * 255.0 if arr.size and arr.min() >= 0.0 and arr.max() <= 1.0 else arr
            else:
                # a 32-bit int TIFF has no fixed white: 8-bit data stays, larger data is read as 16-bit
                arr = arr / (peak or (65535.0 if arr.max() > 255 else 255.0)) * 255.0
            grey = Image.fromarray(np.rint(arr).clip(0, 255).astype(np.uint8), "L")
            if isinstance(key, int) and img.mode != "F":
                alpha = Image.fromarray(np.where(np.asarray(img) == key, 0, 255).astype(np.uint8), "L")
                grey = Image.merge("LA", (grey, alpha))
            img = grey
        if img.mode in ("P", "L", "RGB") and "transparency" in img.info:  # a palette index or a colour key
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
