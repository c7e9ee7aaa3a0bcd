"""Cache entries damaged at the same size are never trained on and never crash: each class of damage is
caught at start-up (header) or where training reads the entry (checksum, finiteness), deleted, reported
and encoded again."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import write_config
from difftune.config import load_config
from difftune.data.cache import DamagedEntry, TensorCache, read
from difftune.train.loop import train
from difftune.train.setup import build_run

LATENTS = {"latents": torch.randn(4, 8, 8)}


def data_start(blob: bytes) -> int:
    return 8 + int.from_bytes(blob[:8], "little")


def zero_data(blob: bytes) -> bytes:
    start = data_start(blob)
    return blob[:start] + bytes(len(blob) - start)


def nan_data(blob: bytes) -> bytes:
    start = data_start(blob)
    return blob[:start] + np.full((len(blob) - start) // 4, np.nan, dtype=np.float32).tobytes()


def random_data(blob: bytes) -> bytes:
    start = data_start(blob)
    return blob[:start] + np.random.default_rng(0).integers(0, 256, len(blob) - start, dtype=np.uint8).tobytes()


def one_value_changed(blob: bytes) -> bytes:
    start = data_start(blob)
    return blob[:start] + np.float32(1e30).tobytes() + blob[start + 4 :]


def header_edit(old: str, new: str):
    assert len(old) == len(new)  # the file keeps its size

    def edit(blob: bytes) -> bytes:
        start = data_start(blob)
        header = blob[8:start].decode()
        assert old in header
        return blob[:8] + header.replace(old, new, 1).encode() + blob[start:]
    return edit


# (name, damage, caught by the start-up header check)
DAMAGE = [
    ("zeroed data", zero_data, False),
    ("NaN values", nan_data, False),
    ("random values", random_data, False),
    ("one value changed", one_value_changed, False),
    ("dtype changed in the header", header_edit('"F32"', '"I32"'), True),
    ("wrong shape", header_edit("[4,8,8]", "[8,4,8]"), True),
    ("renamed tensor", header_edit('"latents"', '"latentz"'), True),
    ("whole file zeroed", lambda blob: bytes(len(blob)), True),
    ("truncated", lambda blob: blob[: len(blob) // 2], True),
]


@pytest.mark.parametrize("name,damage,at_start", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_every_damage_is_caught_never_loaded(tmp_path, name, damage, at_start):
    cache = TensorCache(tmp_path, {"t": 1})
    path = cache.put("k", LATENTS)
    assert cache.has("k") and torch.equal(cache.read("k")["latents"], LATENTS["latents"])
    path.write_bytes(damage(path.read_bytes()))
    cache = TensorCache(tmp_path, {"t": 1})  # the next start (within one, a header read once is not read again)
    if at_start:
        assert not cache.has("k") and not path.exists()  # removed: the fill encodes it again
        return
    assert cache.has("k")  # the header is whole: only reading the data finds it
    with pytest.raises(DamagedEntry):
        cache.read("k")
    assert not path.exists() and cache.get("k") is None


def test_old_entries_without_checksum_are_reencoded(tmp_path):
    cache = TensorCache(tmp_path, {"t": 1})
    path = cache.path("k")
    path.parent.mkdir(parents=True)
    save_file(LATENTS, path)  # how difftune wrote entries before checksums
    with pytest.raises(DamagedEntry, match="without a checksum"):
        read(path)
    assert not cache.has("k") and not path.exists()


def test_nonfinite_tensors_are_never_written(tmp_path):
    cache = TensorCache(tmp_path, {"t": 1})
    for bad in (float("nan"), float("inf")):
        with pytest.raises(DamagedEntry, match="NaN or inf"):
            cache.put("k", {"latents": torch.full((2, 2), bad)})
        assert not cache.path("k").exists()


def test_missing_expected_tensor_is_damage(tmp_path):
    cache = TensorCache(tmp_path, {"t": 1})
    cache.put("k", {"other": torch.zeros(2)})
    with pytest.raises(DamagedEntry, match="lacks tensor 'latents'"):
        cache.read("k", ("latents",))


def events_of(output_dir):
    return [json.loads(x) for x in (output_dir / "events.jsonl").read_text().splitlines()]


def test_damaged_entries_in_training_are_left_out_deleted_and_reencoded(tmp_path, dataset):
    """Data damage is found where training reads the entry (left out, deleted, re-encoded at the next start);
    header damage at start-up (re-encoded in the same run). Training never sees a bad tensor."""
    config = write_config(tmp_path, dataset, max_train_steps=4, output_dir=str(tmp_path / "out1"))
    run = build_run(load_config(config))
    items = run.data.items
    text_cache = run.data.text_caches["train"]
    latent_files = [c.latent_file for c in items]
    text_files = [text_cache.path(c.text_keys[0]) for c in items]
    # Three different images: two with damaged latents, one with a damaged caption of its own.
    victim = next(i for i in range(len(items)) if text_files.count(text_files[i]) == 1)
    zeroed, renamed = [latent_files[i] for i in range(len(items)) if i != victim][:2]
    zeroed.write_bytes(zero_data(zeroed.read_bytes()))
    renamed.write_bytes(header_edit('"latents"', '"latentz"')(renamed.read_bytes()))
    damaged_text = text_files[victim]
    damaged_text.write_bytes(nan_data(damaged_text.read_bytes()))
    seen = []
    real_collate = run.data.collate_text

    run2 = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=4, train_batch_size=1,
                                              output_dir=str(tmp_path / "out2"))))
    infos = [e["message"] for e in events_of(tmp_path / "out2") if e["event"] == "info"]
    assert "latent cache: 4 files: 3 from the cache, 1 newly encoded" in infos  # the renamed tensor, at start-up

    def collate(texts):
        seen.extend(texts)
        return real_collate(texts)
    run2.data.collate_text = collate
    train(run2)
    events = events_of(tmp_path / "out2")
    warnings = [e["message"] for e in events if e["event"] == "warning"]
    assert any("left out" in m and "cached latents are damaged" in m and "checksum" in m for m in warnings)
    assert any("left out" in m and "text embedding" in m for m in warnings)
    assert not zeroed.exists() and not damaged_text.exists()
    assert all(torch.isfinite(t).all() for entry in seen for t in entry.values())
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 4 and all(np.isfinite(e["loss"]) for e in steps)

    # The next start encodes what was deleted; every entry verifies again.
    build_run(load_config(write_config(tmp_path, dataset, max_train_steps=1, output_dir=str(tmp_path / "out3"))))
    infos = [e["message"] for e in events_of(tmp_path / "out3") if e["event"] == "info"]
    assert "latent cache: 4 files: 3 from the cache, 1 newly encoded" in infos
    assert "text cache: 4 captions, 3 distinct: 2 from the cache, 1 newly encoded" in infos
    for path in {*latent_files, *text_files}:
        read(path)
    assert load_file(zeroed)["latents"].abs().sum() > 0


# --- compress_disk_cache: the same guarantees for deflated entries ------------------------------------------

def packed_data_start(blob: bytes) -> int:
    from difftune.data.cache import _PREFIX
    return _PREFIX + int.from_bytes(blob[4:12], "little")


def packed_zeroed(blob: bytes) -> bytes:
    start = packed_data_start(blob)
    return blob[:start] + bytes(len(blob) - start)


def packed_random(blob: bytes) -> bytes:
    start = packed_data_start(blob)
    return blob[:start] + np.random.default_rng(0).integers(0, 256, len(blob) - start, dtype=np.uint8).tobytes()


def packed_header_edit(old: str, new: str):
    def edit(blob: bytes) -> bytes:
        start = packed_data_start(blob)
        return blob[:20] + blob[20:start].decode().replace(old, new, 1).encode() + blob[start:]
    return edit


PACKED_DAMAGE = [
    ("deflated data zeroed", packed_zeroed, False),
    ("deflated data random", packed_random, False),
    ("dtype changed in the header", packed_header_edit('"F32"', '"I32"'), True),
    ("renamed tensor", packed_header_edit('"latents"', '"latentz"'), True),
    ("whole file zeroed", lambda blob: bytes(len(blob)), True),
    ("truncated", lambda blob: blob[: len(blob) - 7], True),
    ("bytes appended", lambda blob: blob + b"\0" * 7, True),
]


@pytest.mark.parametrize("name,damage,at_start", PACKED_DAMAGE, ids=[d[0] for d in PACKED_DAMAGE])
def test_compressed_entries_catch_every_damage(tmp_path, name, damage, at_start):
    cache = TensorCache(tmp_path, {"t": 1}, compress=True)
    path = cache.put("k", LATENTS)
    assert path.read_bytes().startswith(b"DTZ1")
    assert cache.has("k") and torch.equal(cache.read("k")["latents"], LATENTS["latents"])
    path.write_bytes(damage(path.read_bytes()))
    cache = TensorCache(tmp_path, {"t": 1}, compress=True)  # the next start
    if at_start:
        assert not cache.has("k") and not path.exists()
        return
    assert cache.has("k")
    with pytest.raises(DamagedEntry):
        cache.read("k")
    assert not path.exists()


def test_compressed_and_plain_entries_read_either_way(tmp_path):
    """Switching compress_disk_cache re-encodes nothing: each form is read by a cache of the other; the
    compressed one is smaller where the data has slack (padded text embeddings)."""
    padded = torch.randn(64, 32).to(torch.bfloat16)
    padded[20:] = 0
    entry = {"prompt_embeds": padded, "mask": torch.arange(64) < 20}
    plain, packed = TensorCache(tmp_path, {"t": 1}), TensorCache(tmp_path, {"t": 1}, compress=True)
    a, b = plain.put("a", entry), packed.put("b", entry)
    assert b.stat().st_size < 0.5 * a.stat().st_size
    for cache in (plain, packed):
        for key in ("a", "b"):
            assert cache.has(key)
            got = cache.read(key)
            assert torch.equal(got["prompt_embeds"], padded) and torch.equal(got["mask"], entry["mask"])


def test_training_on_a_compressed_cache_matches_the_plain_one(tmp_path, dataset):
    """compress_disk_cache writes every latent and text entry deflated, and training reads the same numbers."""
    losses = []
    for name, compress in (("plain", False), ("packed", True)):
        config = write_config(tmp_path / name, dataset, max_train_steps=3, compress_disk_cache=compress,
                              output_dir=str(tmp_path / name / "out"))
        run = build_run(load_config(config))
        files = [c.latent_file for c in run.data.items]
        files += [run.data.text_caches["train"].path(c.text_keys[0]) for c in run.data.items]
        assert files and all(f.read_bytes().startswith(b"DTZ1") == compress for f in files)
        train(run)
        losses.append([e["loss"] for e in events_of(tmp_path / name / "out") if e["event"] == "step"])
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_a_killed_writers_temporary_file_is_removed_when_the_cache_opens_again(tmp_path):
    """A run killed mid-write leaves its temporary file; the next run that opens the cache removes it, but never
    a file another live process is still writing (several processes fill one cache), nor another host's."""
    import os
    import socket
    import subprocess
    import sys

    from difftune.data.cache import TensorCache

    cache = TensorCache(tmp_path, {"kind": "test"})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    host = socket.gethostname()
    shard = cache.folder / "ab"
    shard.mkdir()
    leftover = shard / f".part-{host}-{dead}-k1ll3d_x.tmp"
    writing = shard / f".part-{host}-{os.getpid()}-w0rking_.tmp"
    elsewhere = shard / f".part-other-host-{dead}-r3mote__.tmp"
    for path in (leftover, writing, elsewhere):
        path.write_bytes(b"half an entry")
    entry = cache.put("key", {"latents": torch.ones(2)})
    assert entry.exists() and set(entry.parent.glob(f".part-{host}-{os.getpid()}-*")) <= {writing}  # put leaves none
    TensorCache(tmp_path, {"kind": "test"})
    assert not leftover.exists() and writing.exists() and elsewhere.exists()


