"""SimpleTuner's dataset-entry keys (its DATALOADER.md), audited one by one: each is implemented (a behaviour test
below), or accepted at its "off" value and refused otherwise with what to do instead (config/pending.py), and a
dataset list as a SimpleTuner user writes it loads."""

import json

import pytest

from conftest import config_problems as problems
from conftest import write_config
from difftune.config import load_config
from difftune.data.cache import MAGIC
from difftune.demo import make_dataset
from difftune.train.plan import discover_all


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Four small captioned images, shared by the config-only tests (none of them writes into it)."""
    folder = tmp_path_factory.mktemp("audit-images")
    make_dataset(folder, count=4)
    return folder


def with_text_entry(tmp_path, images, text=None, **config):
    """write_config, with keys added to (or, as None, removed from) the text_embeds entry."""
    path = write_config(tmp_path, images, **config)
    backend = tmp_path / "config" / "multidatabackend.json"
    entries = json.loads(backend.read_text())
    entries[-1].update(text or {})
    backend.write_text(json.dumps(entries))
    return path


def mask_entry(folder, **extra):
    return {"id": "masks", "type": "local", "dataset_type": "conditioning", "conditioning_type": "mask",
            "instance_data_dir": str(folder), **extra}


# --- not implemented: accepted at the value that changes nothing, refused at any other ----------------------------

# (key, off value, a value that would act, the entry it is written on)
PENDING = [
    ("hash_filenames", True, False, "image"), ("cache_file_suffix", None, "subject", "image"),
    ("text_cache_ondemand", False, True, "text"), ("text_cache_disable", False, True, "text"),
    ("timestep_sampling_offset", 0.0, -0.5, "image"), ("disable_validation", False, True, "image"),
    ("slider_strength", 0, 0.5, "image"),
    ("grounding", None, {"enabled": True}, "image"),
    ("conditioning_config", None, {"type": "canny"}, "image"), ("image_embeds", None, "vae-embeds", "image"),
    ("conditioning_image_embeds", None, "clip-embeds", "image"),
    ("cache_dir_conditioning_image_embeds", None, "cache/clip", "image"),
    ("conditioning_image_embed_batch_size", None, 4, "image"), ("audio", None, {"auto_split": True}, "image"),
    ("delete_unwanted_images", False, True, "image"), ("delete_problematic_images", False, True, "image"),
    ("delete_nsfw_images", False, True, "image"),
    ("disable_vae_cache", None, True, "image"), ("scan_for_errors", False, True, "image"),
    ("memory_filesystem_path", None, "/tmp/st-memory", "text"), ("memory_filesystem_size", None, "64G", "text"),
    ("memory_filesystem_sudo", False, True, "text"), ("webshart", None, {"shard_cache_gb": 25}, "image"),
    ("source", None, "laion/shards", "image"), ("metadata", None, "me/shard-metadata", "image"),
    ("hf_token", None, "hf_x", "image"), ("subfolder", None, "data", "image"), ("shard_cache_gb", None, 25, "image"),
    ("parallel_downloads", None, 4, "image"), ("buffer_size", None, 8, "image"), ("max_file_size", None, 10, "image"),
]


def entry_config(tmp_path, images, where, **keys):
    if where == "text":
        return with_text_entry(tmp_path, images, keys)
    return write_config(tmp_path, images, dataset=keys)


@pytest.mark.parametrize("key,off,on,where", PENDING, ids=[f"{k}-{o}" for k, o, _, _ in PENDING])
def test_pending_dataset_key_accepted_off_refused_on(tmp_path, images, key, off, on, where):
    load_config(entry_config(tmp_path, images, where, **{key: off}))
    text = problems(entry_config(tmp_path, images, where, **{key: on}))
    assert f"{key}=" in text and "not implemented yet" in text and "unknown key" not in text


@pytest.mark.parametrize("where", ["image", "text"])
def test_scan_skipping_switches_change_nothing_and_say_so(tmp_path, images, where):
    """SimpleTuner's multidatabackend.json.example carries skip_file_discovery and preserve_data_backend_cache: both
    only skip its scans, which difftune reuses anyway (they were refused as not implemented)."""
    plain = load_config(entry_config(tmp_path, images, where))
    for key, off, on in [("skip_file_discovery", "", "vae,aspect,text,metadata"),
                         ("preserve_data_backend_cache", False, True)]:
        quiet = load_config(entry_config(tmp_path, images, where, **{key: off}))
        assert not any(key in n for n in quiet.notes())
        run = load_config(entry_config(tmp_path, images, where, **{key: on}))
        assert run.datasets.images == plain.datasets.images
        assert [n for n in run.notes() if key in n and "changes nothing here" in n]


def test_scan_skipping_switches_at_config_level_say_so_too(tmp_path, images):
    """The same keys in config.json were refused as 'not implemented yet' while an entry's got a note."""
    for key, off, on in [("skip_file_discovery", "", "vae,aspect,text,metadata"),
                         ("preserve_data_backend_cache", False, True)]:
        quiet = load_config(write_config(tmp_path, images, **{key: off}))
        assert not any(key in n for n in quiet.notes())
        noted = load_config(write_config(tmp_path, images, **{key: on}))
        assert [n for n in noted.notes() if n.startswith(f"{key} ") and "changes nothing here" in n]


