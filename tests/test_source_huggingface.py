"""Type 'huggingface' datasets (config/source_huggingface_keys.py, data/sources/huggingface.py): the keys and their
misuse, and the download through datasets' real load_dataset from local folders in the hub's layout (parquet files
under data/ with a README.md card, an image folder with metadata.jsonl), the same call a hub id goes through; the
hub itself cannot be reached here."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import config_problems, write_config
from difftune.config import ImageDataset, load_config
from difftune.config.pending import PENDING_VALUES
from difftune.data.sources import SourceError, fetch_all
from difftune.data.sources import huggingface as hf

CARD = """---
dataset_info:
  features:
  - name: image
    dtype: image
  - name: caption
    dtype: string
  - name: tags
    list: string
  - name: alt
    dtype: string
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
---
# a tiny test dataset
"""


def encoded(colour, fmt: str, size=(40, 32)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, fmt)
    return buffer.getvalue()


ROWS = [  # (image bytes, caption, tags, alt)
    (encoded((255, 0, 0), "JPEG"), "a red\nsquare", ["red", "square"], None),
    (encoded((0, 255, 0), "PNG"), "", ["green"], "a green alt"),  # empty caption: the fallback column
    (encoded((0, 0, 255), "PPM"), "a blue square", [], None),  # a format not trained from: re-encoded to PNG
    (b"not an image at all", "broken", [], None),  # undecodable: reported and skipped
    (encoded((9, 9, 9), "JPEG"), None, [], None),  # no caption anywhere: reported and skipped
]


def hub_folder(root: Path, rows=ROWS) -> Path:
    """A dataset folder in the hub's layout, written by datasets itself (to_parquet keeps the Image feature)."""
    from datasets import Dataset, Features, List, Value
    from datasets import Image as ImageFeature

    features = Features({"image": ImageFeature(), "caption": Value("string"), "tags": List(Value("string")),
                         "alt": Value("string")})
    table = {"image": [{"bytes": r[0], "path": None} for r in rows], "caption": [r[1] for r in rows],
             "tags": [r[2] for r in rows], "alt": [r[3] for r in rows]}
    (root / "data").mkdir(parents=True)
    Dataset.from_dict(table, features=features).to_parquet(str(root / "data" / "train-00000-of-00001.parquet"))
    (root / "README.md").write_text(CARD)
    return root


def entry(tmp_path, name: Path, folder="dl", **keys) -> ImageDataset:
    return ImageDataset.model_validate({
        "id": "hub", "type": "huggingface", "dataset_name": str(name), "instance_data_dir": str(tmp_path / folder),
        "fallback_caption_column": "alt", "cache_dir": str(tmp_path / "hf-cache"), **keys})


def run(ds: ImageDataset) -> list[str]:
    said: list[str] = []
    fetch_all([ds], said.append)
    return said


def stamps(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.name != hf.MANIFEST}


# --- config ---------------------------------------------------------------------------------------------------

def test_keys_parse(tmp_path, dataset):
    assert ("type", "huggingface") not in PENDING_VALUES
    path = write_config(tmp_path, dataset, caption_strategy="textfile", dataset={
        "type": "huggingface", "dataset_name": "user/set", "instance_data_dir": None, "caption_strategy": None,
        "metadata_backend": "huggingface", "split": "validation", "image_column": "jpg",
        "huggingface": {"caption_column": ["short", "long"], "fallback_caption_column": "tags", "streaming": True}})
    ds = load_config(path).datasets.images[0]
    # the config-level caption_strategy is not handed to a huggingface entry (SimpleTuner's rule)
    assert ds.caption_strategy == "huggingface" and ds.instance_data_dir == "cache/sources/train"
    assert (ds.split, ds.image_column, ds.caption_column) == ("validation", "jpg", ["short", "long"])
    assert ds.fallback_caption_column == "tags" and ds.streaming is True and ds.revision is None


