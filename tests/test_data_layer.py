"""Caption strategies, caches that are never stale, the resumable sampler, dataset mixing."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import config_problems, write_config
from difftune.config import load_config
from difftune.data.buckets import SizeRule
from difftune.data.cache import TensorCache
from difftune.data.captions import CaptionRule, CaptionTable, caption
from difftune.data.discovery import DatasetSpec, discover
from difftune.data.latents import fill_latent_cache
from difftune.data.sampler import BucketSampler
from difftune.demo import make_dataset
from difftune.train.loop import train
from difftune.train.plan import discover_all
from difftune.train.setup import build_run
from test_train import losses

RULE = SizeRule(resolution=64, resolution_type="pixel_area", crop=False, crop_aspect="square", multiple=16)


def encoder(calls):
    def encode(pixels):
        calls.append(len(pixels))
        return torch.nn.functional.avg_pool2d(pixels, 8)
    return encode


# --- captions ---------------------------------------------------------------------------------------------

def test_filename_captions_keep_hyphens_as_simpletuner(tmp_path):
    """SimpleTuner's prepare_instance_prompt_from_filename turns only underscores into spaces."""
    for name, expected in [("a_man_in_a_t-shirt.png", "a man in a t-shirt"),
                           ("close-up_of_spider-man.jpg", "close-up of spider-man")]:
        img = tmp_path / name
        Image.new("RGB", (8, 8)).save(img)
        assert caption(img, tmp_path, CaptionRule("filename"), None).captions == (expected,)


