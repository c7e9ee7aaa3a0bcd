"""A config saved by SimpleTuner's configure tool (`simpletuner configure`), which writes every default of its field
registry whatever the model: the defaults that did something else here were refused (36 problems over two `check`
runs on each family). Each is now implemented (logging_dir, validation_seed_source, aspect_bucket_alignment,
model_card_safe_for_work, a config-level disable_multiline_split), a note where it does nothing (lr_end and lr_power
beside a constant schedule), or accepted at its off value (other models' keys). And the dataset list its web UI's
dataset builder and wizard write: `{output_dir}` and `{id}` in every cache folder, the builder's leftover keys at
their empty values, and a generator's params at their defaults, its id and 'controlnet' type."""

import json
from pathlib import Path

import pytest
import torch

from conftest import config_problems as problems
from conftest import write_config
from difftune.config import load_config
from difftune.models.base import SampleRequest
from difftune.train.plan import discover_all

# what the configure tool writes at its defaults (an audit of its field registry), beside the user's own keys
CONFIGURE_DEFAULTS = {
    "lr_scheduler": "constant_with_warmup", "lr_end": 4e-07, "lr_power": 0.8, "logging_dir": "logs",
    "validation_seed_source": "cpu", "aspect_bucket_alignment": 64, "aspect_bucket_disable_rebuild": False,
    "model_card_safe_for_work": False, "disable_multiline_split": False, "wan_force_2_1_time_embedding": False,
    "enable_chunked_feed_forward": False, "feed_forward_chunk_size": 2, "lyrics_embedder_train": False,
    "lyrics_embedder_lr": 1e-5, "validation_audio_duration": 30.0, "audio_channels": 1,
    "audio_duration_interval": 3.0, "audio_truncation_mode": "beginning", "urepa_enabled": False,
    "urepa_lambda": 0.5, "urepa_model": "dinov2_vitg14", "urepa_threshold_mode": "permanent",
    "twinflow_enabled": False, "twinflow_target_step_count": 1, "crepa_use_tae": False,
    "crepa_normalize_neighbour_sum": False, "crepa_encoder_frames_batch_size": -1, "fused_qkv_projections": False,
    "sana_complex_human_instruction": "Given a user prompt, generate an 'Enhanced prompt' that provides detailed "
    "visual descriptions suitable for image generation. Evaluate the level of detail in the user prompt:\n"
    "- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, and spatial "
    "relationships to create vivid and concrete scenes.\nUser Prompt: ",
}


@pytest.mark.parametrize("family, flavour", [("lumina2", "tiny-random"), ("kandinsky5-image", "tiny-random")])
def test_a_configure_tool_config_is_accepted_with_notes(tmp_path, dataset, family, flavour):
    run = load_config(write_config(tmp_path, dataset, model_family=family, model_flavour=flavour,
                                   **CONFIGURE_DEFAULTS))
    notes = run.notes()
    assert [n for n in notes if n.startswith("lr_end 4e-07 and lr_power 0.8 not used")]
    assert [n for n in notes if n.startswith("logging_dir 'logs' not used")]
    cfg = run.train
    assert (cfg.logging_dir, cfg.validation_seed_source, cfg.aspect_bucket_alignment) == ("logs", "cpu", 64)
    assert run.datasets.images[0].disable_multiline_split is False


def test_other_values_of_other_models_keys_are_still_refused(tmp_path, dataset):
    text = problems(write_config(tmp_path, dataset, urepa_enabled=True, urepa_lambda=0.3, twinflow_enabled=True,
                                 sana_complex_human_instruction="Make it pretty: "))
    assert "urepa_enabled=True: not implemented yet" in text and "twinflow_enabled=True" in text
    assert "sana_complex_human_instruction=" in text
    assert "lr_power 0.5 applies to lr_scheduler 'polynomial' only" in problems(
        write_config(tmp_path, dataset, lr_scheduler="constant", lr_power=0.5))


def test_buckets_follow_the_alignment_and_a_grid_off_the_family_is_refused(tmp_path, dataset):
    run = load_config(write_config(tmp_path, dataset, aspect_bucket_alignment=64,
                                   dataset={"resolution": 160, "crop": True, "crop_aspect": "preserve"}))
    sizes = {s.bucket for d in discover_all(run) for s in d.samples}
    assert sizes and all(w % 64 == 0 and h % 64 == 0 for w, h in sizes), sizes
    plain = load_config(write_config(tmp_path / "plain", dataset,
                                     dataset={"resolution": 160, "crop": True, "crop_aspect": "preserve"}))
    assert {s.bucket for d in discover_all(plain) for s in d.samples} != sizes  # 16's grid: other sizes
    text = problems(write_config(tmp_path, dataset, aspect_bucket_alignment=24))
    assert "aspect_bucket_alignment 24: bucket sides must be multiples of 16 for lumina2" in text