@pytest.mark.parametrize("keys,expected", [
    ({}, "type 'huggingface' needs dataset_name"),
    ({"dataset_name": "a/b", "caption_strategy": "textfile"}, "caption_strategy 'textfile' does not go with"),
    ({"dataset_name": "a/b", "caption_strategy": "filename"}, "caption_strategy 'filename' does not go with"),
    ({"dataset_name": "a/b", "split": "train", "huggingface": {"split": "test"}}, "split is given twice"),
    ({"dataset_name": "a/b", "huggingface": {"filter_func": {"min_width": 512}}}, "huggingface.filter_func"),
    ({"dataset_name": "a/b", "huggingface": {"width_column": "w"}}, "sizes are read from the downloaded files"),
    ({"dataset_name": "a/b", "huggingface": {"description_column": "d"}}, "use fallback_caption_column"),
    ({"dataset_name": "a/b", "huggingface": {"nonsense": 1}}, "huggingface.nonsense"),
    ({"dataset_name": "a/b", "auto_load": True}, "auto_load"),
    ({"dataset_name": "a/b", "filter_func": {"collection": "x"}}, "filter_func"),
    ({"dataset_name": "a/b", "caption_strategy": "instanceprompt", "instance_prompt": "p", "caption_column": "c"},
     "caption_column is not read with caption_strategy 'instanceprompt'"),
    ({"dataset_name": "a/b", "dataset_type": "video", "image_column": "img"}, "image_column is not read by a video"),
    ({"dataset_name": "a/b", "video_column": "clip"}, "video_column is not read by a image dataset"),
    ({"dataset_name": "a/b", "streaming": True, "num_proc": 4}, "remove num_proc or streaming"),
    ({"dataset_name": "a/b", "streaming": True, "split": "train[:10]"}, "cannot do while streaming"),
    ({"dataset_name": "a/b", "caption_column": []}, "caption_column needs a column name"),
    ({"type": "local", "split": "test"}, "split belongs to type 'huggingface' datasets; this one is type 'local'"),
    ({"type": "local", "dataset_name": "a/b"}, "dataset_name belongs to type 'huggingface'"),
    ({"type": "local", "huggingface": {"split": "x"}}, "huggingface belongs to type 'huggingface'"),
    ({"type": "local", "metadata_backend": "huggingface"}, "metadata_backend 'huggingface' belongs to type"),
])
def test_misuse_names_the_key(tmp_path, dataset, keys, expected):
    if keys.get("type") != "local":  # (conftest's entry says textfile: unset it, as a SimpleTuner entry leaves it)
        keys = {"type": "huggingface", "caption_strategy": None, **keys}
    text = config_problems(write_config(tmp_path, dataset, dataset=keys))
    assert expected in text, text


# --- fetch ----------------------------------------------------------------------------------------------------

def test_download_resume_and_captions(tmp_path):
    source = hub_folder(tmp_path / "hub")
    ds = entry(tmp_path, source)
    folder = tmp_path / "dl"
    said = run(ds)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "00000000.jpg", "00000000.txt", "00000001.png", "00000001.txt", "00000002.png", "00000002.txt"]
    assert (folder / "00000000.jpg").read_bytes() == ROWS[0][0]  # the original bytes, not re-encoded
    assert (folder / "00000001.png").read_bytes() == ROWS[1][0]
    with Image.open(folder / "00000002.png") as img:  # the PPM, re-encoded losslessly
        assert img.format == "PNG" and np.array_equal(np.asarray(img), np.asarray(Image.open(io.BytesIO(ROWS[2][0]))))
    assert (folder / "00000000.txt").read_text() == "a red square\n"  # a newline inside a caption: a space
    assert (folder / "00000001.txt").read_text() == "a green alt\n"  # empty caption_column: the fallback
    assert any("row 3: not a readable image" in s for s in said)
    assert any("row 4: no caption in caption_column 'caption' nor fallback_caption_column 'alt'" in s for s in said)
    assert "3 files downloaded, 0 already there, 2 rows skipped" in said[-1]
    assert list((tmp_path / "hf-cache").rglob("*.arrow")), "cache_dir holds datasets' prepared copy"
    manifest = json.loads((folder / hf.MANIFEST).read_text())
    assert manifest["type"] == "huggingface" and manifest["source"]["dataset_name"] == str(source)
    from difftune.data.discovery import _not_downloaded  # what the data report lists as left out

    assert [where for where, _ in _not_downloaded(folder)] == ["row 3", "row 4"]

    before = stamps(folder)  # a second run: nothing written
    assert "0 files downloaded, 3 already there, 2 rows skipped" in run(ds)[-1]
    assert stamps(folder) == before

    (folder / "00000001.png").unlink()  # a partial folder (and the leftover of a killed write) is completed
    (folder / ".00000002.abc.difftune.tmp").write_bytes(b"half")
    assert "1 files downloaded, 2 already there" in run(ds)[-1]
    assert (folder / "00000001.png").read_bytes() == ROWS[1][0]
    assert not list(folder.glob("*.tmp")) and not list(folder.glob(".*.tmp"))
    assert stamps(folder)["00000000.jpg"] == before["00000000.jpg"]

    # another caption column: the captions are rewritten, the images kept
    said = run(entry(tmp_path, source, caption_column=["caption", "tags"]))
    assert "0 files downloaded, 3 already there, 2 rows skipped, 2 caption files updated" in said[-1]
    assert (folder / "00000000.txt").read_text() == "a red square\nred\nsquare\n"
    assert (folder / "00000001.txt").read_text() == "green\n"  # the list column now gives it: no fallback
    assert stamps(folder)["00000002.txt"] == before["00000002.txt"]  # the same caption: not rewritten
    assert stamps(folder)["00000000.jpg"] == before["00000000.jpg"]