def test_caption_strategies(tmp_path):
    img = tmp_path / "a_red-circle.png"
    Image.new("RGB", (8, 8)).save(img)
    img.with_suffix(".txt").write_text("first caption\n\nsecond caption\n")
    assert caption(img, tmp_path, CaptionRule("textfile"), None).captions == ("first caption", "second caption")
    assert caption(img, tmp_path, CaptionRule("filename"), None).captions == ("a red-circle",)
    assert caption(img, tmp_path, CaptionRule("instanceprompt", "sks dog"), None).captions == ("sks dog",)
    # prepend_instance_prompt beside caption_strategy instanceprompt: the prompt once (it trained "sks dog sks dog")
    twice = CaptionRule("instanceprompt", "sks dog", prepend_instance_prompt=True)
    assert caption(img, tmp_path, twice, None).captions == ("sks dog",)
    prepend = CaptionRule("textfile", "sks", prepend_instance_prompt=True)
    assert caption(img, tmp_path, prepend, None).captions == ("sks first caption", "sks second caption")
    only = CaptionRule("textfile", "sks", only_instance_prompt=True)
    assert caption(img, tmp_path, only, None).captions == ("sks",)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_parquet_captions(tmp_path, kind):
    from difftune.config.datasets import ParquetCaptions

    rows = [{"file": "one.png", "text": "one", "tags": "tag one", "w": 640, "h": 480},
            {"file": "two.png", "text": "", "tags": "fallback two", "w": 10, "h": 20},
            {"file": "three.png", "text": ["a", "b"], "tags": "", "w": 1, "h": 1}]
    table_path = tmp_path / f"meta.{kind}"
    if kind == "jsonl":
        table_path.write_text("\n".join(json.dumps(r) for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([{**r, "text": json.dumps(r["text"])} if isinstance(r["text"], list)
                                             else r for r in rows]), table_path)
    columns = ParquetCaptions(path=str(table_path), filename_column="file", caption_column="text",
                              fallback_caption_column="tags", width_column="w", height_column="h")
    table = CaptionTable(table_path, columns)
    rule = CaptionRule("parquet")
    one = caption(tmp_path / "one.png", tmp_path, rule, table)
    assert one.captions == ("one",) and one.size == (640, 480)
    assert caption(tmp_path / "two.png", tmp_path, rule, table).captions == ("fallback two",)
    if kind == "jsonl":
        assert caption(tmp_path / "three.png", tmp_path, rule, table).captions == ("a", "b")
    missing = caption(tmp_path / "four_five.png", tmp_path, rule, table)
    assert missing.captions == ("four five",) and "file name" in missing.note


def test_caption_table_odd_cells_and_rows(tmp_path):
    """Null and NaN cells (and items) are no caption (they trained as "None" and "nan"), an object cell is refused,
    a row twice is noted, a row without its extension hints at identifier_includes_extension, a misspelt column
    is a problem (it was read as empty), and rows that are not objects or lack a file name are named (tracebacks)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from difftune.config.datasets import ParquetCaptions

    def table(name, text, **keys):
        path = tmp_path / name
        path.write_text(text)
        return CaptionTable(path, ParquetCaptions(path=str(path), filename_column="file", caption_column="text", **keys))

    rule = CaptionRule("parquet")
    lines = [{"file": "nan.png", "text": float("nan"), "alt": "alt"}, {"file": "list.png", "text": ["x", None]},
             {"file": "twice.png", "text": "first"}, {"file": "twice.png", "text": "second"},
             {"file": "noext", "text": "lost"}]
    rows = table("t.jsonl", "\n".join(json.dumps(r) for r in lines), fallback_caption_column="alt")
    assert caption(tmp_path / "nan.png", tmp_path, rule, rows).captions == ("alt",)
    assert caption(tmp_path / "list.png", tmp_path, rule, rows).captions == ("x",)
    twice = caption(tmp_path / "twice.png", tmp_path, rule, rows)
    assert twice.captions == ("second",) and "2 rows of the parquet table name it: the last one" in twice.note
    assert "set identifier_includes_extension false" in caption(tmp_path / "noext.png", tmp_path, rule, rows).note
    pq.write_table(pa.Table.from_pylist([{"file": "p.png", "text": ["y", None]}]), tmp_path / "t.parquet")
    parquet = CaptionTable(tmp_path / "t.parquet", ParquetCaptions(path="t.parquet", filename_column="file",
                                                                   caption_column="text"))
    assert caption(tmp_path / "p.png", tmp_path, rule, parquet).captions == ("y",)
    as_array = table("a.json", json.dumps([{"file": "a.png", "text": "from an array"}], indent=2))
    assert caption(tmp_path / "a.png", tmp_path, rule, as_array).captions == ("from an array",)

    for text, keys, message in (
            ('{"file": "o.png", "text": {"en": "a", "de": "b"}}', {}, "row 1: caption column 'text' holds an object"),
            ('{"file": "a.png", "text": "a"}\n{"name": "b.png", "text": "b"}', {}, "row 2 has no 'file'"),
            ('{"file": "a.png", "text": "a"}\n["b.png", "b"]', {}, "row 2 is not an object"),
            ('[{"file": "a.png"}, 3]', {}, "item 2 is not an object"),
            ('{"file": "a.png", "text": "a"}', {"fallback_caption_column": "alt_caption"},
             "no column named by fallback_caption_column 'alt_caption'; its columns are file, text"),
            ('{"file": "a.png", "text": "a"}', {"width_column": "w", "height_column": "h"}, "width_column 'w'")):
        with pytest.raises(ValueError, match=message):
            table("bad.json", text, **keys)


def test_table_sizes_are_checked_against_the_file(tmp_path):
    """metadata_backend parquet's width/height columns hold the stored size: a photo turned by its EXIF rotation got a
    landscape bucket and lost two thirds of its picture to the crop, and a damaged file passed check."""
    from difftune.train.plan import discover_all

    folder = tmp_path / "images"
    folder.mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 160x96, displayed 96x160
    Image.new("RGB", (160, 96), "red").save(folder / "rot.jpg", exif=exif.tobytes())
    Image.new("RGB", (96, 96), "blue").save(folder / "plain.jpg")
    (folder / "fake.jpg").write_text("not an image")
    rows = [{"file": "rot.jpg", "text": "turned", "w": 160, "h": 96}, {"file": "plain.jpg", "text": "plain", "w": 96,
            "h": 96}, {"file": "fake.jpg", "text": "fake", "w": 96, "h": 96}]
    (tmp_path / "meta.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    table = {"path": str(tmp_path / "meta.jsonl"), "filename_column": "file", "caption_column": "text",
             "width_column": "w", "height_column": "h"}
    entry = {"caption_strategy": "parquet", "parquet": table, "resolution_type": "pixel", "resolution": 64,
             "crop": False}
    # metadata_backend 'discovery' (the default) measures the files: the table's size is checked against each
    run = load_config(write_config(tmp_path / "measured", folder, dataset=entry))
    (found,) = discover_all(run)
    samples = {s.path.name: s for s in found.samples}
    assert set(samples) == {"rot.jpg", "plain.jpg"} and samples["rot.jpg"].bucket[0] < samples["rot.jpg"].bucket[1]
    assert [p.name for p, _ in found.skipped] == ["fake.jpg"]
    (note,) = [n for p, n in found.notes if p.name == "rot.jpg"]
    assert "the parquet table's size 160x96 is not the image's 96x160 as displayed (its EXIF rotation" in note
    # metadata_backend 'parquet' trusts the table (no file opened); caching leaves out what does not match it
    from difftune.data.images import BadImage
    from difftune.data.latents import sample_pixels

    run = load_config(write_config(tmp_path / "table", folder, dataset={**entry, "metadata_backend": "parquet"}))
    (found,) = discover_all(run, write_metadata=False)
    assert found.probed == 0 and {s.path.name for s in found.samples} == {"rot.jpg", "plain.jpg", "fake.jpg"}
    samples = {s.path.name: s for s in found.samples}
    with pytest.raises(BadImage, match="decodes as 96x160 .* but its size was given as 160x96, which chose its "
                                       "bucket; correct the size in the caption table"):
        sample_pixels(samples["rot.jpg"], "center", (0.5, 0.5))
    with pytest.raises(BadImage, match="not a readable image"):
        sample_pixels(samples["fake.jpg"], "center", (0.5, 0.5))
    assert sample_pixels(samples["plain.jpg"], "center", (0.5, 0.5)).shape == (3, 64, 64)


def test_the_enlargement_note_of_a_downsampled_image_names_the_downsample(tmp_path):
    """A 2000x100 strip shrunk by target_downsample_size, then enlarged to a square bucket: the note blamed the
    original size and advised minimum_image_size, which would not leave it out."""
    from difftune.train.plan import discover_all

    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (2000, 100), "red").save(folder / "strip.png")
    (folder / "strip.txt").write_text("a strip")
    run = load_config(write_config(tmp_path, folder, dataset={
        "resolution": 64, "resolution_type": "pixel_area", "crop": True, "crop_aspect": "square",
        "minimum_image_size": 32, "maximum_image_size": 256, "target_downsample_size": 128}))
    (found,) = discover_all(run)
    ((_, note),) = found.notes
    assert note.startswith("2000x100 is shrunk to 572x29 by target_downsample_size, then enlarged") and \
        "minimum_image_size" not in note, note


@pytest.mark.parametrize("with_extension", [False, True])
def test_caption_table_rows_named_by_path_in_subfolders(tmp_path, with_extension):
    """a/cat and b/cat in the table (identifier_includes_extension false): both files got the last row's caption,
    since the rows were kept by their bare stem."""
    from difftune.config.datasets import ParquetCaptions

    ext = ".png" if with_extension else ""
    rows = [{"file": f"a/cat{ext}", "text": "cat in a"}, {"file": f"b\\cat{ext}", "text": "cat in b"},
            {"file": f"dog{ext}", "text": "a dog"}]
    table_path = tmp_path / "meta.jsonl"
    table_path.write_text("\n".join(json.dumps(r) for r in rows))
    columns = ParquetCaptions(path=str(table_path), filename_column="file", caption_column="text",
                              identifier_includes_extension=with_extension)
    table, rule = CaptionTable(table_path, columns), CaptionRule("parquet")
    assert caption(tmp_path / "a" / "cat.png", tmp_path, rule, table).captions == ("cat in a",)
    assert caption(tmp_path / "b" / "cat.png", tmp_path, rule, table).captions == ("cat in b",)  # Windows separator
    assert caption(tmp_path / "x" / "dog.png", tmp_path, rule, table).captions == ("a dog",)  # a bare name: one row
    ambiguous = caption(tmp_path / "c" / "cat.png", tmp_path, rule, table)
    assert ambiguous.captions == ("cat",) and "2 rows of the parquet table are named" in ambiguous.note
    # rows that name no file are said (discovery notes them): only dog's, when no dog is there
    files = [tmp_path / "a" / "cat.png", tmp_path / "x" / "cat.png"]
    assert table.unmatched(files, tmp_path) == [f"dog{ext}"]
    assert table.unmatched([*files, tmp_path / "x" / "dog.png"], tmp_path) == []
    if not with_extension:  # a table that writes the extension anyway still matches
        (tmp_path / "ext.jsonl").write_text(json.dumps({"file": "a/cat.png", "text": "with ext"}))
        loose = CaptionTable(tmp_path / "ext.jsonl", columns.model_copy(update={"path": str(tmp_path / "ext.jsonl")}))
        assert caption(tmp_path / "a" / "cat.png", tmp_path, rule, loose).captions == ("with ext",)


def test_multiple_captions_drawn_per_sample_and_dropout(tmp_path, dataset):
    for txt in dataset.glob("*.txt"):
        txt.write_text("alpha\nbeta\ngamma")
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=1, num_train_epochs=0)))
    seen = set()
    batches = iter(run.data)
    for _ in range(40):
        seen.update(next(batches).captions)
    assert seen == {"alpha", "beta", "gamma"}
    run = build_run(load_config(write_config(tmp_path / "drop", dataset, max_train_steps=1,
                                             caption_dropout_probability=1.0)))
    assert next(iter(run.data)).captions == [""]


# --- caches -----------------------------------------------------------------------------------------------

def test_cache_reuse_invalidation_and_corruption(tmp_path, dataset):
    calls: list[int] = []
    def fill(rule=RULE, style="center", identity=None):
        found = discover(DatasetSpec("d", dataset, rule, CaptionRule("textfile")))
        cache = TensorCache(tmp_path / "vae", identity or {"vae": "tiny", "rule": rule.__dict__, "crop": style})
        calls.clear()
        done, failed = fill_latent_cache(found.samples, cache, style, 0, encoder(calls), 2)
        return done, sum(calls)

    done, encoded = fill()
    assert encoded == 4 and len(done) == 4
    assert fill()[1] == 0  # everything reused
    # Each fingerprint input recomputes: resolution, its type, crop settings, the model.
    assert fill(SizeRule(96, "pixel_area", False, "square", 16))[1] == 4
    assert fill(SizeRule(64, "pixel", False, "square", 16))[1] == 4
    assert fill(style="random")[1] == 4
    assert fill(identity={"vae": "other"})[1] == 4
    # A changed image is recomputed, the others reused.
    first = sorted(dataset.glob("*.png"))[0]
    Image.new("RGB", (64, 64), (1, 2, 3)).save(first)
    assert fill()[1] == 1
    # A truncated cache file is detected on read and recomputed, never trained on.
    victim = done[1].latent_file
    victim.write_bytes(victim.read_bytes()[:30])
    done, encoded = fill()
    from safetensors.torch import load_file

    assert encoded == 1 and load_file(victim)["latents"].shape == (3, 8, 8)


def test_metadata_cache_rescans_only_changes(tmp_path, dataset):
    spec = DatasetSpec("d", dataset, RULE, CaptionRule("textfile"), metadata_file=tmp_path / "meta.json")
    assert discover(spec).probed == 4
    assert discover(spec).probed == 0
    make_dataset(dataset / "more", count=1, seed=5)
    (dataset / "more" / "000-new.png").touch()
    assert discover(spec).probed == 1
    removed = sorted(dataset.glob("*.png"))[0]
    removed.unlink()
    found = discover(spec)
    assert found.probed == 0 and len(found.samples) == 4
    assert str(removed.name) not in json.loads((tmp_path / "meta.json").read_text())["entries"]


def test_a_metadata_save_killed_midway_leaves_what_the_cache_cleanup_removes(tmp_path, dataset, monkeypatch):
    """The metadata file's temporary copy was a plain tmpXXXX.tmp, which no cleanup knew: a kill in that instant
    left it in the latent cache folder for good. It is named by its writer now, as the cache's own are, and the
    next start removes a dead writer's."""
    import difftune.data.discovery as discovery

    folder = tmp_path / "cache"
    spec = DatasetSpec("d", dataset, RULE, CaptionRule("textfile"), metadata_file=folder / "metadata.json")

    def killed(*a, **k):
        raise SystemExit("killed while writing")

    monkeypatch.setattr(discovery.json, "dump", killed)
    with pytest.raises(SystemExit):
        discover(spec)
    (left,) = folder.glob("*.tmp")
    dead = left.with_name(left.name.replace(f"-{os.getpid()}-", "-999999999-"))  # as if its writer were gone
    left.rename(dead)
    monkeypatch.undo()
    (dataset / "000-new.png").write_bytes((dataset / sorted(p.name for p in dataset.glob("*.png"))[0]).read_bytes())
    discover(spec)  # the next scan that saves
    assert not dead.exists() and (folder / "metadata.json").is_file()


def test_datasets_sharing_a_latent_cache_folder_keep_their_probed_sizes(tmp_path, dataset):
    """Two datasets with one cache_dir_vae: each scan pruned the other's entries from the one metadata.json, so
    every start probed every file of both again."""
    other = tmp_path / "other"
    make_dataset(other, count=3, seed=9)
    shared = str(tmp_path / "cache" / "shared")
    second = {"id": "second", "type": "local", "instance_data_dir": str(other), "resolution": 64,
              "caption_strategy": "textfile", "cache_dir_vae": shared}
    run_cfg = load_config(write_config(tmp_path, dataset, dataset={"cache_dir_vae": shared},
                                       extra_datasets=[second]))
    assert [d.probed for d in discover_all(run_cfg)] == [4, 3]
    assert [d.probed for d in discover_all(run_cfg)] == [0, 0]
    assert {p.name for p in (tmp_path / "cache" / "shared").glob("metadata*.json")} == {
        f"metadata-{run_cfg.datasets.images[0].id}.json", "metadata-second.json"}


def test_text_cache_follows_caption_changes(tmp_path, dataset):
    path = write_config(tmp_path, dataset, max_train_steps=1)
    build_run(load_config(path))
    first = sorted(dataset.glob("*.txt"))[0]
    first.write_text("a completely new caption")
    run = build_run(load_config(path))
    events = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
    messages = [e["message"] for e in events if e["event"] == "info" and e["message"].startswith("text cache")]
    assert len(messages) == 2 and messages[1] == "text cache: 4 captions, 4 distinct: 3 from the cache, 1 newly encoded"


def test_text_cache_counts_captions_two_datasets_share_once(tmp_path, dataset):
    """Two datasets of the same captions in one text cache: the line said "6 distinct: 3 from the cache" on an
    empty cache, counting the second dataset's finds of the first one's entries."""
    twin = {"id": "twin", "type": "local", "dataset_type": "image", "instance_data_dir": str(dataset),
            "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel_area",
            "cache_dir_vae": str(tmp_path / "cache" / "vae-twin")}
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=1, extra_datasets=[twin])))
    events = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
    messages = [e["message"] for e in events if e["event"] == "info" and e["message"].startswith("text cache")]
    assert messages == ["text cache: 8 captions, 3 distinct: 0 from the cache, 3 newly encoded"]