def test_a_new_random_aspect_each_epoch_is_refused_only_beside_a_random_aspect_dataset(tmp_path, dataset):
    load_config(write_config(tmp_path, dataset, aspect_bucket_disable_rebuild=False))
    text = problems(write_config(tmp_path, dataset, aspect_bucket_disable_rebuild=False,
                                 dataset={"crop": True, "crop_aspect": "random", "crop_aspect_buckets": [0.75, 1.0]}))
    assert "dataset 'train': aspect_bucket_disable_rebuild false" in text and "not implemented yet" in text
    load_config(write_config(tmp_path, dataset, aspect_bucket_disable_rebuild=True,
                             dataset={"crop": True, "crop_aspect": "random", "crop_aspect_buckets": [0.75, 1.0]}))


def test_a_config_level_multiline_switch_is_every_datasets_default(tmp_path, dataset):
    run = load_config(write_config(tmp_path, dataset, disable_multiline_split=True,
                                   extra_datasets=[{"id": "own", "type": "local", "instance_data_dir": str(dataset),
                                                    "disable_multiline_split": False}]))
    assert {d.id: d.disable_multiline_split for d in run.datasets.images} == {"train": True, "own": False}


def test_cpu_seeded_validation_noise(tmp_path, dataset):
    """'cpu' draws the noise from a CPU generator whatever device samples (the same image on any GPU); the default
    draws it on that device. The model card's code draws it the same way."""
    from difftune.train.model_card import _generate

    request = SampleRequest({}, None, 64, 64, 2, 1.0, 5, noise_on_cpu=True)
    meta = torch.device("meta")  # a device the CPU is not: the generator stays on the CPU
    assert request.generator(meta).device.type == "cpu"
    assert torch.equal(torch.randn(3, generator=request.generator(meta)),
                       torch.randn(3, generator=torch.Generator().manual_seed(5)))
    cpu = load_config(write_config(tmp_path, dataset, validation_prompt="a cat", validation_seed_source="CPU"))
    assert 'torch.Generator("cpu").manual_seed(7)' in _generate(cpu)
    gpu = load_config(write_config(tmp_path / "gpu", dataset, validation_prompt="a cat"))
    assert 'torch.Generator("cuda").manual_seed(7)' in _generate(gpu)


def test_validation_uses_the_seed_source(tmp_path, dataset):
    from difftune.train.loop import train
    from difftune.train.setup import build_run

    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=1, validation_prompt="a red circle",
                                             validation_resolution="32x32", validation_num_inference_steps=1,
                                             validation_seed_source="cpu", report_to="tensorboard",
                                             logging_dir="logs", tracker_project_name="proj")))
    assert run.validation and all(r.noise_on_cpu for r in run.validation)
    train(run)
    assert list((run.output_dir / "logs" / "proj").rglob("events.out.tfevents.*"))  # logging_dir: TensorBoard's
    assert not (run.output_dir / "tensorboard").exists()


def test_logging_dir_stays_inside_output_dir(tmp_path, dataset):
    for bad in ("/var/log/tb", "../elsewhere", "~/tb"):
        assert "TensorBoard's logs go under output_dir" in problems(write_config(tmp_path, dataset, logging_dir=bad))
    assert load_config(write_config(tmp_path, dataset, logging_dir="")).train.logging_dir is None


def test_a_card_not_safe_for_work_says_so(tmp_path, dataset):
    from difftune.train.model_card import model_card

    class Done:  # the parts of a finished run the card reads
        class state:
            step = 3

        class data:
            items: list = []

    safe = load_config(write_config(tmp_path, dataset, push_to_hub=True, hub_model_id="me/model"))
    card = model_card(safe, Done, [])
    assert "not-for-all-audiences" not in card and "NSFW" not in card
    nsfw = load_config(write_config(tmp_path, dataset, push_to_hub=True, hub_model_id="me/model",
                                    model_card_safe_for_work=False))
    card = model_card(nsfw, Done, [])
    front = card.split("---")[1]
    assert "- not-for-all-audiences" in front and "**Warning:** this model may generate content" in card


