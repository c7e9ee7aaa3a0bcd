"""Odd files in a dataset folder: every filesystem error on one file is a line in the data report (never a
traceback), images far below their bucket are left out or noted, hidden files and folders are not used."""

import os
import sys

import pytest
from PIL import Image

from conftest import write_config
from difftune.cli import main
from difftune.config import load_config
from difftune.data import discovery, metadata
from difftune.data.buckets import SizeRule
from difftune.data.captions import CaptionRule
from difftune.data.discovery import DatasetSpec, discover
from difftune.train.setup import build_run

RULE = SizeRule(resolution=64, resolution_type="pixel_area", crop=False, crop_aspect="square", multiple=16)


def image(path, size=(64, 64), text="a picture"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 30, 30)).save(path)
    path.with_suffix(".txt").write_text(text)
    return path


def run(root, rule=RULE):
    found = discover(DatasetSpec("d", root, rule, CaptionRule("textfile")))
    return {s.path.name for s in found.samples}, {p.name: why for p, why in found.skipped}, found


@pytest.fixture
def links(tmp_path):
    root = tmp_path / "data"
    image(root / "ok.png")
    for name in ("broken", "self", "ping", "pong"):
        (root / f"{name}.txt").write_text("a caption")
    os.symlink(tmp_path / "nowhere.png", root / "broken.png")
    os.symlink(root / "self.png", root / "self.png")
    os.symlink(root / "pong.png", root / "ping.png")
    os.symlink(root / "ping.png", root / "pong.png")
    return root


def test_broken_and_looping_symlinks_are_reported_not_raised(links):
    used, skipped, _ = run(links)
    assert used == {"ok.png"}
    assert "broken symlink" in skipped["broken.png"] and "nowhere.png" in skipped["broken.png"]
    assert "symlink loop" in skipped["self.png"]
    assert "symlink loop" in skipped["ping.png"] and "symlink loop" in skipped["pong.png"]