def garble(image):
    """Damage a PNG's pixel data, its chunks intact: only a decode finds it (discovery's probe decodes a file cut off
    at its end, so a truncated one no longer gets past discovery)."""
    blob = image.read_bytes()
    start = blob.index(b"IDAT") + 6  # past the chunk type and the 2-byte zlib header
    image.write_bytes(blob[:start] + b"\xff" * (len(blob) - start - 16) + blob[-16:])  # IDAT's CRC and IEND kept


def test_cache_counts_add_up(tmp_path, dataset):
    """One entry deleted (rebuilt), one image damaged after discovery's header read (fails to decode):
    the line says what happened to each file, and the parts add up to the total."""
    path = write_config(tmp_path, dataset, max_train_steps=1)
    run = build_run(load_config(path))
    image = sorted(dataset.glob("*.png"))[-1]
    other = next(c for c in run.data.items if c.sample.path.resolve() != image.resolve())
    other.latent_file.unlink()  # another file's entry (the damaged file's own key changes with it anyway)
    garble(image)  # the header still reads; the pixels do not
    run = build_run(load_config(path))
    events = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
    lines = [e["message"] for e in events if e["event"] == "info" and e["message"].startswith("latent cache")]
    assert lines[-1] == "latent cache: 4 files: 2 from the cache, 1 newly encoded, 1 failed (skipped: see the data report)"


