"""Generated conditioning datasets (SimpleTuner's `"conditioning": [{"type": ...}]` on an image dataset): the config
they make, the images (canny, superresolution, jpeg_artifacts), a folder kept up to date and never taken from the
user, the web UI's scan before any image is made, and an image-to-image run training on them."""

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from conftest import config_problems, write_config
from difftune.config import load_config
from difftune.data.generated_conditioning import transform
from difftune.train.loop import train
from difftune.train.plan import DataError, check_data, discover_all
from difftune.train.setup import build_run

I2I = dict(model_family="kandinsky5-image", model_flavour="tiny-random-i2i", max_train_steps=1)


def generator_config(tmp_path, dataset, *generators, **overrides):
    return write_config(tmp_path, dataset, dataset={"conditioning": list(generators)}, **{**I2I, **overrides})


def folder_of(run_cfg):
    (gen,) = run_cfg.datasets.generated.values()
    return gen.folder


def test_the_entry_pairs_with_its_generated_dataset_with_simpletuner_defaults_and_spellings(tmp_path, dataset):
    run_cfg = load_config(generator_config(tmp_path, dataset, {"type": "edges", "low_threshold": 80}))
    (train_ds,) = run_cfg.datasets.images
    assert train_ds.conditioning_data == "train_conditioning_edges"  # SimpleTuner's id: the type as written
    gen = run_cfg.datasets.generated["train_conditioning_edges"]
    assert (gen.kind, gen.source_id, gen.settings) == ("canny", "train", {"low_threshold": 80, "high_threshold": 200})
    assert gen.folder.startswith("cache/conditioning_data/train_conditioning_edges-") and gen.default
    # another dataset of that id elsewhere (another config in the same working folder) gets a folder of its own
    other = tmp_path / "other-images"
    other.mkdir()
    elsewhere = load_config(generator_config(tmp_path / "b", other, {"type": "edges", "low_threshold": 80}))
    assert elsewhere.datasets.generated["train_conditioning_edges"].folder != gen.folder
    entry = run_cfg.datasets.conditioning["train_conditioning_edges"]
    assert (entry.instance_data_dir, entry.source_dataset_id) == (gen.folder, "train")
    jpeg = load_config(generator_config(tmp_path, dataset, {"type": "jpeg", "instance_data_dir": str(tmp_path / "j")}))
    assert jpeg.datasets.generated["train_conditioning_jpeg"].settings["quality"] == 25
    assert folder_of(jpeg) == str(tmp_path / "j")


@pytest.mark.parametrize("value", ["canny", ["canny"], [{"type": "canny"}, "x"]])
def test_a_conditioning_value_of_another_shape_is_one_problem(tmp_path, dataset, value):
    text = config_problems(write_config(tmp_path, dataset, dataset={"conditioning": value}, **I2I))
    assert text.count("\n") == 0 and "conditioning: " in text and "must be a list of generator entries" in text


def test_the_web_ui_form_has_the_key_as_json(tmp_path, dataset):
    from difftune.ui import dataset_fields

    (spec,) = [f for f in dataset_fields()["image"]["fields"] if f["name"] == "conditioning"]
    assert spec["kind"] == "json" and "canny" in spec["description"]
    run_cfg = load_config(generator_config(tmp_path, dataset, {"type": "canny"}))
    assert run_cfg.datasets.images[0].conditioning == [{"type": "canny"}]  # kept as written