def test_a_changed_source_is_checked_row_by_row(tmp_path):
    """A new revision of the data (here: its first row removed, so every row moved up one) is checked against
    the files: each row's file is its own again (it kept the earlier row's image under the new row's caption),
    and the files of rows gone or now skipped are removed."""
    source = hub_folder(tmp_path / "hub")
    ds = entry(tmp_path, source)
    run(ds)
    folder = tmp_path / "dl"
    shutil.rmtree(source)
    hub_folder(source, rows=ROWS[1:3] + [(ROWS[0][0], "", [], None)])  # green, blue, then red without a caption
    said = run(ds)
    assert "0 files downloaded" not in said[-1] and "2 files replaced" in said[-1], said[-1]
    assert "files of rows gone or skipped removed" in said[-1] and any("row 2: no caption" in s for s in said)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "00000000.png", "00000000.txt", "00000001.png", "00000001.txt"]
    assert (folder / "00000000.png").read_bytes() == ROWS[1][0]
    assert (folder / "00000000.txt").read_text() == "a green alt\n"
    with Image.open(folder / "00000001.png") as img:
        assert img.getpixel((0, 0)) == (0, 0, 255)
    assert (folder / "00000001.txt").read_text() == "a blue square\n"
    before = stamps(folder)  # unchanged since: trusted by datasets' fingerprint, nothing read or written
    assert "0 files downloaded, 2 already there" in run(ds)[-1]
    assert stamps(folder) == before


def test_instanceprompt_writes_no_captions_and_the_folder_belongs_to_its_source(tmp_path):
    source = hub_folder(tmp_path / "hub")
    ds = entry(tmp_path, source, caption_strategy="instanceprompt", instance_prompt="sks", fallback_caption_column=None)
    assert "4 files downloaded" in run(ds)[-1]  # the row without a caption is used too
    assert not list((tmp_path / "dl").glob("*.txt"))

    other = hub_folder(tmp_path / "other")  # another dataset into the same folder
    with pytest.raises(SourceError, match="instance_data_dir .*dl' holds the download of another source"):
        run(entry(tmp_path, other))
    with pytest.raises(SourceError, match="image_column"):  # another column is another download too
        run(entry(tmp_path, source, image_column="alt"))

    mine = tmp_path / "mine"  # a folder of the user's own files is never written into
    mine.mkdir()
    (mine / "photo.jpg").write_bytes(ROWS[0][0])
    with pytest.raises(SourceError, match="already holds files that difftune did not download"):
        run(entry(tmp_path, source, folder="mine"))
    csv_folder = tmp_path / "csv"  # another type's download
    csv_folder.mkdir()
    (csv_folder / hf.MANIFEST).write_text(json.dumps({"type": "csv", "source": {"csv_file": "x.csv"}}))
    with pytest.raises(SourceError, match="another source \\(type 'csv'"):
        run(entry(tmp_path, source, folder="csv"))
    assert (mine / "photo.jpg").exists() and (csv_folder / hf.MANIFEST).exists()


def test_streaming_writes_the_same_files_and_is_not_read_again(tmp_path):
    source = hub_folder(tmp_path / "hub")
    run(entry(tmp_path, source))
    said = run(entry(tmp_path, source, folder="streamed", streaming=True, cache_dir=str(tmp_path / "stream-cache")))
    assert "3 files downloaded, 0 already there, 2 rows skipped" in said[-1]
    plain, streamed = tmp_path / "dl", tmp_path / "streamed"
    assert {p.name: p.read_bytes() for p in plain.glob("0*")} == {p.name: p.read_bytes() for p in streamed.glob("0*")}
    assert not list((tmp_path / "stream-cache").rglob("*.arrow")), "streaming keeps no copy in datasets' cache"

    source.rename(tmp_path / "away")  # a complete streamed download is not read again: the source is not needed
    said = run(entry(tmp_path, source, folder="streamed", streaming=True))
    assert "is complete (3 files); not read again" in said[-1]
    (streamed / "00000001.png").unlink()  # ... unless a file is missing
    (tmp_path / "away").rename(source)
    assert "1 files downloaded, 2 already there" in run(entry(tmp_path, source, folder="streamed", streaming=True))[-1]