def test_a_dataset_whose_every_file_fails_to_decode_names_the_reasons(tmp_path, dataset):
    """Every image damaged after discovery read its header: the error named 'the warnings above', which are kept
    for the data report, printed only after this point. It gives each file's reason itself."""
    from difftune.train.plan import DataError

    for image in dataset.glob("*.png"):
        garble(image)
    with pytest.raises(DataError) as info:
        build_run(load_config(write_config(tmp_path, dataset, max_train_steps=1)))
    text = str(info.value)
    assert "dataset(s) 'train' have no file (image or clip) that could be decoded:" in text
    assert all(f"{image}: " in text for image in dataset.glob("*.png")) and "warnings above" not in text


def test_kill_during_caching_resumes(tmp_path):
    images = tmp_path / "many"
    make_dataset(images, count=120)
    path = write_config(tmp_path, images, dataset={"resolution": 128}, vae_batch_size=1)
    cache_root = tmp_path / "cache" / "vae"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "difftune.cli", "cache", "--config", str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(cache_root.rglob("*.safetensors"))) < 10:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = len(list(cache_root.rglob("*.safetensors")))
    assert 10 <= partial < 120, partial
    done = subprocess.run([sys.executable, "-m", "difftune.cli", "cache", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    from safetensors.torch import load_file

    files = list(cache_root.rglob("*.safetensors"))
    assert len(files) == 120 and all(load_file(f)["latents"].shape[0] == 4 for f in files)
    assert not list(cache_root.rglob("*.tmp"))


def test_vae_cache_disable_trains_like_the_cache(tmp_path, dataset):
    cached = write_config(tmp_path / "a", dataset, max_train_steps=4, train_batch_size=2)
    train(build_run(load_config(cached)))
    fly = write_config(tmp_path / "b", dataset, max_train_steps=4, train_batch_size=2, vae_cache_disable=True)
    run = build_run(load_config(fly))
    train(run)
    assert not list((tmp_path / "b" / "cache" / "vae").rglob("*.safetensors"))
    a, b = losses(tmp_path / "a" / "output"), losses(tmp_path / "b" / "output")
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-5) for k in a)