@pytest.mark.parametrize("block,off", [("caption_shuffle", {"enable": False, "count": 3, "split_on": "comma"}),
                                       ("grounding", {"enabled": "false", "auto_detect": {"enabled": True}})])
def test_switched_off_blocks_change_nothing(tmp_path, images, block, off):
    plain = load_config(write_config(tmp_path, images)).datasets.images[0]
    assert load_config(write_config(tmp_path, images, dataset={block: off})).datasets.images[0] == plain


# (key, value, the entry it is written on): values of keys difftune has, for features it does not
PENDING_VALUES = [
    ("dataset_type", "audio", "extra"), ("dataset_type", "image_embeds", "extra"),
    ("dataset_type", "conditioning_image_embeds", "extra"), ("type", "webshart", "image"),
    ("type", "memory", "text"), ("conditioning_type", "controlnet", "masks"),
    ("conditioning_type", "reference_loose", "masks"), ("crop_style", "face", "image"),
]


@pytest.mark.parametrize("key,value,where", PENDING_VALUES, ids=[v for _, v, _ in PENDING_VALUES])
def test_pending_values(tmp_path, images, key, value, where):
    if where == "extra":
        path = write_config(tmp_path, images, extra_datasets=[{"id": "other", "type": "local", key: value}])
    elif where == "masks":
        path = write_config(tmp_path, images, extra_datasets=[mask_entry(images, **{key: value})])
    else:
        path = entry_config(tmp_path, images, where, **{key: value})
    text = problems(path)
    assert f"{key}: not implemented yet" in text and "is not allowed" not in text


# --- implemented -----------------------------------------------------------------------------------------------


def test_disable_is_disabled(tmp_path, images):
    """SimpleTuner's other spelling: true leaves the entry out (its missing folder is not even looked at)."""
    gone = {"id": "old", "type": "local", "instance_data_dir": str(tmp_path / "nowhere")}
    run = load_config(write_config(tmp_path, images, extra_datasets=[{**gone, "disable": True}]))
    assert [ds.id for ds in run.datasets.images] == ["train"]
    assert "nowhere" in problems(write_config(tmp_path, images, extra_datasets=[{**gone, "disable": False}]))
    plain = load_config(write_config(tmp_path, images)).datasets.images[0]
    for off in (False, "false", None):
        assert load_config(write_config(tmp_path, images, dataset={"disable": off})).datasets.images[0] == plain
    text = problems(write_config(tmp_path, images, dataset={"disable": True, "disabled": False}))
    assert "disable" in text and "disabled" in text and "keep one" in text
    load_config(with_text_entry(tmp_path, images, {"disable": False}))  # on every kind of entry
    load_config(write_config(tmp_path, images, extra_datasets=[mask_entry(images, disable=True)]))


def test_simpletuner_spellings_of_values(tmp_path, images):
    """crop_style 'centre' is 'center'; repeats null is no repeats (SimpleTuner reads both so)."""
    centre = load_config(write_config(tmp_path, images, dataset={"crop": True, "crop_style": "centre"}))
    center = load_config(write_config(tmp_path, images, dataset={"crop": True, "crop_style": "center"}))
    assert centre.datasets.images[0] == center.datasets.images[0]
    assert load_config(write_config(tmp_path, images, dataset={"repeats": None})).datasets.images[0].repeats == 0