@pytest.mark.parametrize(("generators", "extra", "expected"), [
    ([{"type": "depth"}], {}, "type 'depth': depth maps (a depth-estimation model) are not generated yet; make the "
                              "images yourself"),
    ([{"type": "masks", "min_masks": 3, "max_masks": 2}], {}, "min_masks 3 is above max_masks 2; swap them"),
    ([{"type": "cany"}], {}, "type 'cany' is unknown; use one of canny, jpeg_artifacts, random_masks, superresolution"),
    ([{"type": "canny"}, {"type": "jpeg"}], {}, "2 generators: a dataset pairs with one conditioning dataset"),
    ([{"type": "canny"}], {"conditioning_data": "inputs"}, "conditioning and conditioning_data are both set"),
    ([{"type": "canny", "params": {"low_threshold": 10}}], {}, "params: canny's settings are read from the "
                                                               "generator entry itself"),
    ([{"type": "canny", "low_threshold": 300}], {}, "low_threshold 300 is above high_threshold 200; swap them"),
    ([{"type": "jpeg_artifacts", "quality": 0}], {}, "conditioning[0]: quality: 0: Input should be greater than or "
                                                     "equal to 1"),
    ([{"type": "superresolution", "blur": 2}], {}, "blur: unknown setting of superresolution (it takes blur_radius"),
    ([{"type": "canny", "conditioning_type": "mask"}], {}, "conditioning_type 'mask': generated images are input "
                                                           "images"),
    ([{"type": "jpeg_artifacts", "quality_range": [60, 20]}], {}, "quality_range [60, 20]: two qualities from 1 to "
                                                                 "100, the lower first"),
])
def test_generators_that_cannot_run_are_refused_with_the_fix(tmp_path, dataset, generators, extra, expected):
    path = write_config(tmp_path, dataset, dataset={"conditioning": generators, **extra}, **I2I)
    assert expected in config_problems(path)


def test_a_video_dataset_and_a_family_without_image_to_image_are_refused(tmp_path, dataset):
    video = write_config(tmp_path, dataset, model_family="kandinsky5-video", model_flavour="tiny-random-i2v",
                         dataset={"dataset_type": "video", "conditioning": [{"type": "canny"}]})
    assert "generated conditioning images are for image datasets" in config_problems(video)
    lumina = write_config(tmp_path, dataset, dataset={"conditioning": [{"type": "canny"}]})
    assert "conditioning (generated input images) is only used by image-to-image flavours (none for lumina2); " \
           "remove conditioning" in config_problems(lumina)


def test_captions_on_a_single_generator_are_a_note_not_a_silent_change(tmp_path, dataset):
    run_cfg = load_config(generator_config(tmp_path, dataset, {"type": "canny", "captions": "edges to photo"}))
    (note,) = [n for n in run_cfg.notes() if "captions" in n]
    assert "captions 'edges to photo' is not used: with one conditioning dataset each pair trains with its image's " \
           "own caption" in note and "only_instance_prompt" in note


def edge_image(path, size=(48, 40), box=(12, 10, 35, 29)):
    image = Image.new("RGB", size, (0, 0, 0))
    ImageDraw.Draw(image).rectangle(box, fill=(255, 255, 255))
    image.save(path)
    return image


def test_canny_draws_the_edges_of_a_square_and_nothing_else(tmp_path):
    image = edge_image(tmp_path / "square.png")
    out = np.asarray(transform("canny", {"low_threshold": 50, "high_threshold": 100}, image, np.random.default_rng(0)))
    assert out.shape == (40, 48, 3) and set(np.unique(out)) == {0, 255}
    assert (out[..., 0] == out[..., 1]).all() and (out[..., 0] == out[..., 2]).all()  # grey as RGB
    border = np.zeros((40, 48), dtype=bool)  # the square's outline (x 12..35, y 10..29), one pixel either side
    border[9:31, 11:37] = True
    border[12:28, 14:34] = False
    edges = out[..., 0] > 0
    assert not (edges & ~border).any()  # nothing but the outline
    assert edges[9:12, 14:34].any(axis=0).all() and edges[28:31, 14:34].any(axis=0).all()  # top and bottom sides
    assert edges[12:28, 11:14].any(axis=1).all() and edges[12:28, 34:37].any(axis=1).all()  # left and right


def test_jpeg_artifacts_and_superresolution_are_what_their_settings_say(tmp_path):
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (32, 40, 3), dtype=np.uint8), "RGB")
    fixed = transform("jpeg_artifacts", _jpeg_settings(quality=10), photo, np.random.default_rng(1))
    buffer = io.BytesIO()
    photo.save(buffer, format="JPEG", quality=10)
    assert np.array_equal(np.asarray(fixed), np.asarray(Image.open(buffer).convert("RGB")))
    blurred = transform("superresolution", _sr_settings(add_noise=False), photo, np.random.default_rng(1))
    assert blurred.size == photo.size and np.asarray(blurred, float).std() < np.asarray(photo, float).std() / 2
    noisy = [np.asarray(transform("superresolution", _sr_settings(), photo, np.random.default_rng(seed)))
             for seed in (1, 1, 2)]
    assert np.array_equal(noisy[0], noisy[1]) and not np.array_equal(noisy[0], noisy[2])