# --- sampler and mixing -----------------------------------------------------------------------------------

@pytest.mark.parametrize("weights", [(None, None), (3.0, 1.0)])
def test_sampler_resumes_exactly(weights):
    parts = [(list(range(0, 30)), [(64, 64)] * 20 + [(96, 64)] * 10, weights[0]),
             (list(range(30, 40)), [(64, 64)] * 10, weights[1])]
    a = BucketSampler(parts, 2, seed=3, keep_partial=False)
    it = iter(a)
    for _ in range(23):
        next(it)
    state = json.loads(json.dumps(a.state_dict()))
    expected = [next(it) for _ in range(30)]
    b = BucketSampler(parts, 2, seed=3, keep_partial=False)
    b.load_state_dict(state)
    assert [batch for batch, _ in zip(iter(b), range(30), strict=False)] == expected
    for batch in expected:  # one bucket and one dataset per batch
        assert len({(i < 30, (i >= 20 and i < 30)) for i in batch}) == 1


def test_repeats_spread_over_batches_not_within_them():
    """repeats 9 on 6 images, batches of 4: 70% of batches held an image twice (every copy shuffled together). Each
    pass over the images is shuffled on its own: a batch repeats an image only where it straddles two passes."""
    passes, images = 10, 6
    items = list(range(passes * images))  # pass after pass, as train/windows.py lays them out
    parts = [(items, [(64, 64)] * len(items), None, passes)]
    sampler = BucketSampler(parts, 4, seed=3, keep_partial=False)
    batches = [b for epoch in range(20) for b in sampler.epoch_batches(epoch)]
    twice = sum(len({i % images for i in b}) < len(b) for b in batches)
    assert twice / len(batches) < 0.25, twice / len(batches)  # at most the batches across a pass boundary
    assert sorted(i for b in sampler.epoch_batches(0) for i in b) == items  # every copy, once an epoch
    plain = BucketSampler([(items, [(64, 64)] * len(items), None)], 4, seed=3, keep_partial=False)
    assert plain.epoch_batches(0) != sampler.epoch_batches(0)  # without passes: one shuffle, as before


