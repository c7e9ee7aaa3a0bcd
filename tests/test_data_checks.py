"""What `difftune check` says about the data before any model loads: training's bucket plan (pruning,
oversubscription, the "fewer images than one global batch" failure), files of types a dataset does not read,
.avi/.m4v/.mpg clips, minimum_image_size in its unit, image-to-video's floor of frames and i2i input images of
another aspect."""

from fractions import Fraction

import av
import numpy as np
import pytest
from PIL import Image

from conftest import write_config
from difftune.cli import main
from difftune.config import load_config
from difftune.data.buckets import SizeRule, minimum_above_resolution, too_small_problem
from difftune.data.captions import CaptionRule
from difftune.data.discovery import DatasetSpec, discover
from difftune.data.report import DataReport
from difftune.data.video import decode_frames
from difftune.demo import make_dataset
from difftune.train import setup
from difftune.train.plan import DataError, check_data, dataset_spec, discover_all, size_rules
from difftune.train.setup import build_run


@pytest.fixture
def two_images(tmp_path):
    folder = tmp_path / "images"
    make_dataset(folder, count=2)
    return folder


def first_line(text: str) -> str:
    return text.strip().splitlines()[0]


# ----------------------------------------------------------------- the bucket plan


def test_check_fails_with_trainings_message_before_any_model(tmp_path, two_images, capsys, monkeypatch):
    """train_batch_size 4 with 2 images: check fails (it used to print OK) with the message training gives, and the
    data report shows the pruned bucket; training now fails the same way before it loads the model."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = write_config(tmp_path, two_images, train_batch_size=4)
    assert main(["check", "--config", str(path)]) == 2
    said = capsys.readouterr().err
    assert first_line(said) == ("error: every aspect bucket holds fewer images than one global batch (4); lower "
                                "train_batch_size, add images, set allow_dataset_oversubscription (raises each small "
                                "dataset's repeats) or repeats on the dataset entries, or set disable_bucket_pruning")
    assert "pruned bucket 64x64 of train: 2 item(s), fewer than one batch" in said
    assert "buckets planned for 1 process(es) (WORLD_SIZE is not set" in said
    assert " OK " not in said

    def no_model(cfg):
        raise AssertionError("the model was looked for")

    monkeypatch.setattr(setup, "resolve_source", no_model)
    with pytest.raises(DataError) as info:
        build_run(load_config(path))
    assert "error: " + first_line(str(info.value)) == first_line(said)


def test_check_prints_the_buckets_and_the_pruning(tmp_path, capsys, monkeypatch):
    """Three square images and one wide: batch 2 prunes the wide bucket, as the training data report does."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    images = tmp_path / "images"
    make_dataset(images, count=3, size=(64, 64))
    make_dataset(tmp_path / "wide", count=1, size=(96, 48), seed=1)
    for p in (tmp_path / "wide").iterdir():
        p.rename(images / f"wide-{p.name}")
    path = write_config(tmp_path, images, train_batch_size=2)
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  train                          4       3         1" in out
    assert "buckets (with repeats): 64x64: 3\n" in out
    assert "pruned bucket 96x48 of train: 1 item(s), fewer than one batch" in out
    assert "one global batch is 2 (train_batch_size 2 x 1)" in out
    # allow_dataset_oversubscription: raised repeats instead of pruning, as training would
    text = check_data(load_config(write_config(tmp_path / "o", images, train_batch_size=2,
                                               allow_dataset_oversubscription=True)))
    assert "buckets (with repeats): 64x64: 6, 96x48: 2" in text and "pruned" not in text
    assert "repeats of train raised from 0 to 1 (allow_dataset_oversubscription)" in text