def refuse_writes_under(monkeypatch, folder):
    """A read-only cache folder, as a bind mount or another user's cache gives it (the tests run as root, for whom
    permissions do not stop a write): creating a file under `folder` fails with EROFS."""
    import errno
    import tempfile

    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and str(dir).startswith(str(folder)):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def test_a_read_only_cache_serves_its_entries_and_names_the_folder_for_a_missing_one(tmp_path, monkeypatch):
    from difftune.data.cache import CacheWriteError

    TensorCache(tmp_path / "cache", {"a": 1}).put("there", {"x": torch.ones(2)})
    refuse_writes_under(monkeypatch, tmp_path / "cache")
    cache = TensorCache(tmp_path / "cache", {"a": 1})
    assert torch.equal(cache.get("there")["x"], torch.ones(2))
    with pytest.raises(CacheWriteError) as info:
        cache.put("missing", {"x": torch.ones(2)})
    assert str(cache.folder) in str(info.value) and "Read-only file system" in str(info.value)
    assert "cache_dir_vae" in str(info.value)


def test_a_damaged_entry_of_a_read_only_cache_is_left_in_place(tmp_path, monkeypatch):
    """Its deletion failed with a PermissionError traceback (at start-up for header damage, mid-training for data
    damage): it stays, and is treated as missing (encoding it again names the read-only folder) or left out."""
    import errno
    import pathlib

    cache = TensorCache(tmp_path / "cache", {"a": 1})
    header, data = cache.put("header", LATENTS), cache.put("data", LATENTS)
    header.write_bytes(header_edit('"latents"', '"latentz"')(header.read_bytes()))
    data.write_bytes(zero_data(data.read_bytes()))
    real = pathlib.Path.unlink

    def unlink(self, missing_ok=False):
        if str(self).startswith(str(tmp_path / "cache")):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    assert not cache.has("header") and header.exists()
    with pytest.raises(DamagedEntry) as info:
        cache.read("data")
    assert data.exists() and info.value.kept == data  # the left-out warning names it for the cache's owner