def test_probability_mixes_datasets_by_weight():
    parts = [(list(range(0, 100)), [(64, 64)] * 100, 3.0), (list(range(100, 200)), [(64, 64)] * 100, 1.0)]
    sampler = BucketSampler(parts, 1, seed=0, keep_partial=False)
    it = iter(sampler)
    first = [next(it)[0] < 100 for _ in range(2000)]
    assert 0.7 < np.mean(first) < 0.8
    # auto-weighting (SimpleTuner's default): the probability scales the dataset's share of the images, so a small
    # dataset with probability 0.5 beside a large one without gets 100 x 0.5 : 1000 (it got 1 : 2 before)
    mixed = [(list(range(0, 1000)), [(64, 64)] * 1000, None), (list(range(1000, 1100)), [(64, 64)] * 100, 0.5)]
    it = iter(BucketSampler(mixed, 1, seed=0, keep_partial=False))
    assert 0.03 < np.mean([next(it)[0] >= 1000 for _ in range(4000)]) < 0.065  # 50 / 1050 = 0.048
    even = BucketSampler([(p[0], p[1], None) for p in parts], 1, seed=0, keep_partial=False)
    epoch = even.epoch_batches(0)
    assert sorted(b[0] for b in epoch) == list(range(200))  # unweighted: each image once per epoch