def test_vae_cache_clear_each_epoch(tmp_path, images):
    """A new random crop each epoch (behaviour: tests/test_vae_cache_each_epoch.py); with a crop that is not random
    every epoch would encode the same latents: switched off with a note naming the dataset and the fix (SimpleTuner's
    own DATALOADER.md example sets it with crop false; it was refused)."""
    each = {"crop": True, "crop_style": "random", "vae_cache_clear_each_epoch": True}
    assert load_config(write_config(tmp_path, images, dataset=each)).datasets.images[0].vae_cache_clear_each_epoch
    for unused, what in [({"crop_style": "center"}, "crop_style is 'center'"), ({"crop": False}, "crop is false")]:
        run = load_config(write_config(tmp_path, images, dataset={**each, **unused}))
        assert not run.datasets.images[0].vae_cache_clear_each_epoch
        said = [n for n in run.notes() if "vae_cache_clear_each_epoch" in n]
        assert len(said) == 1 and f"vae_cache_clear_each_epoch on dataset 'train': {what}" in said[0]
        assert "cached once" in said[0] and "'random'" in said[0]


def test_caption_filter_list_on_the_text_embeds_entry(tmp_path, images):
    """SimpleTuner's key of a text_embeds entry (behaviour: tests/test_caption_filter.py); on an image entry it is
    accepted empty and otherwise refused with the fix (SimpleTuner refuses it there too)."""
    run = load_config(with_text_entry(tmp_path, images, {"caption_filter_list": ["arafed "]}))
    assert run.datasets.text_embeds.caption_filter_list == ["arafed "]
    load_config(write_config(tmp_path, images, dataset={"caption_filter_list": []}))
    text = problems(write_config(tmp_path, images, dataset={"caption_filter_list": ["arafed "]}))
    assert "dataset 'train': caption_filter_list:" in text and "move it to the text_embeds entry" in text


def test_conditioning_data_as_a_list(tmp_path, images):
    one = load_config(write_config(tmp_path, images, dataset={"conditioning_data": ["masks"]},
                                   extra_datasets=[mask_entry(images)]))
    assert one.datasets.images[0].conditioning_data == "masks" and one.datasets.mask_dir(one.datasets.images[0])
    text = problems(write_config(tmp_path, images, dataset={"conditioning_data": ["masks", "more"]},
                                 extra_datasets=[mask_entry(images)]))
    assert "conditioning_data: ['masks', 'more']" in text and "name one" in text
    # an i2i flavour: only that error, not also "set conditioning_data" (it is set, to several)
    from families import make_pairs

    make_pairs(images, tmp_path / "inputs")
    text = problems(write_config(tmp_path / "i2i", images, dataset={"conditioning_data": ["inputs", "more"]},
                                 conditioning_dir=tmp_path / "inputs", model_family="kandinsky5-image",
                                 model_flavour="tiny-random-i2i"))
    assert "name one" in text and "set conditioning_data" not in text, text


def test_source_dataset_id_names_the_dataset_that_pairs(tmp_path, images):
    pairs = {"conditioning_data": "masks"}
    load_config(write_config(tmp_path, images, dataset=pairs, extra_datasets=[mask_entry(images, source_dataset_id="train")]))
    load_config(write_config(tmp_path, images, dataset=pairs, extra_datasets=[mask_entry(images, source_dataset_id=None)]))
    text = problems(write_config(tmp_path, images, extra_datasets=[mask_entry(images, source_dataset_id="train")]))
    assert "source_dataset_id 'train'" in text and "conditioning_data to 'masks'" in text
    text = problems(write_config(tmp_path, images, dataset=pairs,
                                 extra_datasets=[mask_entry(images, source_dataset_id="trian")]))
    assert "source_dataset_id 'trian' names no enabled image or video dataset" in text


def video_config(tmp_path, folder, flavour, **video):
    return write_config(tmp_path, folder, model_family="kandinsky5-video", model_flavour=flavour,
                        dataset={"dataset_type": "video", "resolution": 32, "video": {"num_frames": 17, **video}})


def test_video_is_i2v_follows_the_flavour(tmp_path, images):
    plain = load_config(video_config(tmp_path, images, "tiny-random"))
    assert load_config(video_config(tmp_path, images, "tiny-random", is_i2v=False)).notes() == plain.notes()
    text = problems(video_config(tmp_path, images, "tiny-random", is_i2v=True))
    assert "video.is_i2v: true" in text and "tiny-random-i2v" in text
    i2v = load_config(video_config(tmp_path, images, "tiny-random-i2v", is_i2v=True))
    assert not any("is_i2v" in n for n in i2v.notes())
    forced = load_config(video_config(tmp_path, images, "tiny-random-i2v", is_i2v=False))
    assert any("is_i2v false is overridden" in n for n in forced.notes())