def test_check_and_train_report_bad_links_without_traceback(tmp_path, links, capsys):
    image(links / "second.png")  # a batch of 1 needs one image; two make the report's counts telling
    config = write_config(tmp_path, links, max_train_steps=1)
    assert main(["check", "--config", str(config)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert "broken.png: broken symlink" in out.out and "self.png: symlink loop" in out.out
    assert "left out (4)" in out.out
    run = build_run(load_config(config))  # train's start: discovery, caches, the report
    assert sorted(c.sample.path.name for c in run.data.items) == ["ok.png", "second.png"]
    assert "pong.png: symlink loop" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform == "win32", reason="FIFOs are POSIX")
def test_fifo_and_folder_as_image_are_never_opened(tmp_path):
    root = tmp_path / "data"
    image(root / "ok.png")
    os.mkfifo(root / "pipe.png")  # opening it to probe would block discovery forever
    (root / "pipe.txt").write_text("a caption")
    used, skipped, _ = run(root)
    assert used == {"ok.png"} and "not a regular file" in skipped["pipe.png"]


def test_permission_vanished_and_stat_errors_are_reported(tmp_path, monkeypatch):
    root = tmp_path / "data"
    for name in ("ok", "denied", "vanishing", "stat_fails"):
        image(root / f"{name}.png")
    (root / "locked").mkdir()
    image(root / "locked" / "inner.png")
    real_probe, real_caption, real_stat, real_scandir = (
        metadata.probe_image, discovery.caption, discovery.Path.stat, os.scandir)

    def probe(path):
        if path.name == "denied.png":  # what a non-root user gets from a chmod 000 file
            raise PermissionError(13, "Permission denied", str(path))
        return real_probe(path)

    def caption(path, *args):
        if path.name == "vanishing.png":
            path.unlink()  # deleted between the listing and the probe
        return real_caption(path, *args)

    def stat(self, *args, **kwargs):
        if self.name == "stat_fails.png":
            raise OSError(5, "Input/output error", str(self))
        return real_stat(self, *args, **kwargs)

    def scandir(path="."):
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(metadata, "probe_image", probe)
    monkeypatch.setattr(discovery, "caption", caption)
    monkeypatch.setattr(discovery.Path, "stat", stat)
    monkeypatch.setattr(os, "scandir", scandir)
    used, skipped, _ = run(root)
    assert used == {"ok.png"}
    assert "Permission denied" in skipped["denied.png"]
    assert "No such file" in skipped["vanishing.png"]
    assert "Input/output error" in skipped["stat_fails.png"]
    assert "folder not readable" in skipped["locked"] and "Permission denied" in skipped["locked"]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads every file")
def test_real_unreadable_file(tmp_path):
    root = tmp_path / "data"
    image(root / "ok.png")
    os.chmod(image(root / "locked.png"), 0)
    used, skipped, _ = run(root)
    assert used == {"ok.png"} and "ermission denied" in skipped["locked.png"]


def test_images_far_below_the_bucket(tmp_path):
    root = tmp_path / "data"
    for size in (1, 8, 16, 48, 64):
        image(root / f"s{size}.png", (size, size))
    image(root / "strip.png", (64, 4))  # wide and thin: enlarged to cover a bucket of its aspect
    used, skipped, found = run(root)
    notes = {p.name: why for p, why in found.notes}
    assert {"s16.png", "s48.png", "s64.png"} <= used
    for name in ("s1.png", "s8.png"):  # 64x and 8x: left out, and the report says how to choose otherwise
        assert "far below" in skipped[name] and "minimum_image_size" in skipped[name]
    assert "enlarged 4.0x" in notes["s16.png"]  # used, with a note
    assert "s48.png" not in notes and "s64.png" not in notes
    # With minimum_image_size the user chose the floor: it alone decides, the notes stay.
    chosen = SizeRule(64, "pixel_area", False, "square", 16, minimum_image_size=4)
    used, skipped, found = run(root, chosen)
    assert "s8.png" in used and "minimum_image_size" in skipped["s1.png"]
    assert any(p.name == "s8.png" and "enlarged 8.0x" in why for p, why in found.notes)


def test_hidden_files_and_folders_are_not_used(tmp_path):
    root = tmp_path / "data"
    image(root / "ok.png")
    image(root / "sub" / "nested.png")
    image(root / ".hidden" / "a.png")
    image(root / "sub" / ".thumbs" / "b.png")
    image(root / ".dotfile.png")
    used, skipped, found = run(root)
    assert used == {"ok.png", "nested.png"} and not skipped
    note = dict((p, why) for p, why in found.notes)[root]
    assert note.startswith("4 hidden")  # .hidden/, .thumbs/, .dotfile.png and its caption


def test_a_file_name_that_is_not_utf8_is_read(tmp_path):
    """A Latin-1 name (caf\\xe9.png, from an old archive or a Windows share) stopped check, cache and train with a
    UnicodeEncodeError that named no file."""
    import os
    import subprocess
    import sys

    from PIL import Image

    from conftest import write_config

    images = tmp_path / "images"
    images.mkdir()
    for name in (b"caf\xe9", b"plain"):
        base = os.fsencode(images) + b"/" + name
        Image.new("RGB", (64, 64), (200, 30, 30)).save(base + b".png", format="PNG")
        with open(base + b".txt", "w") as f:
            f.write("a red square")
    path = write_config(tmp_path, images, max_train_steps=1)
    for command in ("check", "cache"):
        done = subprocess.run([sys.executable, "-m", "difftune", command, "--config", str(path)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    assert "latent cache: 2 files" in done.stdout + done.stderr


def test_photos_above_pils_warning_size_are_read(tmp_path, monkeypatch):
    """PIL warns above MAX_IMAGE_PIXELS (89.5 MP) and refuses above twice that; a 102 MP camera's photos were left
    out as a "decompression bomb". Between the two they are read now; above, still refused with the size."""
    from PIL import Image

    from difftune.data.images import BadImage, probe_size

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    Image.new("RGB", (50, 30)).save(tmp_path / "big.png")  # 1,500 pixels: over the warning, under the refusal
    Image.new("RGB", (50, 50)).save(tmp_path / "huge.png")  # 2,500: over the refusal
    assert probe_size(tmp_path / "big.png") == (50, 30)
    with pytest.raises(BadImage, match="too many pixels"):
        probe_size(tmp_path / "huge.png")


def test_animations_are_noted_as_trained_on_their_first_frame(tmp_path):
    root = tmp_path / "data"
    image(root / "still.png")
    frames = [Image.new("RGB", (64, 64), colour) for colour in ((255, 0, 0), (0, 255, 0))]
    for name, fmt in (("moving.gif", "GIF"), ("moving.webp", "WEBP"), ("moving.png", "PNG")):
        frames[0].save(root / name, fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)
        (root / name).with_suffix(".txt").write_text("a caption")
    frames[0].save(root / "one-frame.gif")
    frames[0].save(root / "phone.jpg", "MPO", save_all=True, append_images=frames[1:])  # a photo and its preview
    for name in ("one-frame", "phone"):
        (root / f"{name}.txt").write_text("a caption")
    spec = DatasetSpec("d", root, RULE, CaptionRule("textfile"), metadata_file=tmp_path / "meta.json")
    for _ in range(2):  # probed, then read from the metadata cache
        found = discover(spec)
        noted = {p.name for p, why in found.notes if "an animation: trained on its first frame only" in why}
        assert noted == {"moving.gif", "moving.webp", "moving.png"}, found.notes
        assert len(found.samples) == 6
    with Image.open(root / "phone.jpg") as img:
        assert img.format == "MPO" and img.n_frames == 2  # what the probe passes over


def test_caption_table_rows_naming_no_file_are_noted(tmp_path):
    import json

    from difftune.config.datasets import ParquetCaptions
    from difftune.data.captions import CaptionTable

    root = tmp_path / "data"
    image(root / "one.png")
    table_path = tmp_path / "captions.jsonl"
    table_path.write_text("\n".join(json.dumps({"file": f"{n}.png", "text": n}) for n in ("one", "renamed", "gone")))
    table = CaptionTable(table_path, ParquetCaptions(path=str(table_path), filename_column="file", caption_column="text"))
    found = discover(DatasetSpec("d", root, RULE, CaptionRule("parquet"), table=table))
    assert [s.caption for s in found.samples] == ["one"]
    assert (table_path, f"2 row(s) name no image in {root}: not used ('renamed.png', 'gone.png')") in found.notes