def test_random_masks_paint_the_masked_area_white_and_keep_the_rest(tmp_path):
    from difftune.config.generated_conditioning import RandomMasksSettings

    photo = Image.fromarray(np.random.default_rng(0).integers(0, 250, (48, 64, 3), dtype=np.uint8), "RGB")
    hard = dict(edge_blur=False, edge_feather=False, min_coverage=0.2, max_coverage=0.2)
    mask = np.asarray(transform("random_masks", RandomMasksSettings(**hard).model_dump(mode="json"), photo,
                                np.random.default_rng(3)))
    assert set(np.unique(mask)) == {0, 255} and (mask[..., 0] == mask[..., 2]).all()
    assert mask[..., 0].mean() / 255 > 0.05  # shapes drawn until the coverage (checked between them)
    painted = np.asarray(transform("random_masks", RandomMasksSettings(**hard, output_mode="masked_image")
                                   .model_dump(mode="json"), photo, np.random.default_rng(3)))
    masked = mask[..., 0] == 255
    assert (painted[masked] == 255).all() and (painted[~masked] == np.asarray(photo)[~masked]).all()
    soft = np.asarray(transform("random_masks", RandomMasksSettings(min_coverage=0.2, max_coverage=0.2)
                                .model_dump(mode="json"), photo, np.random.default_rng(3)))[..., 0]
    assert len(np.unique(soft)) > 10 and (soft[masked] > 200).all()  # blurred and feathered around the shapes
    assert "mask_type_weights [1.0]: one weight" in config_problems(
        write_config(tmp_path, photo_dataset(tmp_path), **I2I,
                     dataset={"conditioning": [{"type": "inpainting", "mask_type_weights": [1]}]}))


def photo_dataset(tmp_path):
    from difftune.demo import make_dataset

    make_dataset(tmp_path / "photos", count=1)
    return tmp_path / "photos"


def _jpeg_settings(**given):
    from difftune.config.generated_conditioning import JpegArtifactsSettings

    return JpegArtifactsSettings(**given).model_dump(mode="json")


def _sr_settings(**given):
    from difftune.config.generated_conditioning import SuperResolutionSettings

    return SuperResolutionSettings(**given).model_dump(mode="json")


def outputs(folder):
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob("*.png"))}


def test_check_generates_once_then_only_what_changed_and_all_again_for_new_settings(tmp_path, dataset, capsys):
    folder = tmp_path / "generated"
    settings = {"type": "superresolution", "instance_data_dir": str(folder)}
    run_cfg = load_config(generator_config(tmp_path, dataset, settings))
    check_data(run_cfg)
    first = outputs(folder)
    assert sorted(first) == sorted(p.name for p in dataset.glob("*.png"))
    for name in first:
        with Image.open(folder / name) as made, Image.open(dataset / name) as source:
            assert made.format == "PNG" and made.size == source.size
    assert "generating 4 superresolution image(s) from dataset 'train'" in capsys.readouterr().out

    check_data(run_cfg)
    assert outputs(folder) == first and "generating" not in capsys.readouterr().out
    changed, removed = sorted(dataset.glob("*.png"))[:2]
    Image.new("RGB", (64, 64), (9, 9, 9)).save(changed)
    os.utime(changed, ns=(1, 1))  # another modification time, whatever the clock's resolution
    removed.unlink()
    removed.with_suffix(".txt").unlink()
    check_data(run_cfg)
    now = outputs(folder)
    assert removed.name not in now and now[changed.name] != first[changed.name]
    assert {k: v for k, v in now.items() if k != changed.name} == {k: v for k, v in first.items()
                                                                    if k not in (changed.name, removed.name)}
    assert "generating 1 superresolution image(s)" in capsys.readouterr().out

    check_data(load_config(generator_config(tmp_path, dataset, {**settings, "blur_radius": 4})))
    assert "generating 3 superresolution image(s) from dataset 'train' into " in capsys.readouterr().out
    assert all(outputs(folder)[k] != now[k] for k in now)