def test_disable_multiline_split_keeps_the_file_one_caption(tmp_path):
    folder = tmp_path / "lines"
    paths = make_dataset(folder, count=2)
    for p in paths:
        p.with_suffix(".txt").write_text(f"{p.stem}\n  second line of {p.stem}\n\n")

    def captions(**keys):
        run = load_config(write_config(tmp_path, folder, dataset=keys))
        return sorted(s.captions for s in discover_all(run, write_metadata=False, fetch=False)[0].samples)

    split = captions()
    assert split == [(p.stem, f"second line of {p.stem}") for p in paths]
    assert captions(disable_multiline_split=False) == split
    assert captions(disable_multiline_split=True) == [(f"{p.stem}\n  second line of {p.stem}",) for p in paths]


@pytest.mark.slow
def test_text_encoder_batch_size_and_compress_cache(tmp_path, images, monkeypatch):
    """text_encoder_batch_size sets the captions per text-encoder pass (write_batch_size then is not used, with a
    note); compress_cache writes an entry's cache compressed or plain whatever compress_disk_cache says."""
    from difftune.models.lumina2 import Lumina2Family
    from difftune.train.setup import build_run

    batches: list[int] = []
    real = Lumina2Family.encode_text
    monkeypatch.setattr(Lumina2Family, "encode_text", lambda self, comps, prompts, *a, **k: (
        batches.append(len(prompts)), real(self, comps, prompts, *a, **k))[1])

    def run(name, text=None, dataset=None, **config):
        batches.clear()
        path = with_text_entry(tmp_path / name, images, text, dataset=dataset or {}, max_train_steps=1,
                               output_dir=str(tmp_path / name / "out"), **config)
        loaded = load_config(path)
        built = build_run(loaded)
        latents = [c.latent_file.read_bytes().startswith(MAGIC) for c in built.data.items]
        texts = [built.data.text_caches["train"].path(c.text_keys[0]).read_bytes().startswith(MAGIC)
                 for c in built.data.items]
        return list(batches), set(latents), set(texts), loaded.notes()

    plain = run("plain")
    assert plain[:3] == ([3], {False}, {False})  # the 3 distinct captions in one pass; nothing compressed
    assert run("nulls", {"text_encoder_batch_size": None, "compress_cache": None}, {"compress_cache": None})[:3] \
        == plain[:3]
    batched = run("batched", {"text_encoder_batch_size": 2, "write_batch_size": 128}, {"compress_cache": True})
    assert batched[:3] == ([2, 1], {True}, {False})
    assert any("write_batch_size is not used" in n for n in batched[3])
    by_config = run("by-config", {"compress_cache": None, "write_batch_size": 1}, {"compress_cache": False},
                    compress_disk_cache=True)
    assert by_config[:3] == ([1, 1, 1], {False}, {True})
    assert not any("write_batch_size" in n for n in by_config[3])


# --- a dataset list as a SimpleTuner user writes it --------------------------------------------------------------