def test_the_configure_defaults_reach_check_on_the_command_line(tmp_path, dataset, capsys):
    from difftune.cli import main

    path = write_config(tmp_path, dataset, **CONFIGURE_DEFAULTS)
    assert main(["check", "--config", str(path)]) in (0, None)
    out = capsys.readouterr()
    assert f"{path}: OK" in out.out
    assert "lr_end 4e-07 and lr_power 0.8 not used" in out.out + out.err
    assert json.loads(Path(path).read_text())["aspect_bucket_alignment"] == 64


# --- the dataset list as SimpleTuner's web UI writes it (its dataset builder and wizard)

def builder_entry(kind: str, folder, **more) -> dict:
    """An entry of SimpleTuner's web UI dataset builder: every key of its form, saved as it is."""
    return {"conditioning": [], "conditioning_data": [], "crop_aspect": "square", "crop_style": "random",
            "disabled": False, "hash_filenames": True, "preserve_data_backend_cache": False, "probability": 1,
            "repeats": 0, "resolution_type": "pixel", "type": "local", "id": f"{kind}-1700000000000",
            "dataset_type": kind, "audio": {}, "audio_caption_fields": [], "lyrics_column": "", "video": {},
            "cache_dir_vae": "{output_dir}/cache/vae/{model_family}/{id}", "instance_data_dir": str(folder),
            "resolution": 64, "caption_strategy": "textfile"} | more


def builder_list(root: Path, *entries: dict) -> Path:
    text_embeds = {"conditioning": [], "conditioning_data": [], "crop_aspect": "square", "crop_style": "random",
                   "disabled": False, "hash_filenames": True, "preserve_data_backend_cache": False, "probability": 1,
                   "repeats": 0, "resolution_type": "pixel", "type": "local", "id": "text-embeds",
                   "dataset_type": "text_embeds", "audio_caption_fields": [], "default": True,
                   "cache_dir": "{output_dir}/cache/text/{model_family}", "write_batch_size": 128}
    path = root / "multidatabackend.json"
    path.write_text(json.dumps([*entries, text_embeds]))
    return path


def test_the_web_ui_builders_dataset_list_loads_with_its_placeholders_filled(tmp_path, dataset):
    """Every cache folder it writes has {output_dir} and {id} (SimpleTuner fills both), every entry an empty
    conditioning_data list and empty audio keys, and the text_embeds entry its image defaults: each was refused."""
    backend = builder_list(tmp_path, builder_entry("image", dataset))
    run = load_config(write_config(tmp_path, dataset, data_backend_config=str(backend),
                                   output_dir=str(tmp_path / "out")))
    (entry,) = run.datasets.images
    assert entry.cache_dir_vae == f"{tmp_path / 'out'}/cache/vae/lumina2/image-1700000000000"
    assert entry.conditioning_data is None
    assert run.datasets.text_embeds.cache_dir == f"{tmp_path / 'out'}/cache/text/lumina2"
    # another value of those keys is still what it was: a problem
    backend = builder_list(tmp_path, builder_entry("image", dataset, lyrics_column="lyrics", video={"num_frames": 9}))
    text = problems(write_config(tmp_path, dataset, data_backend_config=str(backend)))
    assert "lyrics_column" in text and "video" in text
    entries = json.loads(backend.read_text())
    entries[-1]["crop_style"] = "center"  # not the builder's value: a misplaced key, named as before
    backend.write_text(json.dumps(entries))
    assert "crop_style" in problems(write_config(tmp_path, dataset, data_backend_config=str(backend)))
    # a conditioning entry's repeats or probability of another value: said as such, not as an unknown key
    backend = builder_list(tmp_path, builder_entry("image", dataset),
                           builder_entry("conditioning", dataset, id="inputs", repeats=3, probability=0.5))
    text = problems(write_config(tmp_path, dataset, data_backend_config=str(backend)))
    assert "repeats 3 does nothing on a conditioning entry" in text and "probability 0.5 does nothing" in text, text
    assert "unknown key" not in text, text