def test_an_image_folder_with_metadata(tmp_path):
    root = tmp_path / "imagefolder" / "train"
    root.mkdir(parents=True)
    for i, (colour, fmt, suffix) in enumerate([((200, 10, 10), "PNG", "png"), ((10, 200, 10), "JPEG", "jpg")]):
        (root / f"pic{i}.{suffix}").write_bytes(encoded(colour, fmt))
    (root / "metadata.jsonl").write_text('{"file_name": "pic0.png", "text": "first", "meta": {"long": "the first"}}\n'
                                         '{"file_name": "pic1.jpg", "text": "second", "meta": {"long": "the 2nd"}}\n')
    run(entry(tmp_path, tmp_path / "imagefolder", caption_column=["text", "meta.long"], fallback_caption_column=None))
    folder = tmp_path / "dl"
    assert (folder / "00000000.png").read_bytes() == (root / "pic0.png").read_bytes()
    assert (folder / "00000001.jpg").read_bytes() == (root / "pic1.jpg").read_bytes()
    assert (folder / "00000001.txt").read_text() == "second\nthe 2nd\n"


def test_dataset_config_and_data_files_choose_the_rows(tmp_path):
    source = hub_folder(tmp_path / "hub", rows=ROWS[:2])
    (source / "data" / "train-00000-of-00001.parquet").rename(source / "data" / "reds.parquet")
    shutil.copy(hub_folder(tmp_path / "b", rows=ROWS[2:3]) / "data" / "train-00000-of-00001.parquet",
                source / "data" / "blues.parquet")
    (source / "README.md").write_text("---\nconfigs:\n- config_name: reds\n  data_files: data/reds.parquet\n"
                                      "- config_name: blues\n  data_files: data/blues.parquet\n---\n")
    run(entry(tmp_path, source, dataset_config="blues"))
    assert (tmp_path / "dl" / "00000000.txt").read_text() == "a blue square\n"
    assert not (tmp_path / "dl" / "00000001.txt").exists()
    run(entry(tmp_path, source, folder="reds", data_files="data/reds.parquet"))
    assert [p.name for p in sorted((tmp_path / "reds").glob("*.txt"))] == ["00000000.txt", "00000001.txt"]


def test_sources_that_cannot_be_read(tmp_path):
    source = hub_folder(tmp_path / "hub")
    cases = [
        (entry(tmp_path, tmp_path / "nowhere"), "dataset_name '.*nowhere' cannot be read .*check dataset_name"),
        (entry(tmp_path, source, split="test"), "fix split 'test'"),
        (entry(tmp_path, source, dataset_config="nope"), "set dataset_config"),
        (entry(tmp_path, source, image_column="picture"),
         "image_column 'picture' is not a column .*columns: image, caption, tags, alt"),
        (entry(tmp_path, source, image_column="caption"), "holds string values, not images"),
        (entry(tmp_path, source, caption_column="text"), "caption_column 'text' is not a column"),
        (entry(tmp_path, source, fallback_caption_column="nope"), "fallback_caption_column 'nope' is not a column"),
    ]
    for ds, message in cases:
        with pytest.raises(SourceError, match=f"dataset 'hub': .*{message}"):
            run(ds)
    assert "3 files downloaded" in run(entry(tmp_path, source))[-1]  # the failed tries claimed no folder
    from datasets import load_dataset

    load_dataset(str(source), split="train", cache_dir=str(tmp_path / "c")).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(SourceError, match="written by save_to_disk.*to_parquet"):
        run(entry(tmp_path, tmp_path / "saved", folder="from-saved"))