def test_a_folder_of_the_users_files_is_refused_and_left_as_it_is(tmp_path, dataset):
    folder = tmp_path / "my-inputs"
    folder.mkdir()
    mine = sorted(dataset.glob("*.png"))[0]
    (folder / mine.name).write_bytes(b"my own input image")
    run_cfg = load_config(generator_config(tmp_path, dataset, {"type": "canny", "instance_data_dir": str(folder)}))
    with pytest.raises(DataError, match="already holds files that difftune did not generate .generating would "
                                        "overwrite them."):
        check_data(run_cfg)
    assert (folder / mine.name).read_bytes() == b"my own input image"


def test_same_results_in_a_new_folder_and_an_unreadable_image_is_reported(tmp_path, dataset, capsys):
    (dataset / "broken.png").write_bytes(b"not a png")
    (dataset / "broken.txt").write_text("broken")
    made = {}
    for name in ("a", "b"):
        settings = {"type": "jpeg_artifacts", "quality_mode": "range", "add_noise": True,
                    "instance_data_dir": str(tmp_path / name)}
        found = discover_all(load_config(generator_config(tmp_path, dataset, settings)))
        made[name] = {p.name: p.read_bytes() for p in (tmp_path / name).glob("*.png")}
        assert "broken.png" in {p.name for p, _ in found[0].skipped}
    assert made["a"] == made["b"] and len(made["a"]) == 4  # a seed per image: the same draws anywhere
    said = capsys.readouterr().out
    assert "4 image(s) generated" in said and "1 unreadable, left out: broken.png: " in said
    again = discover_all(load_config(generator_config(tmp_path, dataset, settings)))
    assert "generating" not in capsys.readouterr().out  # tried again only once the file changes
    (why,) = [why for p, why in again[0].skipped if p.name == "broken.png"]
    assert "not a readable image" in why  # its own reason, not "no input image"


def test_changed_settings_drop_the_images_of_removed_sources_and_a_damaged_output_is_made_again(tmp_path, dataset):
    folder = tmp_path / "gen"
    settings = {"type": "canny", "instance_data_dir": str(folder)}
    check_data(load_config(generator_config(tmp_path, dataset, settings)))
    gone = sorted(dataset.glob("*.png"))[0]
    gone.unlink()
    gone.with_suffix(".txt").unlink()
    check_data(load_config(generator_config(tmp_path, dataset, {**settings, "low_threshold": 20})))
    assert not (folder / gone.name).exists() and len(list(folder.glob("*.png"))) == 3
    damaged = sorted(folder.glob("*.png"))[0]
    damaged.write_bytes(damaged.read_bytes()[:100])
    found = discover_all(load_config(generator_config(tmp_path, dataset, {**settings, "low_threshold": 20})))
    assert not found[0].skipped and Image.open(damaged).size == (64, 64)


def test_a_generated_folder_inside_a_dataset_is_never_trained_on(tmp_path, dataset):
    inside = {"type": "canny", "instance_data_dir": str(dataset / "edges")}
    check_data(load_config(generator_config(tmp_path, dataset, inside)))
    later = load_config(generator_config(tmp_path, dataset, {"type": "canny"},
                                         **{"caption_strategy": "instanceprompt", "instance_prompt": "x"}))
    found = discover_all(later, write_metadata=False, fetch=False)
    assert len(found[0].samples) == 4  # not the 4 edge maps of the old folder as well
    assert [why for p, why in found[0].notes if p == dataset / "edges"] == [
        "generated input images (its .difftune-source.json says so): not read as images to train on"]


def test_what_a_failed_generator_leaves_is_one_problem_named_at_its_key(tmp_path, dataset):
    text = config_problems(generator_config(tmp_path, dataset, {"type": "canny", "params": {"low_threshold": 1}}))
    assert "params" in text and "names no enabled dataset" not in text
    text = config_problems(generator_config(tmp_path, dataset, {"type": "canny"}, model_flavour="tiny-random"))
    assert "conditioning (generated input images) is only used by image-to-image flavours" in text
    assert "remove conditioning or pick such a flavour" in text
    assert load_config(generator_config(tmp_path, dataset, {"type": "Canny"})).datasets.generated[
        "train_conditioning_Canny"].kind == "canny"