def test_an_unknown_placeholder_and_an_entry_without_an_id_are_named(tmp_path, dataset):
    backend = builder_list(tmp_path, builder_entry("image", dataset, cache_dir_vae="{output_dir}/{run}/vae"))
    assert "has the placeholder {run}, which difftune does not fill" in problems(
        write_config(tmp_path, dataset, data_backend_config=str(backend)))
    nameless = builder_entry("image", dataset)
    del nameless["id"]
    backend = builder_list(tmp_path, nameless)
    assert "has the placeholder {id}, but the entry has no id to fill it with" in problems(
        write_config(tmp_path, dataset, data_backend_config=str(backend)))


def test_the_web_ui_builders_image_to_image_pair_and_wizard_generator(tmp_path, dataset):
    from families import make_pairs

    make_pairs(dataset, tmp_path / "inputs")
    pair = builder_list(tmp_path, builder_entry("image", dataset, conditioning_data=["cond-1"]),
                        builder_entry("conditioning", tmp_path / "inputs", id="cond-1",
                                      conditioning_type="reference_strict", default=False))
    i2i = dict(model_family="kandinsky5-image", model_flavour="tiny-random-i2i")
    run = load_config(write_config(tmp_path, dataset, data_backend_config=str(pair), **i2i))
    assert run.datasets.images[0].conditioning_data == "cond-1"
    # the wizard's generator: its params at SimpleTuner's defaults and the builder's id, as SimpleTuner's own
    # i2i example writes conditioning_type 'controlnet': notes
    generator = {"type": "canny", "id": "x-conditioning-0", "conditioning_type": "controlnet",
                 "params": {"low_threshold": 100, "high_threshold": 200},
                 "instance_data_dir": str(tmp_path / "edges")}
    run = load_config(write_config(tmp_path / "gen", dataset, dataset={"conditioning": [generator]}, **i2i))
    notes = "\n".join(run.notes())
    for words in ("params {'low_threshold': 100, 'high_threshold': 200} is not used",
                  "id 'x-conditioning-0' is not used", "conditioning_type 'controlnet' is read as 'reference_strict'"):
        assert words in notes
    assert run.datasets.generated["train_conditioning_canny"].settings == {"low_threshold": 100,
                                                                            "high_threshold": 200}


def test_images_without_captions_say_which_caption_strategy_would_read_them(tmp_path):
    """The builder writes no caption_strategy: SimpleTuner captions by file name then, difftune reads .txt files.
    A folder without any says so, with the keys that would caption it."""
    from difftune.demo import make_dataset
    from difftune.train.plan import DataError

    make_dataset(tmp_path / "images", count=2)
    for caption in (tmp_path / "images").glob("*.txt"):
        caption.unlink()
    entry = builder_entry("image", tmp_path / "images")
    del entry["caption_strategy"]  # as the builder writes it
    backend = builder_list(tmp_path, entry)
    run = load_config(write_config(tmp_path, tmp_path / "images", data_backend_config=str(backend)))
    with pytest.raises(DataError, match="none of its files has a caption file, which caption_strategy 'textfile' "
                                        r"reads \(difftune's default when it is not set\).*caption_strategy 'filename'"):
        discover_all(run)
    backend = builder_list(tmp_path, builder_entry("image", tmp_path / "images", caption_strategy="filename"))
    assert discover_all(load_config(write_config(tmp_path, tmp_path / "images", data_backend_config=str(backend))))


def test_placeholders_inside_an_entrys_blocks_are_filled(tmp_path, dataset):
    """A generator's instance_data_dir and parquet.path take the entry's {output_dir} and {id} too: check made
    folders literally named '{output_dir}/conditioning/{id}'. Its captions are text, never filled."""
    generator = {"type": "canny", "instance_data_dir": "{output_dir}/conditioning/{id}", "captions": "a {style}"}
    backend = builder_list(tmp_path, builder_entry("image", dataset, conditioning=[generator]))
    i2i = dict(model_family="kandinsky5-image", model_flavour="tiny-random-i2i")
    run = load_config(write_config(tmp_path, dataset, data_backend_config=str(backend), output_dir=str(tmp_path / "out"),
                                   **i2i))
    (made,) = run.datasets.generated.values()
    assert made.folder == f"{tmp_path / 'out'}/conditioning/image-1700000000000"
    assert "{" not in str(run.datasets.conditioning_dir(run.datasets.images[0]))
    backend = builder_list(tmp_path, builder_entry("image", dataset, conditioning=[{**generator,
                                                                                    "instance_data_dir": "{x}/c"}]))
    assert "conditioning.instance_data_dir: '{x}/c' has the placeholder {x}" in problems(
        write_config(tmp_path, dataset, data_backend_config=str(backend), **i2i))