def test_the_token_never_shows(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    assert hf._masked("401 for https://x?token=hf_abcdefghijklmnop") == "401 for https://x?token=***"


def test_video_datasets_take_clips(tmp_path):
    from datasets import Dataset, Features, Value, Video

    from difftune.data.video import probe_video, synthetic_clip

    mp4 = synthetic_clip(tmp_path / "a.mp4", frames=9).read_bytes()
    mkv = synthetic_clip(tmp_path / "b.mkv", frames=9, seed=1).read_bytes()
    clips = [{"bytes": mp4, "path": "a.mp4"}, {"bytes": mkv, "path": None}, {"bytes": b"\x00" * 64, "path": "c.mp4"}]
    (tmp_path / "clips" / "data").mkdir(parents=True)
    Dataset.from_dict({"video": clips, "caption": ["one", "two", "three"]},
                      features=Features({"video": Video(), "caption": Value("string")})
                      ).to_parquet(str(tmp_path / "clips" / "data" / "train.parquet"))
    said = run(entry(tmp_path, tmp_path / "clips", dataset_type="video", video={"num_frames": 9},
                     fallback_caption_column=None))
    folder = tmp_path / "dl"
    assert (folder / "00000000.mp4").read_bytes() == mp4
    assert (folder / "00000001.mkv").read_bytes() == mkv  # no name: the container tells the extension
    assert probe_video(folder / "00000001.mkv").frames == 9
    assert any("row 2: not a" in s for s in said) and "2 files downloaded" in said[-1]
    with pytest.raises(SourceError, match="holds Video values, not images; it holds clips: set dataset_type 'video'"):
        run(entry(tmp_path, tmp_path / "clips", folder="as-images", image_column="video", fallback_caption_column=None))


def test_trains_on_a_huggingface_dataset(tmp_path, dataset):
    from difftune.train.loop import train
    from difftune.train.plan import discover_all
    from difftune.train.setup import build_run

    rows = [(p.read_bytes(), p.with_suffix(".txt").read_text(), [], None) for p in sorted(dataset.glob("*.png"))]
    source = hub_folder(tmp_path / "hub", rows=rows)
    path = write_config(tmp_path, dataset, max_train_steps=2, dataset={
        "type": "huggingface", "dataset_name": str(source), "instance_data_dir": str(tmp_path / "dl"),
        "caption_strategy": None, "metadata_backend": "huggingface", "cache_dir": str(tmp_path / "hf-cache")})
    found = discover_all(load_config(path))  # downloads first, as `difftune check` does
    assert sorted(s.caption for s in found[0].samples) == sorted(r[1] for r in rows)
    assert {s.path.name for s in found[0].samples} == {f"{i:08d}.png" for i in range(len(rows))}
    os.utime(tmp_path / "dl" / "00000000.png", ns=(1, 1))  # the run's own fetch rewrites nothing
    run_ = build_run(load_config(path))
    train(run_)
    assert (tmp_path / "dl" / "00000000.png").stat().st_mtime_ns == 1
    events = [json.loads(x) for x in (run_.output_dir / "events.jsonl").read_text().splitlines()]
    assert any("0 files downloaded, 4 already there" in e.get("message", "") for e in events)
    assert sum(e["event"] == "step" for e in events) == 2


def test_a_rows_captions_stay_apart_under_disable_multiline_split(tmp_path, dataset):
    """disable_multiline_split is about the user's caption files: a huggingface row's captions (each a line of the
    file difftune writes) trained as one caption with its line breaks."""
    from difftune.train.plan import discover_all

    rows = [(p.read_bytes(), "a caption", ["tag one", "tag two"], None) for p in sorted(dataset.glob("*.png"))[:1]]
    source = hub_folder(tmp_path / "hub", rows=rows)
    path = write_config(tmp_path, dataset, disable_multiline_split=True, dataset={
        "type": "huggingface", "dataset_name": str(source), "instance_data_dir": str(tmp_path / "dl"),
        "caption_strategy": None, "caption_column": ["caption", "tags"], "cache_dir": str(tmp_path / "hf-cache")})
    cfg = load_config(path)
    assert any("disable_multiline_split not used: each caption of a huggingface row" in n for n in cfg.notes())
    assert discover_all(cfg)[0].samples[0].captions == ("a caption", "tag one", "tag two")


def test_a_local_folders_stamp_leaves_out_what_the_run_writes_inside_it(tmp_path):
    """cache_dir (or the download folder) inside the dataset's folder changed its stamp every run: every row was
    read again and datasets' copy prepared again."""
    source = hub_folder(tmp_path / "hub")
    ds = entry(tmp_path, source, folder="hub/dl", cache_dir=str(source / "hf-cache"))
    stamp = hf._folder_stamp(ds)
    run(ds)
    assert (source / "dl").is_dir() and list((source / "hf-cache").rglob("*.arrow"))
    (source / ".DS_Store").write_bytes(b"x")  # nor a hidden file datasets does not read
    assert hf._folder_stamp(ds) == stamp
    (source / "data" / "extra.parquet").write_bytes((source / "data").glob("*.parquet").__next__().read_bytes())
    assert hf._folder_stamp(ds) != stamp  # the data itself: a change