def test_discovery_writes_its_file_sizes_only_when_they_change_and_survives_a_read_only_folder(
        tmp_path, dataset, monkeypatch):
    from difftune.data.discovery import MetadataCache

    path = tmp_path / "meta" / "metadata.json"
    for damaged in ("null", "[1, 2]", "{not json"):  # valid JSON of another shape, or none: a rescan
        path.parent.mkdir(exist_ok=True)
        path.write_text(damaged)
        assert MetadataCache(path).entries == {}
    first = MetadataCache(path)
    for i, image in enumerate(sorted(dataset.glob("*.png"))):
        first.size(image, str(i))
    assert first.save() is None and len(json.loads(path.read_text())["entries"]) == 4
    stored = json.loads(path.read_text())  # an earlier probe's file (a flat dict, or another version): read again
    for old in (stored["entries"], {**stored, "version": 1}):
        path.write_text(json.dumps(old))
        assert MetadataCache(path).entries == {}
    path.write_text(json.dumps(stored))
    refuse_writes_under(monkeypatch, path.parent)
    again = MetadataCache(path)
    for i, image in enumerate(sorted(dataset.glob("*.png"))):
        assert again.size(image, str(i))[2] is False  # from the file, not probed
    assert again.save() is None  # nothing changed: nothing written (a read-only shared cache still scans)
    (dataset / "extra.png").write_bytes(next(dataset.glob("*.png")).read_bytes())
    again.size(dataset / "extra.png", "extra")
    note = again.save()
    assert "could not be kept" in note and "Read-only file system" in note