def test_uniform_sampling_draws_each_dataset_alike_whatever_its_size(tmp_path, dataset):
    """data_backend_sampling 'uniform': a 10-image dataset beside a 90-image one gets half the batches (its own
    epochs restart as it runs out); 'auto-weighting' gives it its 10%; a probability still weights 'uniform'."""
    small, large = (list(range(0, 10)), [(64, 64)] * 10, None), (list(range(10, 100)), [(64, 64)] * 90, None)

    def share(parts, **kw):
        it = iter(BucketSampler(parts, 1, seed=0, keep_partial=False, **kw))
        return np.mean([next(it)[0] < 10 for _ in range(3000)])

    assert share([small, large]) == pytest.approx(0.1, abs=1e-9)  # each image once per epoch: exactly 10%
    assert 0.46 < share([small, large], uniform=True) < 0.54
    assert 0.71 < share([(*small[:2], 3.0), large], uniform=True) < 0.79  # 3 : 1 (the large one's default 1)
    uniform = BucketSampler([small, large], 1, seed=0, keep_partial=False, uniform=True)
    assert uniform.batches_per_epoch() == 100
    it = iter(uniform)
    for _ in range(37):
        next(it)
    state = json.loads(json.dumps(uniform.state_dict()))
    expected = [next(it) for _ in range(50)]
    again = BucketSampler([small, large], 1, seed=0, keep_partial=False, uniform=True)
    again.load_state_dict(state)
    assert [b for b, _ in zip(again, range(50), strict=False)] == expected  # exact resume
    # the key reaches the run's sampler
    other = {"id": "other", "type": "local", "instance_data_dir": str(dataset), "resolution": 64,
             "caption_strategy": "textfile", "cache_dir_vae": str(tmp_path / "cache" / "other")}
    for mode in ("uniform", "auto-weighting"):
        run = build_run(load_config(write_config(tmp_path / mode, dataset, data_backend_sampling=mode,
                                                 extra_datasets=[other])))
        assert run.data.sampler.weighted == (mode == "uniform")
    assert "data_backend_sampling" in config_problems(write_config(tmp_path / "bad", dataset,
                                                                   data_backend_sampling="equal"))


