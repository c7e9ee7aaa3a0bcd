"""Odd real-world image files: the header probe (check) and the full decode (training) must agree on each."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from difftune.data.images import BadImage, load_rgb, probe_size


def noise(w=96, h=64):
    return Image.fromarray(np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8))


def encoded(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt,name", [("PNG", "cut.png"), ("JPEG", "cut.jpg"), ("TIFF", "cut.tif"), ("BMP", "cut.bmp"),
                                      ("GIF", "cut.gif"), ("WEBP", "cut.webp")])
def test_probe_leaves_out_a_file_cut_off_at_the_end(tmp_path, fmt, name):
    """check's probe and training's decode agree: TIFF, BMP and GIF (no end marker to look at) passed check and were
    left out only while caching, which could leave a bucket short of a batch after the model had loaded."""
    data = encoded(noise(), fmt)
    path = tmp_path / name
    path.write_bytes(data[:int(len(data) * 0.5)])  # header intact: only a decode finds the missing pixels
    with pytest.raises(BadImage, match="(truncated or damaged|not a readable image): .*"):
        probe_size(path)
    with pytest.raises(BadImage):
        load_rgb(path)
    path.write_bytes(data)
    assert probe_size(path) == load_rgb(path).size == (96, 64)


@pytest.mark.parametrize("fmt,name,kw", [("TIFF", "whole.tif", {}), ("TIFF", "lzw.tif", {"compression": "tiff_lzw"}),
                                         ("BMP", "whole.bmp", {}), ("GIF", "whole.gif", {})])
def test_an_intact_file_is_probed_without_decoding_it(tmp_path, fmt, name, kw, monkeypatch):
    """Where the pixel data ends comes from the header (TIFF strips, BMP rows, the GIF trailer): a full decode per
    file (60 ms for a 3000x2000 LZW TIFF) made every check of a large TIFF dataset minutes long."""
    from PIL import ImageFile

    path = tmp_path / name
    path.write_bytes(encoded(noise(), fmt, **kw))

    def no_decode(self, *a, **k):
        raise AssertionError("decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    assert probe_size(path) == (96, 64)


def test_png_xmp_orientation_seen_by_the_probe(tmp_path):
    """A PNG turned by XMP's tiff:Orientation: load_rgb (exif_transpose) turns it, the probe did not, so its bucket
    was of the wrong orientation."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_itxt("XML:com.adobe.xmp", '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/'
                  '1999/02/22-rdf-syntax-ns#"><rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" '
                  'tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    path = tmp_path / "xmp.png"
    noise().save(path, pnginfo=info)
    assert probe_size(path) == load_rgb(path).size == (64, 96)


def test_an_unreadable_files_reason_names_no_folder(tmp_path):
    """The reason is kept in the metadata cache by the file's path below the dataset: a folder moved elsewhere
    replayed the old absolute path."""
    (tmp_path / "fake.jpg").write_text("not an image")
    with pytest.raises(BadImage) as e:
        probe_size(tmp_path / "fake.jpg")
    assert str(tmp_path) not in str(e.value) and "cannot identify image file" in str(e.value)


def test_probe_keeps_a_jpeg_with_data_after_its_end_marker(tmp_path):
    # phones' motion photos append a video after the JPEG's EOI: not truncated, it decodes
    path = tmp_path / "motion.jpg"
    path.write_bytes(encoded(noise(), "JPEG") + b"ftypmp42" + bytes(500))
    assert probe_size(path) == (96, 64)
    assert load_rgb(path).size == (96, 64)