def test_every_item_damaged_is_one_error_line(tmp_path, dataset, capsys):
    """A cache copied over a flaky link, every latent entry damaged in its data: the right advice, as two chained
    tracebacks (exit 1); now the `error:` line (exit 2). The next run encodes them anew."""
    from difftune.cli import main

    config = write_config(tmp_path, dataset, max_train_steps=2, validation_prompt=None)
    run = build_run(load_config(config))
    files = {c.latent_file for c in run.data.items}
    run.events.close()
    for path in files:
        path.write_bytes(zero_data(path.read_bytes()))
    capsys.readouterr()
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "error: every training item was left out" in err and "Traceback" not in err
    assert main(["train", "--config", str(config)]) == 0


def test_a_damaged_validation_prompt_embedding_is_encoded_again(tmp_path, dataset):
    """Its checksum failed when read, which was reported as "the text encoder returned NaN or inf ... check the
    model's weights and mixed_precision": it is encoded again (the text encoder is loaded at that point)."""
    config = write_config(tmp_path, dataset, max_train_steps=1, validation_prompt="a red circle",
                          validation_negative_prompt="blurry")
    build_run(load_config(config)).events.close()
    entries = list((tmp_path / "cache" / "text").rglob("*.safetensors"))
    assert entries
    for path in entries:
        path.write_bytes(zero_data(path.read_bytes()))
    run = build_run(load_config(config))  # was: ValueError, the text encoder returned NaN or inf
    assert run.validation and all(r.text is not None and r.negative is not None for r in run.validation)
    run.events.close()


