"""Bad data, generated here: every case is either converted correctly or left out with its reason."""

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from difftune.data import captions
from difftune.data.buckets import SizeRule
from difftune.data.cache import TensorCache
from difftune.data.captions import CaptionRule
from difftune.data.discovery import DatasetSpec, discover
from difftune.data.images import load_rgb
from difftune.data.latents import fill_latent_cache

RULE = SizeRule(resolution=64, resolution_type="pixel_area", crop=False, crop_aspect="square", multiple=16,
                minimum_image_size=24)


def caption(path: Path, text: str = "a picture") -> None:
    path.with_suffix(".txt").write_text(text, encoding="utf-8")


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "data"
    (root / "nested" / "deeper").mkdir(parents=True)
    good = Image.new("RGB", (64, 48), (200, 10, 10))
    files = {}

    def add(name, save, text="a picture"):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        save(path)
        if text is not None:
            caption(path, text)
        files[name] = path
        return path

    add("ok.png", good.save)
    add("UPPER.JPG", lambda p: good.save(p, "JPEG"))
    add("Mixed.JpEg", lambda p: good.save(p, "JPEG"))
    add("pic.webp", lambda p: good.save(p, "WEBP"))
    add("pic.avif", lambda p: good.save(p, "AVIF"))
    add("with space ünïcödé 猫.png", good.save)
    add("nested/deeper/inner.png", good.save)
    add("cmyk.jpg", lambda p: good.convert("CMYK").save(p, "JPEG"))
    add("gray.png", lambda p: Image.new("L", (64, 48), 128).save(p))
    add("sixteen.png", lambda p: Image.fromarray(np.full((48, 64), 65535 // 2, dtype=np.uint16)).save(p))
    add("palette.png", lambda p: good.convert("P").save(p))
    rgba = Image.new("RGBA", (64, 48), (0, 0, 255, 0))  # fully transparent blue: must become white
    add("alpha.png", rgba.save)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: displayed 48x64
    add("rotated.jpg", lambda p: good.save(p, "JPEG", exif=exif.tobytes()))
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8))
    add("noise.png", noise.save)
    add("truncated.png", lambda p: p.write_bytes((root / "noise.png").read_bytes()[:5000]))  # header intact
    add("cut_header.png", lambda p: p.write_bytes((root / "ok.png").read_bytes()[:20]))
    add("empty.png", lambda p: p.write_bytes(b""))
    add("notimage.jpg", lambda p: p.write_text("this is text, not a JPEG"))
    add("tiny.png", lambda p: Image.new("RGB", (8, 8)).save(p))
    add("nocaption.png", good.save, text=None)
    add("emptycaption.png", good.save, text="")
    add("bomb.png", lambda p: Image.new("RGB", (300, 300)).save(p))
    os.symlink(files["ok.png"], root / "link.png")
    caption(root / "link.png")
    outside = tmp_path / "outside"
    outside.mkdir()
    Image.new("RGB", (64, 48)).save(outside / "via_dir_link.png")
    caption(outside / "via_dir_link.png")
    os.symlink(outside, root / "linked_dir")
    os.symlink(root, outside / "loop")  # a loop must not hang discovery
    return root


def test_every_bad_case_reported_and_every_good_case_converted(corpus, monkeypatch, tmp_path):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40_000)  # bomb.png (90,000 px) trips the guard
    spec = DatasetSpec("corpus", corpus, RULE, CaptionRule("textfile"), metadata_file=tmp_path / "meta.json")
    found = discover(spec)
    used = {s.path.name for s in found.samples}
    skipped = {p.name: why for p, why in found.skipped}
    assert {"ok.png", "UPPER.JPG", "Mixed.JpEg", "pic.webp", "pic.avif", "with space ünïcödé 猫.png",
            "inner.png", "cmyk.jpg", "gray.png", "sixteen.png", "palette.png", "alpha.png", "rotated.jpg",
            "link.png", "via_dir_link.png", "emptycaption.png"} <= used
    assert "0 bytes" in skipped["empty.png"]
    assert "truncated" in skipped["truncated.png"]  # header intact: the probe decodes a file cut off at its end
    assert "not a readable image" in skipped["cut_header.png"]
    assert "not a readable image" in skipped["notimage.jpg"]
    assert "minimum_image_size" in skipped["tiny.png"]
    assert "no caption file" in skipped["nocaption.png"]
    assert "decompression bomb" in skipped["bomb.png"]
    assert any("empty caption" in why for p, why in found.notes if p.name == "emptycaption.png")
    by_name = {s.path.name: s for s in found.samples}
    assert (by_name["rotated.jpg"].width, by_name["rotated.jpg"].height) == (48, 64)
    # Conversions: every mode to RGB the right way.
    assert load_rgb(corpus / "alpha.png").getpixel((0, 0)) == (255, 255, 255)
    r, g, b = load_rgb(corpus / "gray.png").getpixel((0, 0))
    assert r == g == b == 128
    assert abs(load_rgb(corpus / "sixteen.png").getpixel((0, 0))[0] - 127) <= 1
    cmyk = load_rgb(corpus / "cmyk.jpg").getpixel((32, 24))
    assert cmyk[0] > 150 and cmyk[1] < 60 and cmyk[2] < 60
    assert load_rgb(corpus / "rotated.jpg").size == (48, 64)
    # A file damaged after the scan: caching decodes it, fails, reports it.
    (corpus / "noise.png").write_bytes((corpus / "noise.png").read_bytes()[:5000])
    cache = TensorCache(tmp_path / "vae", {"test": 1})
    done, failed = fill_latent_cache(found.samples, cache, "center", 0, lambda px: px[:, :, ::8, ::8], 4)
    assert [p.name for p, _ in failed] == ["noise.png"] and "cannot decode" in failed[0][1]
    assert len(done) == len(found.samples) - 1


def test_caption_files_in_utf16_and_with_upper_case_extension(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    for name in ("notepad.png", "IMG_1.PNG", "latin.png"):
        Image.new("RGB", (64, 48)).save(root / name)
    (root / "notepad.txt").write_text("unicode caption\nsecond", encoding="utf-16")  # Notepad's "Unicode": a BOM
    (root / "IMG_1.TXT").write_text("upper case caption", encoding="utf-8")
    (root / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    found = discover(DatasetSpec("caps", root, RULE, CaptionRule("textfile"), metadata_file=tmp_path / "meta.json"))
    got = {s.path.name: s.captions for s in found.samples}
    assert got == {"notepad.png": ("unicode caption", "second"), "IMG_1.PNG": ("upper case caption",)}
    assert "save it as UTF-8" in dict((p.name, why) for p, why in found.skipped)["latin.png"]


@pytest.mark.parametrize("text", ["", "  \n\t\n"])
def test_empty_caption_note_names_the_instance_prompt_it_trains_with(tmp_path, text):
    image = tmp_path / "empty.png"
    Image.new("RGB", (64, 48)).save(image)
    caption(image, text)
    rule = CaptionRule("textfile", instance_prompt="sks", prepend_instance_prompt=True)
    result = captions.caption(image, tmp_path, rule, None)
    assert result.captions == ("sks",) and result.note == "empty caption file: trained with instance_prompt 'sks' alone"
    plain = captions.caption(image, tmp_path, CaptionRule("textfile"), None)
    assert plain.captions == ("",) and plain.note == "empty caption file: trained with an empty prompt"