def test_png_exif_orientation_after_the_pixels_seen_by_the_probe(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: displayed 64x96
    body = exif.tobytes()[6:]  # PNG's eXIf holds the TIFF data without the "Exif\0\0" prefix
    chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(">I", zlib.crc32(b"eXIf" + body))
    data = encoded(noise(), "PNG")
    path = tmp_path / "late_exif.png"
    path.write_bytes(data[:-12] + chunk + data[-12:])  # before IEND, after IDAT
    assert Image.open(path).info.get("exif") is None  # PIL's header read does not see it
    assert probe_size(path) == load_rgb(path).size == (64, 96)


def test_float_tiff_scaled_not_clipped_to_black(tmp_path):
    ramp = np.tile(np.linspace(0, 1, 96, dtype=np.float32), (64, 1))
    Image.fromarray(ramp).save(tmp_path / "unit.tif")
    grey = np.asarray(load_rgb(tmp_path / "unit.tif"))[0, :, 0]
    assert grey[0] == 0 and grey[-1] == 255 and abs(int(grey[48]) - 129) <= 1
    # beyond [0, 1]: read as 0..255 and clipped
    Image.fromarray(np.array([[-5.0, 100.0, 300.0]], dtype=np.float32)).save(tmp_path / "wide.tif")
    assert list(np.asarray(load_rgb(tmp_path / "wide.tif"))[0, :, 0]) == [0, 100, 255]


def test_dark_16bit_png_stays_dark_by_its_bit_depth(tmp_path):
    dark = np.full((64, 96), 250, dtype=np.uint16)
    Image.fromarray(dark).save(tmp_path / "dark.png")
    assert np.asarray(load_rgb(tmp_path / "dark.png")).max() <= 1  # 250 of 65535
    dark[0, 0] = 60000  # one bright pixel does not change how the others decode
    Image.fromarray(dark).save(tmp_path / "dark_spot.png")
    assert np.asarray(load_rgb(tmp_path / "dark_spot.png"))[10, 10, 0] <= 1


def test_colour_key_transparency_composited_on_white(tmp_path):
    rgb = np.full((48, 64, 3), (10, 20, 30), dtype=np.uint8)
    rgb[:, 32:] = (200, 0, 0)
    Image.fromarray(rgb).save(tmp_path / "key.png", transparency=(10, 20, 30))
    img = load_rgb(tmp_path / "key.png")
    assert img.getpixel((0, 0)) == (255, 255, 255) and img.getpixel((40, 0)) == (200, 0, 0)
    grey = np.full((48, 64), 0, dtype=np.uint8)
    grey[:, 32:] = 90
    Image.fromarray(grey).save(tmp_path / "lkey.png", transparency=0)
    img = load_rgb(tmp_path / "lkey.png")
    assert img.getpixel((0, 0)) == (255, 255, 255) and img.getpixel((40, 0)) == (90, 90, 90)
    sixteen = np.full((48, 64), 300, dtype=np.uint16)
    sixteen[:, 32:] = 32768
    Image.fromarray(sixteen).save(tmp_path / "key16.png", transparency=300)
    img = load_rgb(tmp_path / "key16.png")
    assert img.getpixel((0, 0)) == (255, 255, 255) and img.getpixel((40, 0)) == (128, 128, 128)


def test_damaged_png_exif_left_out_by_the_probe_as_by_the_decode(tmp_path):
    body = b"not TIFF data"
    chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(">I", zlib.crc32(b"eXIf" + body))
    data = encoded(noise(), "PNG")
    path = tmp_path / "bad_exif.png"
    path.write_bytes(data[:-12] + chunk + data[-12:])
    with pytest.raises(BadImage, match="damaged EXIF data"):
        probe_size(path)
    with pytest.raises(BadImage):
        load_rgb(path)


def test_files_failing_while_caching_are_named_when_no_bucket_is_left(tmp_path, monkeypatch):
    """Files that probe well but fail to decode while caching can leave every bucket short of a batch: the error
    came with no word of those files (the data report naming them is printed later)."""
    from conftest import write_config
    from difftune.config import load_config
    from difftune.data import latents
    from difftune.demo import make_dataset
    from difftune.train.plan import DataError
    from difftune.train.setup import build_run

    make_dataset(tmp_path / "images", count=4)
    real = latents.load_rgb

    def flaky(path):
        if path.name.startswith(("000-", "001-")):
            raise BadImage("simulated damage")
        return real(path)

    monkeypatch.setattr(latents, "load_rgb", flaky)
    path = write_config(tmp_path, tmp_path / "images", train_batch_size=4,
                        dataset={"resolution_type": "pixel", "crop": True, "crop_aspect": "square"})
    with pytest.raises(DataError, match=r"(?s)every aspect bucket.*2 file\(s\) could not be decoded while caching:.*"
                                         r"000-yellow-circle\.png: simulated damage"):
        build_run(load_config(path))
