"""SimpleTuner's smaller keys: tokenizer_max_length, model_card_note, the config-level text_encoder_batch_size and
conditioning_image_embed_batch_size, and a csv entry's csv_hash_filenames / shorten_filenames."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import Lumina2Pipeline

from conftest import config_problems, write_config
from difftune.config import ImageDataset, load_config
from difftune.data.cache import fingerprint
from difftune.memory_plan.predict import TEXT_TOKENS, predict
from difftune.models import get_family, tiny_model
from difftune.models.base import SampleRequest
from difftune.models.hub import ComponentError
from difftune.train.caching import text_cache_for
from difftune.train.model_card import model_card
from difftune.train.plan import DataError
from difftune.train.setup import set_text_length
from families import CASES

LONG = " ".join(["a red square on a white table"] * 60)  # far longer than any length below


def loaded(family_name: str, flavour: str = "tiny-random"):
    family = get_family(family_name)
    return family, family.load(str(tiny_model(family_name, flavour)), torch.float32)


# --- tokenizer_max_length: the config


@pytest.mark.parametrize("family,value,message", [
    ("lumina2", 0, "greater than 0"), ("lumina2", -3, "greater than 0"),
    ("lumina2", 513, "at most 512 tokens"), ("kandinsky5-image", 1025, "at most 1024 tokens"),
    ("kandinsky5-video", 2048, "at most 1024 tokens"),
])
def test_tokenizer_max_length_bounds(tmp_path, dataset, family, value, message):
    problems = config_problems(write_config(tmp_path, dataset, model_family=family, tokenizer_max_length=value))
    assert "tokenizer_max_length" in problems and message in problems


def test_tokenizer_max_length_accepted_and_default(tmp_path, dataset):
    assert load_config(write_config(tmp_path, dataset)).train.tokenizer_max_length is None
    cfg = load_config(write_config(tmp_path, dataset, model_family="kandinsky5-image", tokenizer_max_length=1024))
    assert cfg.train.tokenizer_max_length == 1024
    assert load_config(write_config(tmp_path, dataset), {"tokenizer_max_length": "77"}).train.tokenizer_max_length == 77


# --- tokenizer_max_length: encoding, the cache fingerprint, the model's own bound


def test_lumina2_encodes_at_the_length_as_the_pipeline_does():
    family, comps = loaded("lumina2")
    default = family.identity(comps)["text"]
    assert family.encode_text(comps, [LONG])[0]["prompt_embeds"].shape[0] == 256  # the pipeline's default
    comps.text_length = 200  # the system prompt counts too (164 tokens with the tiny tokenizer)
    ours = family.encode_text(comps, [LONG, "a cat"])
    assert ours[0]["prompt_embeds"].shape[0] == 200 and ours[1]["prompt_embeds"].shape[0] < 200
    stock = Lumina2Pipeline(transformer=None, vae=None, scheduler=None, **comps.text)
    embeds, mask, _, _ = stock.encode_prompt([LONG], do_classifier_free_guidance=False, max_sequence_length=200)
    torch.testing.assert_close(ours[0]["prompt_embeds"], embeds[0, : int(mask.sum())])
    changed = family.identity(comps)["text"]
    assert default["max_sequence_length"] == 256 and changed["max_sequence_length"] == 200
    assert fingerprint(changed) != fingerprint(default)  # a changed length encodes the captions again


def test_lumina2_limit_is_the_caption_rope_table(tmp_path, dataset):
    """The tiny model's axes_lens[0] is 300, as the real model's: 299 caption tokens run, 300 do not."""
    family, comps = loaded("lumina2")
    assert family.text_length_limit(comps) == 299
    x = torch.randn(1, 4, 8, 8)
    for n in (299, 300):
        comps.text_length = n
        text = family.collate_text(family.encode_text(comps, [LONG]))
        if n == 299:
            family.predict(comps.transformer, x, torch.tensor([0.5]), text)
        else:
            with pytest.raises(RuntimeError, match="index 300 is out of bounds"):
                family.predict(comps.transformer, x, torch.tensor([0.5]), text)
    comps.text_length = None
    cfg = load_config(write_config(tmp_path, dataset, tokenizer_max_length=300)).train
    with pytest.raises(DataError, match="tokenizer_max_length 300: .* at most 299 tokens"):
        set_text_length(cfg, family, comps, "tiny")
    assert comps.text_length is None
    set_text_length(cfg.model_copy(update={"tokenizer_max_length": 299}), family, comps, "tiny")
    assert comps.text_length == 299


def test_kandinsky5_passes_the_length_only_when_set():
    family, comps = loaded("kandinsky5-image")
    default = family.identity(comps)["text"]
    assert "max_sequence_length" not in default  # caches made before the key stay valid
    long = family.encode_text(comps, [LONG])[0]["prompt_embeds"].shape[0]
    comps.text_length = 16
    assert long > 16 and family.encode_text(comps, [LONG])[0]["prompt_embeds"].shape[0] == 16
    assert family.identity(comps)["text"]["max_sequence_length"] == 16
    assert family.text_length_limit(comps) == 1024


def test_kandinsky5_i2i_too_short_for_the_image_is_explained():
    from PIL import Image

    family, comps = loaded("kandinsky5-image", "tiny-random-i2i")
    image = Image.new("RGB", (64, 48), (200, 40, 40))  # 6 image tokens, and 3 around them
    comps.text_length = 1
    with pytest.raises(ComponentError, match="tokenizer_max_length 1 is too short .* input image's tokens"):
        family.encode_text(comps, ["a red square"], images=[image])
    comps.text_length = 10  # room for the image and the prompt's start: the prompt is cut (fit_prompt)
    assert family.encode_text(comps, ["a red square"], images=[image])[0]["prompt_embeds"].shape[0] == 10


@pytest.mark.parametrize("case", [c for c in CASES if c.id in ("lumina2:tiny-random", "kandinsky5-image:tiny-random")],
                         ids=lambda c: c.id)
def test_validation_sample_equals_stock_pipeline_at_the_length(case):
    """family.sample with tokenizer_max_length equals the stock pipeline given the prompt and max_sequence_length."""
    family, comps = loaded(case.family, case.flavour)
    comps.text_length = 200
    text = family.encode_text(comps, [LONG])[0]
    negative = family.encode_text(comps, ["blurry"], negative=True)[0]
    ours = family.sample(comps, comps.transformer, SampleRequest(text, negative, 64, 48, 2, 4.0, 5))
    pipe = case.stock(tiny_model(case.family, case.flavour))
    theirs = case.stock_sample(pipe, LONG, "blurry", 64, 48, 2, 4.0, 5, max_sequence_length=200)[0]
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))


def test_memory_plan_follows_the_length(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, model_flavour="2.0", validation_resolution="512x512")).train
    plain, longer = predict(cfg, None), predict(cfg.model_copy(update={"tokenizer_max_length": 512}), None)

    def line(prediction, phase, start):
        return next(li for li in prediction.phase(phase).lines if li.label.startswith(start))

    assert f"{TEXT_TOKENS} text tokens" in line(plain, "training", "saved activations").note
    assert "512 text tokens" in line(longer, "training", "saved activations").note
    assert line(longer, "training", "saved activations").bytes > line(plain, "training", "saved activations").bytes
    caching = [li for li in longer.phase("caching: text").lines if "activations" in li.label]
    assert caching and all("at 512 tokens" in li.note for li in caching)


# --- model_card_note


def test_model_card_note_near_the_top(tmp_path, dataset):
    run = SimpleNamespace(data=SimpleNamespace(items=[]), state=SimpleNamespace(step=3))
    note = "Trained on **my** photos; see the license."
    run_cfg = load_config(write_config(tmp_path, dataset, hub_model_id="me/model", model_card_note=note))
    lines = model_card(run_cfg, run, []).splitlines()
    title = lines.index("# me/model")
    assert lines[title + 2] == note and lines[title + 4].startswith("A LoRA of")
    plain = model_card(load_config(write_config(tmp_path, dataset, hub_model_id="me/model")), run, [])
    assert note not in plain and plain.splitlines()[title + 2].startswith("A LoRA of")
    assert "max_sequence_length" not in plain  # the pipeline's default, as validation sampled
    short = model_card(load_config(write_config(tmp_path, dataset, tokenizer_max_length=128)), run, [])
    assert "max_sequence_length=128" in short  # what validation sampled at
    full = model_card(load_config(write_config(tmp_path, dataset, model_type="full", use_ema=True,
                                               optimizer="adamw_bf16")), run, [])
    assert 'from_pretrained("your-name/your-model", subfolder="ema/transformer"' in full  # how to load its EMA


# --- text_encoder_batch_size and conditioning_image_embed_batch_size at config level


def test_config_text_encoder_batch_size_is_each_entries_default(tmp_path, dataset):
    own = {"id": "own", "type": "local", "dataset_type": "text_embeds", "cache_dir": str(tmp_path / "own"),
           "text_encoder_batch_size": 3}
    unset = {"id": "unset", "type": "local", "dataset_type": "text_embeds", "cache_dir": str(tmp_path / "unset"),
             "text_encoder_batch_size": None, "write_batch_size": 64}  # null: not set, as SimpleTuner writes it
    path = write_config(tmp_path, dataset, extra_datasets=[own, unset], text_encoder_batch_size=5)
    plan = load_config(path).datasets
    batches = {e.id: e.encode_batch() for e in plan.all_text_embeds.values()}
    assert batches == {"text-embeds": 5, "own": 3, "unset": 5}
    plain = load_config(write_config(tmp_path, dataset, extra_datasets=[own, unset])).datasets
    assert {e.id: e.encode_batch() for e in plain.all_text_embeds.values()} == {"text-embeds": 128, "own": 3,
                                                                              "unset": 64}
    assert "text_encoder_batch_size" in config_problems(write_config(tmp_path, dataset, text_encoder_batch_size=0))


def test_config_text_encoder_batch_size_sets_the_default_cache(tmp_path, dataset):
    """Without a text_embeds entry the default cache (made by the loader) batches by it, else 32."""
    path = write_config(tmp_path, dataset, text_encoder_batch_size=6)
    backend = tmp_path / "config" / "multidatabackend.json"
    backend.write_text(json.dumps([e for e in json.loads(backend.read_text()) if e["dataset_type"] != "text_embeds"]))
    run_cfg = load_config(path)
    ds = run_cfg.datasets.images[0]
    assert text_cache_for(run_cfg, ds, {"family": "test"})[1] == 6
    write_config(tmp_path, dataset)
    backend.write_text(json.dumps([e for e in json.loads(backend.read_text()) if e["dataset_type"] != "text_embeds"]))
    assert text_cache_for(load_config(path), ds, {"family": "test"})[1] == 32


def test_config_conditioning_image_embed_batch_size_is_pending(tmp_path, dataset):
    assert load_config(write_config(tmp_path, dataset, conditioning_image_embed_batch_size=None))
    problems = config_problems(write_config(tmp_path, dataset, conditioning_image_embed_batch_size=4))
    assert "conditioning_image_embed_batch_size" in problems and "not implemented yet" in problems
    assert "CLIP vision" in problems


# --- csv_hash_filenames / shorten_filenames


def csv_entry(tmp_path, **keys) -> ImageDataset:
    table = tmp_path / "table.csv"
    table.write_text("url,caption\nhttp://example.invalid/a.png,a\n")
    return ImageDataset.model_validate({"id": "web", "type": "csv", "csv_file": str(table),
                                        "csv_caption_column": "caption", **keys})


@pytest.mark.parametrize("keys", [{}, {"csv_hash_filenames": True}, {"shorten_filenames": True},
                                  {"csv_hash_filenames": True, "shorten_filenames": False}])
def test_csv_filename_keys_accepted_where_they_match(tmp_path, keys):
    assert csv_entry(tmp_path, **keys).type == "csv"


@pytest.mark.parametrize("keys,message", [
    ({"csv_hash_filenames": False}, "csv_hash_filenames false"),
    ({"shorten_filenames": False}, "shorten_filenames false"),
])
def test_csv_filename_keys_refused_otherwise(tmp_path, keys, message):
    with pytest.raises(ValueError, match=f"not implemented yet: {message}.*hash of their location"):
        csv_entry(tmp_path, **keys)


def test_csv_filename_keys_in_a_dataset_list(tmp_path, dataset):
    table = tmp_path / "table.csv"
    table.write_text("url,caption\nhttp://example.invalid/a.png,a\n")
    web = {"id": "web", "type": "csv", "csv_file": str(table), "csv_caption_column": "caption",
           "csv_cache_dir": str(tmp_path / "web")}
    plan = load_config(write_config(tmp_path, dataset, extra_datasets=[{**web, "csv_shorten_filenames": True}]))
    assert next(d for d in plan.datasets.images if d.id == "web").shorten_filenames is True
    problems = config_problems(write_config(tmp_path, dataset, extra_datasets=[{**web, "csv_shorten_filenames": False}]))
    assert "dataset 'web'" in problems and "shorten_filenames false" in problems
    local = config_problems(write_config(tmp_path, dataset, dataset={"csv_hash_filenames": True}))
    assert "csv_hash_filenames belongs to datasets of type 'csv'" in local