def test_check_plans_for_world_size_processes(tmp_path, two_images, monkeypatch):
    path = write_config(tmp_path, two_images, train_batch_size=1)
    assert "one global batch is 1" in check_data(load_config(path))
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(DataError) as info:
        check_data(load_config(path))
    assert "fewer images than one global batch (3)" in str(info.value)
    assert "buckets planned for 3 process(es) (WORLD_SIZE)" in str(info.value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "buckets planned for 2 process(es) (WORLD_SIZE): one global batch is 2" in check_data(load_config(path))
    with pytest.raises(DataError, match="fewer images than one global batch"):  # `difftune plan` scans the same way
        discover_all(load_config(write_config(tmp_path / "b", two_images, train_batch_size=2)))


# ----------------------------------------------------------------- files a dataset does not read


def make_clip(path, codec, fps=24, frames=9, size=(32, 24)):
    """A clip written by PyAV in the container its suffix names (MPEG-PS wants MPEG-1/2 video)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), i * 20 % 256, np.uint8), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


CLIPS = {"a.avi": ("mpeg4", 24), "b.m4v": ("libx264", 24), "c.mpg": ("mpeg2video", 25), "d.mpeg": ("mpeg1video", 25)}


def test_avi_m4v_mpg_clips_are_read_and_other_files_reported(tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    for name, (codec, fps) in CLIPS.items():
        make_clip(clips / name, codec, fps)
        (clips / name).with_suffix(".txt").write_text(f"clip {name}")
    Image.new("RGB", (32, 24)).save(clips / "still.png")
    Image.new("RGB", (32, 24)).save(clips / "still2.png")
    (clips / "notes.md").write_text("not data")
    run = load_config(write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random",
                                   dataset={"dataset_type": "video", "resolution": 32,
                                            "video": {"num_frames": 5, "frame_rate": 24}}))
    (found,) = discover_all(run, write_metadata=False)
    assert sorted(s.path.name for s in found.samples) == sorted(CLIPS)
    assert all(s.frames == 5 for s in found.samples) and found.skipped == []
    for s in found.samples:  # what caching decodes
        frames = decode_frames(s.path, [k / 24 for k in range(5)])
        assert len(frames) == 5 and frames[0].size == (32, 24)
    report = DataReport([found], [], {}).render()
    assert "  not read (3 file(s) of other types):" in report
    assert f"{clips / 'notes.md'}: .md is not read; video datasets read .avi, .gif, .m4v, .mkv, .mov, .mp4, " \
           ".mpeg, .mpg, .webm\n" in report
    assert f"{clips / 'still.png'}: .png is not read (nor 1 more .png file(s)); video datasets read" in report
    assert "images go in an image dataset" in report
    assert ".txt" not in report  # captions are not reported


def test_a_folder_with_nothing_to_read_says_what_was_looked_for(tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    Image.new("RGB", (32, 24)).save(clips / "still.png")
    (clips / "still.txt").write_text("a still")
    run = load_config(write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random",
                                   dataset={"dataset_type": "video", "resolution": 32}))
    with pytest.raises(DataError) as info:
        discover_all(run, write_metadata=False)
    text = str(info.value)
    assert f"have no usable image or clip (no .avi/.gif/.m4v/.mkv/.mov/.mp4/.mpeg/.mpg/.webm file in {clips}, only 1 " \
           "file(s) of other types, not read (see below))" in text
    assert "see each file's reason" not in text
    assert f"{clips / 'still.png'}: .png is not read" in text
    # an image dataset names the clips it does not read
    images = tmp_path / "images"
    images.mkdir()
    make_clip(images / "a.mp4", "libx264")
    with pytest.raises(DataError) as info:
        discover_all(load_config(write_config(tmp_path / "i", images)), write_metadata=False)
    assert f"no .avif/.bmp/.gif/.jpeg/.jpg/.png/.tif/.tiff/.webp file in {images}" in str(info.value)
    assert "a.mp4: .mp4 is not read; image datasets read" in str(info.value)
    assert "clips go in a dataset_type 'video' entry" in str(info.value)


# ----------------------------------------------------------------- minimum_image_size in its unit


def test_minimum_image_size_names_its_unit():
    area = SizeRule(0.004096, "area", False, "square", 16, minimum_image_size=32)
    assert too_small_problem(96, 96, area) == ("96x96 = 0.00922 MP is below minimum_image_size 32 (megapixels, as "
                                               "resolution_type is 'area')")
    pixel = SizeRule(64, "pixel", False, "square", 16, minimum_image_size=100)
    assert too_small_problem(96, 64, pixel) == ("96x64 (short edge 64 px) is below minimum_image_size 100 (pixels "
                                                "of the short edge, as resolution_type is 'pixel')")
    assert too_small_problem(128, 128, pixel) is None
    side = SizeRule(64, "pixel_area", False, "square", 16, minimum_image_size=100)
    assert "96x64 (a square of equal area has 78 px sides) is below minimum_image_size 100" in too_small_problem(
        96, 64, side)
    assert "both in megapixels" in minimum_above_resolution(area)
    assert minimum_above_resolution(SizeRule(64, "pixel", False, "square", 16, minimum_image_size=64)) is None


def test_check_warns_when_minimum_image_size_is_above_resolution(tmp_path, two_images):
    run = load_config(write_config(tmp_path, two_images, dataset={"resolution": 0.004096, "resolution_type": "area",
                                                                  "minimum_image_size": 32}))
    with pytest.raises(DataError) as info:
        discover_all(run, write_metadata=False)
    text = str(info.value)
    assert "64x64 = 0.0041 MP is below minimum_image_size 32 (megapixels, as resolution_type is 'area')" in text
    assert f"{two_images}: minimum_image_size 32 is above resolution 0.004096, both in megapixels" in text


# ----------------------------------------------------------------- image-to-video's floor of frames


def i2v_discovery(tmp_path, video):
    clips = tmp_path / "clips"
    clips.mkdir(exist_ok=True)
    make_clip(clips / "short.mp4", "libx264", frames=3)
    make_clip(clips / "seven.mp4", "libx264", frames=7)
    for name in ("short", "seven"):
        (clips / f"{name}.txt").write_text(name)
    run = load_config(write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random-i2v",
                                   dataset={"dataset_type": "video", "resolution": 32, "video": video}))
    ds = run.datasets.images[0]
    found = discover(dataset_spec(run, ds, size_rules(run)[0], write_metadata=False))
    return {p.name: reason for p, reason in found.skipped}, {s.path.name for s in found.samples}


def test_image_to_video_floor_of_frames_is_named(tmp_path):
    skipped, used = i2v_discovery(tmp_path, {"num_frames": 9, "bucket_strategy": "resolution_frames",
                                             "frame_rate": 24})
    assert skipped["short.mp4"] == ("3 frame(s) at 24 fps: image-to-video needs at least 5 frames (the first frame "
                                    "is the input image, the frames after it are trained)")
    assert used == {"seven.mp4"}
    # frame_interval 8: 7 frames round down to 1, which the dataset's own rule keeps and the floor does not
    skipped, used = i2v_discovery(tmp_path, {"num_frames": 9, "bucket_strategy": "resolution_frames",
                                             "frame_rate": 24, "frame_interval": 8})
    assert skipped["seven.mp4"].startswith("7 frame(s) at 24 fps round down to 1 (frame_interval 8): "
                                           "image-to-video needs at least 5 frames")
    # a min_frames the user set above the floor is named as before
    skipped, _ = i2v_discovery(tmp_path, {"num_frames": 9, "bucket_strategy": "resolution_frames",
                                          "frame_rate": 24, "min_frames": 6})
    assert skipped["short.mp4"] == "3 frame(s) at 24 fps, below min_frames 6"
    # aspect_ratio buckets: the dataset's own num_frames leaves it out, not a min_frames it never set
    skipped, _ = i2v_discovery(tmp_path, {"num_frames": 17, "frame_rate": 24})
    assert "min_frames" not in skipped["short.mp4"] and "num_frames 17" in skipped["short.mp4"], skipped
    # a clip of another rate: its own frames are said beside the counts at the dataset's rate
    skipped, _ = i2v_discovery(tmp_path, {"num_frames": 17, "frame_rate": 12})
    assert skipped["short.mp4"].endswith("(the clip has 3 frames at 24 fps, taken at 12 fps)"), skipped


# ----------------------------------------------------------------- i2i input images of another aspect


def test_input_image_of_another_aspect_gets_a_note(tmp_path):
    edits, inputs = tmp_path / "edits", tmp_path / "inputs"
    edits.mkdir()
    inputs.mkdir()
    sizes = {"dog": ((96, 64), (128, 128)), "cat": ((64, 64), (128, 128)), "owl": ((96, 64), (48, 32))}
    for name, (target, source) in sizes.items():
        Image.new("RGB", target).save(edits / f"{name}.png")
        (edits / f"{name}.txt").write_text(name)
        Image.new("RGB", source).save(inputs / f"{name}.png")
    Image.new("RGB", (64, 64)).save(edits / "fox.png")
    (edits / "fox.txt").write_text("fox")
    (inputs / "fox.png").write_bytes(b"not an image")
    spec = DatasetSpec("edits", edits, SizeRule(64, "pixel_area", True, "preserve", 16), CaptionRule("textfile"),
                       conditioning_root=inputs)
    found = discover(spec)
    notes = {p.name: r for p, r in found.notes}
    assert notes == {"dog.png": "its input image is 128x128 (aspect 1.00), the image 96x64 (1.50): the input image "
                                "is resized to cover the 80x48 bucket and cropped to it, so part of it is cut off"}
    skipped = {p.name: r for p, r in found.skipped}
    assert skipped["fox.png"].startswith(f"its conditioning image {inputs / 'fox.png'}: ")
    assert sorted(s.path.name for s in found.samples) == ["cat.png", "dog.png", "owl.png"]


def test_t2v_trains_on_avi_m4v_and_mpg_clips(tmp_path):
    """Clips of the newly read containers go through the latent cache and train (the tiny Kandinsky 5 Video)."""
    from difftune.train.loop import train

    clips = tmp_path / "clips"
    clips.mkdir()
    for name, (codec, fps) in CLIPS.items():
        make_clip(clips / name, codec, fps, frames=12)
        (clips / name).with_suffix(".txt").write_text(f"clip {name}")
    path = write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random",
                        max_train_steps=2, frame_rate=24,
                        dataset={"dataset_type": "video", "resolution": 32, "video": {"num_frames": 9}})
    run = build_run(load_config(path))
    assert sorted(c.sample.path.name for c in run.data.items) == sorted(CLIPS)
    assert all(c.latent_file is not None and c.latent_file.is_file() for c in run.data.items)
    train(run)
    assert (run.output_dir / "pytorch_lora_weights.safetensors").is_file()


def test_disable_bucket_pruning_keeps_small_buckets_on_one_process_only(tmp_path, dataset, monkeypatch):
    """With several processes training drops a partial batch; check reported the small bucket as used."""
    from difftune.train.plan import DataError, check_data

    path = write_config(tmp_path, dataset, train_batch_size=3, disable_bucket_pruning=True)  # 4 images
    assert "pruned bucket" not in check_data(load_config(path))
    monkeypatch.setenv("WORLD_SIZE", "2")  # one global batch of 6: no bucket fills it
    with pytest.raises(DataError, match="disable_bucket_pruning keeps small buckets on one process only") as error:
        check_data(load_config(path))
    assert "or set disable_bucket_pruning" not in str(error.value)  # set already: not advised again


def test_long_per_file_lists_are_cut_on_the_console(tmp_path, capsys):
    """20,000 small images at a large resolution gave a note per image (18,938 lines) around the summary: the
    console shows 20 of each list and where the rest are; `difftune check --all` lists every one."""
    images = tmp_path / "images"
    images.mkdir()
    for i in range(26):
        Image.new("RGB", (24, 24), (i * 9, 40, 90)).save(images / f"{i:03d}.png")
        (images / f"{i:03d}.txt").write_text("a small square")
    path = write_config(tmp_path, images, dataset={"resolution": 64, "resolution_type": "pixel"})
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "notes (26):" in out and "    ... and 6 more (difftune check --all lists them all)" in out, out
    assert sum(line.endswith("it will look blurry (set minimum_image_size to leave such images out)")
               or "enlarged" in line for line in out.splitlines()) == 20
    assert main(["check", "--all", "--config", str(path)]) == 0
    assert "... and" not in capsys.readouterr().out


def test_items_that_fill_no_batch_are_said(tmp_path, capsys):
    """One process trains full batches only (as SimpleTuner): 3 images of a bucket with batches of 2 leave one out
    each epoch, while the report said every image was used."""
    images = tmp_path / "images"
    images.mkdir()
    for i, size in enumerate([(64, 64)] * 4 + [(96, 64)] * 3 + [(64, 96)] * 2):
        Image.new("RGB", size, (i * 20, 60, 90)).save(images / f"{i:02d}.png")
        (images / f"{i:02d}.txt").write_text("a shape")
    path = write_config(tmp_path, images, train_batch_size=2, dataset={"resolution": 64})
    assert main(["check", "--config", str(path)]) == 0
    line = "incomplete batches: 1 item(s) per epoch do not fill a batch in their bucket"
    assert line in capsys.readouterr().out
    from difftune.train.setup import build_run

    run = build_run(load_config(path))
    assert run.data.sampler.left_per_epoch() == 1
    assert main(["check", "--config", str(write_config(tmp_path, images, train_batch_size=2,
                                                       disable_bucket_pruning=True,
                                                       dataset={"resolution": 64}))]) == 0
    assert "incomplete batches" not in capsys.readouterr().out


def test_the_no_usable_file_error_lists_twenty(tmp_path, capsys):
    """20,000 uncaptioned images printed 20,005 lines after the one useful line."""
    images = tmp_path / "images"
    images.mkdir()
    for i in range(30):
        Image.new("RGB", (64, 64)).save(images / f"{i:02d}.png")
    assert main(["check", "--config", str(write_config(tmp_path, images))]) == 2
    err = capsys.readouterr().err
    assert "have no usable image or clip" in err and "    ... and 10 more" in err, err


def test_a_clip_that_fails_while_caching_loses_its_notes(tmp_path):
    """A clip left out while caching (it stops decoding) was also listed under notes as "trimmed to the first 17 of
    30 frames": the report contradicted itself."""
    from difftune.data.discovery import Discovery

    bad, good = tmp_path / "bad.mp4", tmp_path / "good.mp4"
    found = Discovery("clips", notes=[(bad, "trimmed to the first 17 of 30 frames"),
                                      (good, "trimmed to the first 17 of 40 frames")])
    report = DataReport([found], [(bad, "cannot decode after 13 frames")], {}).render()
    assert f"{bad}: cannot decode after 13 frames" in report and f"{good}: trimmed" in report
    assert f"{bad}: trimmed" not in report and "notes (1):" in report