def test_a_simpletuner_dreambooth_dataset_list_loads(tmp_path):
    """A subject, a regularisation set and the text cache, written the way SimpleTuner's Dreambooth and quickstart
    guides write them: every key SimpleTuner documents for them, most at their SimpleTuner values."""
    subject, regularisation = tmp_path / "datasets" / "subject", tmp_path / "datasets" / "regularisation"
    make_dataset(subject, count=4)
    make_dataset(regularisation, count=6, seed=1)
    cache = str(tmp_path / "cache")
    shared = {"type": "local", "crop": False, "crop_style": "centre", "crop_aspect": "square", "resolution": 64,
              "resolution_type": "pixel_area", "minimum_image_size": 32, "maximum_image_size": 128,
              "target_downsample_size": 64, "disable": False, "hash_filenames": True, "metadata_backend": "discovery",
              "caption_strategy": "textfile", "prepend_instance_prompt": False, "only_instance_prompt": False,
              "instance_prompt": None, "skip_file_discovery": "", "preserve_data_backend_cache": False,
              "vae_cache_clear_each_epoch": False, "probability": 1.0, "start_epoch": 1, "start_step": 0,
              "disable_multiline_split": False}
    entries = [
        {"id": "subject", "dataset_type": "image", "instance_data_dir": str(subject), "repeats": 8,
         "cache_dir_vae": f"{cache}/vae/{{model_family}}/subject", "is_regularisation_data": None, **shared},
        {"id": "regularisation", "dataset_type": "image", "instance_data_dir": str(regularisation), "repeats": None,
         "max_num_samples": 5, "is_regularization_data": True,
         "cache_dir_vae": f"{cache}/vae/{{model_family}}/regularisation", **shared},
        {"id": "unused-style-set", "type": "local", "instance_data_dir": str(tmp_path / "not-yet"), "disable": True},
        {"id": "text-embeds", "type": "local", "dataset_type": "text_embeds", "default": True,
         "cache_dir": f"{cache}/text/{{model_family}}", "disable": False, "write_batch_size": 128,
         "text_encoder_batch_size": 4, "caption_filter_list": [], "text_cache_ondemand": False,
         "preserve_data_backend_cache": False, "skip_file_discovery": ""},
    ]
    path = write_config(tmp_path, subject, model_family="lumina2")
    (tmp_path / "config" / "multidatabackend.json").write_text(json.dumps(entries, indent=2))
    run = load_config(path)
    sets = run.datasets
    assert [ds.id for ds in sets.images] == ["subject", "regularisation"]
    assert [(ds.crop_style, ds.repeats, ds.is_regularisation_data) for ds in sets.images] == [
        ("center", 8, False), ("center", 0, True)]
    assert sets.images[0].cache_dir_vae == f"{cache}/vae/lumina2/subject"
    assert sets.text_embeds.encode_batch() == 4 and sets.text_embeds.cache_dir == f"{cache}/text/lumina2"
    assert any("write_batch_size is not used" in n for n in run.notes())


def test_ignore_epochs_and_metadata_backend_values(tmp_path):
    """SimpleTuner's Flux Dreambooth example writes ignore_epochs (a no-op there: it logs that it is deprecated) and
    metadata_backend 'json' (its older name for the scanned metadata): both load; ignore_epochs with a note.
    metadata_backend 'parquet' takes the sizes from the caption table, so it needs one with size columns."""
    images = tmp_path / "images"
    make_dataset(images, count=3)
    path = write_config(tmp_path, images, dataset={"ignore_epochs": True, "metadata_backend": "json"})
    run = load_config(path)
    assert run.datasets.images[0].metadata_backend == "json"
    assert any("ignore_epochs does nothing" in n for n in run.notes())
    assert "metadata_backend 'parquet' reads each image's size" in problems(
        write_config(tmp_path, images, dataset={"metadata_backend": "parquet"}))
    rows = [{"filename": p.name, "caption": "a shape", "w": 64, "h": 64} for p in sorted(images.glob("*.png"))]
    (images / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    table = {"caption_strategy": "parquet", "metadata_backend": "parquet",
             "parquet": {"path": "captions.jsonl", "width_column": "w", "height_column": "h"}}
    run = load_config(write_config(tmp_path, images, dataset=table))
    (found,) = discover_all(run, write_metadata=False)
    assert len(found.samples) == 3 and found.probed == 0  # sizes from the table: no file opened to measure it
    table["parquet"] = {"path": "captions.jsonl"}
    assert "sets width_column and height_column" in problems(write_config(tmp_path, images, dataset=table))


def test_an_instance_prompt_in_no_caption_gets_a_note(tmp_path, images):
    """SimpleTuner's example entry has instance_prompt with prepend_instance_prompt false and captions from the file
    names: the trigger word trains in no caption. A forgotten prepend_instance_prompt was silent."""
    run = load_config(write_config(tmp_path, images, dataset={"instance_prompt": "sks dog"}))
    said = [n for n in run.notes() if "instance_prompt 'sks dog' is in no caption" in n]
    assert len(said) == 1 and "prepend_instance_prompt" in said[0]
    for used in ({"prepend_instance_prompt": True}, {"only_instance_prompt": True},
                 {"caption_strategy": "instanceprompt"}):
        run = load_config(write_config(tmp_path, images, dataset={"instance_prompt": "sks dog", **used}))
        assert not any("is in no caption" in n for n in run.notes())