def test_a_complete_text_cache_keeps_the_text_encoders_off_the_accelerator(tmp_path, dataset, monkeypatch):
    """Every text encoder went to the accelerator at each start, captions cached or not: `difftune plan`'s advice to
    fill the text cache on a larger GPU once could not help a smaller one (Qwen2.5-VL: 15 GiB)."""
    import torch

    config = write_config(tmp_path, dataset, max_train_steps=1, validation_prompt="a red circle",
                          validation_negative_prompt="blurry")
    moved: list[str] = []
    real_to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda m, *a, **k: moved.append(type(m).__name__) or real_to(m, *a, **k))
    build_run(load_config(config)).events.close()
    text_encoder = "Gemma2Model"  # Lumina2's
    assert text_encoder in moved  # the first start encodes
    moved.clear()
    build_run(load_config(config)).events.close()
    assert moved and text_encoder not in moved, moved  # the second encodes nothing


def test_a_start_reads_each_entry_header_once(tmp_path, monkeypatch):
    """A start asked has() of each entry several times, each an open and a header parse (5 per image, 100,000 opens
    for 20,000 images): once found whole, a stat answers; a deleted entry is missing again."""
    from difftune.data import cache as cache_module

    cache = TensorCache(tmp_path, {"t": 1})
    path = cache.put("k", LATENTS)
    reads = []
    real = cache_module.intact
    monkeypatch.setattr(cache_module, "intact", lambda p: reads.append(p) or real(p))
    assert all(cache.has("k") for _ in range(5)) and len(reads) == 1
    path.unlink()
    assert not cache.has("k")


def test_a_moved_dataset_keeps_its_latents_and_its_draws(tmp_path, dataset):
    """A dataset folder moved (mv, rsync -a: its times kept), or a project copied to another machine under another
    path: the latents come from the cache, and the random crops, random aspect buckets and max_num_samples draw are
    those of the first run. They followed the absolute path: a move re-encoded everything and drew other images."""
    import shutil

    first = tmp_path / "here" / "images"
    shutil.copytree(dataset, first)  # copy2: times kept
    entry = dict(crop=True, crop_style="random", crop_aspect="random", crop_aspect_buckets=[1.0, 0.75],
                 max_num_samples=3)

    def start(folder, out):
        run = build_run(load_config(write_config(tmp_path, folder, max_train_steps=1, dataset=entry,
                                                 output_dir=str(tmp_path / out))))
        run.events.close()
        infos = [e["message"] for e in events_of(tmp_path / out) if e["event"] == "info"]
        return sorted((c.sample.name, c.sample.bucket, c.uv, c.latent_file.name) for c in run.data.items), infos

    drawn, infos = start(first, "out1")
    assert "latent cache: 3 files: 0 from the cache, 3 newly encoded" in infos
    shutil.move(tmp_path / "here", tmp_path / "there")  # a rename: times kept
    again, infos = start(tmp_path / "there" / "images", "out2")
    assert "latent cache: 3 files: 3 from the cache, 0 newly encoded" in infos
    assert again == drawn
    assert len({name for name, *_ in drawn}) == 3 and len({uv for *_, uv, _ in drawn}) == 3