def test_a_default_folder_that_cannot_be_used_says_to_delete_it(tmp_path, dataset, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_cfg = load_config(generator_config(tmp_path, dataset, {"type": "canny"}))
    folder = tmp_path / folder_of(run_cfg)
    folder.mkdir(parents=True)
    (folder / ".difftune-source.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot be read .*; delete that folder .difftune makes it again.$"):
        check_data(run_cfg)


def test_the_web_ui_keeps_generated_images_inside_its_roots_and_scans_a_refused_folder(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from difftune.demo import make_dataset
    from difftune.ui.server import create_app

    root = tmp_path / "root"
    make_dataset(root / "images", count=2)
    (root / "mine").mkdir()
    (root / "mine" / "000-x.png").write_bytes(b"the user's own")
    monkeypatch.chdir(root)
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")
    outside = tmp_path / "outside"
    for folder, expected in [(outside, "outside the folders"), (root / "mine", "difftune did not generate")]:
        generator_config(root, root / "images", {"type": "canny", "instance_data_dir": str(folder)})
        body = {"path": str(root / "config" / "config.json"),
                "config": json.loads((root / "config" / "config.json").read_text()),
                "datasets": json.loads((root / "config" / "multidatabackend.json").read_text()), "scan": True}
        problems = [p["message"] for p in client.post("/api/config/check", json=body).json()["problems"]]
        assert any(expected in m for m in problems), problems
    assert not outside.exists() and (root / "mine" / "000-x.png").read_bytes() == b"the user's own"


def test_an_interrupted_generation_goes_on_where_it_stopped(tmp_path, dataset, monkeypatch, capsys):
    from difftune.data import generated_conditioning

    folder = tmp_path / "gen"
    run_cfg = load_config(generator_config(tmp_path, dataset, {"type": "canny", "instance_data_dir": str(folder)}))
    real, calls = generated_conditioning.make_one, []

    def interrupted(gen, source, target, rel):
        calls.append(rel)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(gen, source, target, rel)

    monkeypatch.setattr(generated_conditioning, "make_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        check_data(run_cfg)
    kept = json.loads((folder / ".difftune-source.json").read_text())["files"]
    assert 2 <= len(kept) <= 3 and all((folder / f"{Path(rel).stem}.png").is_file() for rel in kept)
    monkeypatch.setattr(generated_conditioning, "make_one", real)
    capsys.readouterr()
    check_data(run_cfg)
    assert f"generating {4 - len(kept)} canny image(s)" in capsys.readouterr().out
    assert len(list(folder.glob("*.png"))) == 4 and not [p for p in folder.iterdir() if p.name.endswith(".part")]


def test_the_web_ui_scan_writes_nothing_and_counts_the_images_to_be_generated(tmp_path, dataset):
    run_cfg = load_config(generator_config(tmp_path, dataset, {"type": "canny",
                                                                "instance_data_dir": str(tmp_path / "gen")}))
    found = discover_all(run_cfg, write_metadata=False, fetch=False)
    assert len(found[0].samples) == 4 and not found[0].skipped
    assert not (tmp_path / "gen").exists()
    assert {s.conditioning.name for s in found[0].samples} == {p.name for p in dataset.glob("*.png")}


def test_an_image_to_image_run_trains_and_validates_on_the_generated_inputs(tmp_path, dataset):
    folder = tmp_path / "edges"
    path = generator_config(tmp_path, dataset, {"type": "canny", "instance_data_dir": str(folder)},
                            validation_prompt="paint it", validation_resolution="64x64",
                            validation_num_inference_steps=2)
    run = build_run(load_config(path))
    assert {item.sample.conditioning.parent for item in run.data.items} == {folder}
    assert all(item.conditioning_file is not None for item in run.data.items)
    assert run.validation[0].image.size == (64, 64)
    assert np.asarray(run.validation[0].image).max() == 255 and set(np.unique(np.asarray(run.validation[0].image))) \
        <= {0, 255}  # the canny map, not the training image
    train(run)
    events = [json.loads(line) for line in (run.output_dir / "events.jsonl").read_text().splitlines()]
    assert any("generating 4 canny image(s)" in e.get("message", "") for e in events)
    assert list((run.output_dir / "validation").glob("final-*.png"))