def test_max_num_samples_and_per_dataset_text_cache(tmp_path, dataset):
    other = tmp_path / "other"
    make_dataset(other, count=6, seed=9)
    path = write_config(tmp_path, dataset, max_train_steps=1, dataset={"max_num_samples": 2})
    backend = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    backend.append({"id": "second", "type": "local", "instance_data_dir": str(other), "resolution": 64,
                    "text_embeds": "alt", "cache_dir_vae": str(tmp_path / "cache" / "vae2")})
    backend.append({"id": "alt", "type": "local", "dataset_type": "text_embeds", "cache_dir": str(tmp_path / "alt")})
    (tmp_path / "config" / "multidatabackend.json").write_text(json.dumps(backend))
    run_cfg = load_config(path)
    found = discover_all(run_cfg)
    assert len(found[0].samples) == 2 and len(found[1].samples) == 6
    assert [s.path for s in found[0].samples] == [s.path for s in discover_all(run_cfg)[0].samples]
    from difftune.data.report import DataReport

    row = next(line for line in DataReport(found, [], {}).render().splitlines() if line.strip().startswith("train"))
    assert row.split() == ["train", "4", "2", "2"]  # found counts the files max_num_samples did not draw
    run = build_run(run_cfg)
    assert len(run.data.items) == 8
    assert list((tmp_path / "alt").rglob("*.safetensors"))


def test_cache_command(tmp_path, dataset, capsys):
    from difftune.cli import main

    path = write_config(tmp_path, dataset)
    assert main(["cache", "--config", str(path)]) == 0
    assert "caches complete: 4" in capsys.readouterr().out
    assert len(list((tmp_path / "cache" / "vae").rglob("*.safetensors"))) == 4


def test_a_checkpoint_of_the_earlier_repeats_order_is_said():
    """A run stopped mid-epoch before repeats were shuffled pass by pass resumes in the new order: said."""
    items = list(range(12))
    sampler = BucketSampler([(items, [(64, 64)] * 12, None, 3)], 2, seed=0, keep_partial=False)
    state = sampler.state_dict()
    assert sampler.load_state_dict(state) is None
    assert "written by an earlier difftune" in sampler.load_state_dict({k: v for k, v in state.items() if k != "layout"})
