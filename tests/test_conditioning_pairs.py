"""Kandinsky 5 image-to-image and image-to-video inputs as users lay them out: two input files of one name, an input
folder inside the dataset's folder or equal to it, a conditioning entry no dataset names, a plain image folder as
i2i validation input, the validation input taken from a training set (not a held-out eval set) and from a set of
clips. Discovery and the config only: no model loads."""

import json

import pytest

from conftest import write_config
from difftune.config import load_config
from difftune.train.plan import discover_all
from difftune.train.validation_input import candidates
from families import make_clips, make_pairs

I2I = dict(model_family="kandinsky5-image", model_flavour="tiny-random-i2i", max_train_steps=1)


def skipped(found) -> dict[str, str]:
    return {path.name: why for d in found for path, why in d.skipped}


def test_two_input_images_of_one_name_are_refused_not_picked(tmp_path, dataset):
    inputs = tmp_path / "inputs"
    make_pairs(dataset, inputs)
    twin = sorted(inputs.glob("*.png"))[0]
    (inputs / f"{twin.stem}.jpg").write_bytes(twin.read_bytes())
    found = discover_all(load_config(write_config(tmp_path, dataset, dataset={"conditioning_data": "inputs"},
                                                  conditioning_dir=inputs, **I2I)))
    why = skipped(found)[twin.name]
    assert f"2 files in {inputs} could be its conditioning image ({twin.stem}.jpg, {twin.name}); keep one" == why
    assert len(found[0].samples) == len(list(dataset.glob("*.png"))) - 1


def test_an_input_folder_inside_the_dataset_folder_is_not_trained_on(tmp_path, dataset):
    inputs = dataset / "inputs"
    make_pairs(dataset, inputs)
    found = discover_all(load_config(write_config(tmp_path, dataset, dataset={"conditioning_data": "inputs"},
                                                  conditioning_dir=inputs, **I2I)))
    assert not found[0].skipped  # the inputs were read as targets, each left out for want of its own input
    assert len(found[0].samples) == len(list(dataset.glob("*.png")))
    assert [why for path, why in found[0].notes if path == inputs] == [
        "inside the dataset's folder: read as its input images or masks only, not as images to train on"]


def test_an_input_folder_equal_to_the_dataset_folder_and_an_unused_one_get_notes(tmp_path, dataset):
    run = load_config(write_config(tmp_path, dataset, dataset={"conditioning_data": "inputs"},
                                   conditioning_dir=dataset, **I2I))
    (same,) = [n for n in run.notes() if "is the same folder" in n]
    assert "dataset 'train': its conditioning dataset 'inputs'" in same and "an edit that changes nothing" in same
    make_pairs(dataset, tmp_path / "inputs")
    t2i = load_config(write_config(tmp_path, dataset, conditioning_dir=tmp_path / "inputs",
                                   model_family="kandinsky5-image", model_flavour="tiny-random"))
    (unused,) = [n for n in t2i.notes() if "not used" in n and "'inputs'" in n]
    assert "flavour 'tiny-random' trains without input images" in unused and "tiny-random-i2i" in unused


def test_i2i_validation_inputs_from_a_plain_image_folder_and_never_from_a_held_out_set(tmp_path, dataset):
    """A plain image folder named by eval_dataset_id was refused with "trains on image pairs"; without one, the
    input came from whichever input folder's path sorted first, an eval set's included."""
    make_pairs(dataset, tmp_path / "inputs")
    probes = tmp_path / "probes"
    make_pairs(dataset, probes)
    plain = load_config(write_config(tmp_path, dataset, dataset={"conditioning_data": "inputs"},
                                     conditioning_dir=tmp_path / "inputs", validation_using_datasets=True,
                                     eval_dataset_id="probes", validation_prompt="swap it",
                                     extra_datasets=[{"id": "probes", "type": "local",
                                                      "instance_data_dir": str(probes)}], **I2I))
    assert "probes" in plain.datasets.validation_only
    assert candidates(plain, discover_all(plain))[0].parent == probes

    held = tmp_path / "held"
    make_pairs(dataset, held / "a-inputs")  # sorts before "inputs"
    for png in sorted(dataset.glob("*.png"))[:2]:
        (held / png.name).write_bytes(png.read_bytes())
        (held / png.with_suffix(".txt").name).write_text("held out")
    path = write_config(tmp_path / "second", dataset, dataset={"conditioning_data": "inputs"},
                        conditioning_dir=tmp_path / "inputs", validation_prompt="swap it", **I2I)
    backend = json.loads((tmp_path / "second" / "config" / "multidatabackend.json").read_text())
    backend += [{"id": "held", "type": "local", "dataset_type": "eval", "instance_data_dir": str(held),
                 "conditioning_data": "held-inputs", "resolution": 64, "resolution_type": "pixel_area"},
                {"id": "held-inputs", "type": "local", "dataset_type": "conditioning",
                 "instance_data_dir": str(held / "a-inputs")}]
    (tmp_path / "second" / "config" / "multidatabackend.json").write_text(json.dumps(backend))
    run = load_config(path)
    assert candidates(run, discover_all(run))[0].parent == tmp_path / "inputs"


def test_i2v_validation_input_from_the_training_clips_named_by_eval_dataset_id(tmp_path, dataset):
    """eval_dataset_id naming the video dataset itself: check said OK, and training died looking for an image in
    the clips' folder."""
    clips = make_clips(tmp_path / "clips", frames=12)
    run = load_config(write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random-i2v",
                                   max_train_steps=1, dataset={"dataset_type": "video", "resolution": 32,
                                                               "video": {"num_frames": 9}},
                                   validation_num_video_frames=17, validation_prompt="a square",
                                   validation_using_datasets=True, eval_dataset_id="train"))
    assert candidates(run, discover_all(run))[0] == clips / "clip0.mp4"


def test_eval_dataset_id_naming_the_pairs_dataset_takes_an_input_image_not_a_target(tmp_path, dataset):
    """The training dataset of i2i pairs named by eval_dataset_id: its first target was the validation input, so
    the model was asked to edit the finished result."""
    make_pairs(dataset, tmp_path / "inputs")
    run = load_config(write_config(tmp_path, dataset, dataset={"conditioning_data": "inputs"},
                                   conditioning_dir=tmp_path / "inputs", validation_using_datasets=True,
                                   eval_dataset_id="train", validation_prompt="swap it", **I2I))
    assert candidates(run, discover_all(run))[0].parent == tmp_path / "inputs"


def test_i2i_validation_input_is_fitted_to_each_validation_size(tmp_path, dataset):
    """The validation input image (a large photo of another aspect) was given whole to the Qwen encoder, whose token
    budget a phone photo overflows, and stretched by the pipeline: like a training input it is now resized to cover
    each validation size and center-cropped, and each size's prompt is encoded with that picture."""
    from PIL import Image

    from difftune.train.setup import build_run

    inputs = tmp_path / "inputs"
    make_pairs(dataset, inputs)
    first = sorted(inputs.glob("*.png"))[0]
    Image.new("RGB", (600, 240), (200, 30, 30)).save(first)  # wide and large
    run = build_run(load_config(write_config(tmp_path, dataset, dataset={"conditioning_data": "inputs"},
                                             conditioning_dir=inputs, validation_prompt="swap it",
                                             validation_resolution="64x64,96x64", **I2I)))
    sizes = {(r.width, r.height): r for r in run.validation if r.name != "unconditional"}
    assert set(sizes) == {(64, 64), (96, 64)}
    for (w, h), request in sizes.items():
        assert request.image.size == (w, h)
    # each size's prompt was encoded with its own picture: the embeddings differ
    square, wide = sizes[(64, 64)].text["prompt_embeds"], sizes[(96, 64)].text["prompt_embeds"]
    assert square.shape != wide.shape or not (square == wide).all()


def test_an_input_image_without_its_training_image_is_named(tmp_path, dataset):
    """An input image whose target was renamed or removed was left out without a word."""
    make_pairs(dataset, tmp_path / "inputs")
    (tmp_path / "inputs" / "orphan.png").write_bytes(sorted((tmp_path / "inputs").glob("*.png"))[0].read_bytes())
    (found,) = discover_all(load_config(write_config(tmp_path, dataset, dataset={"conditioning_data": "inputs"},
                                                     conditioning_dir=tmp_path / "inputs", **I2I)))
    assert [why for path, why in found.notes if path == tmp_path / "inputs"] == [
        f"1 input image(s) with no file of the same name in {dataset} to train: not used (orphan)"]


def test_an_unreadable_validation_input_is_skipped_and_none_readable_fails_before_any_model_loads(
        tmp_path, dataset, monkeypatch, capsys):
    """eval_dataset_id naming a folder whose first image is truncated: check said OK and training died after caching
    with a traceback naming no file. Now the next image is taken with a warning, and a folder of broken images fails
    in check and before any model loads, naming them."""
    from difftune.cli import main
    from difftune.train.setup import build_run
    from difftune.train.validation_input import ValidationInputError, pick

    make_pairs(dataset, tmp_path / "inputs")
    probes = tmp_path / "probes"
    probes.mkdir()
    good = sorted((tmp_path / "inputs").glob("*.png"))
    (probes / "a.png").write_bytes(good[0].read_bytes()[:300])  # truncated, first in order
    (probes / "b.png").write_bytes(good[1].read_bytes())
    keys = dict(dataset={"conditioning_data": "inputs"}, conditioning_dir=tmp_path / "inputs",
                validation_using_datasets=True, eval_dataset_id="probes", validation_prompt="swap it",
                extra_datasets=[{"id": "probes", "type": "local", "instance_data_dir": str(probes)}], **I2I)
    path = write_config(tmp_path, dataset, **keys)
    run = load_config(path)
    chosen, image, skipped = pick(run, discover_all(run))
    assert chosen == probes / "b.png" and image is not None
    assert len(skipped) == 1 and str(probes / "a.png") in skipped[0] and "truncated" in skipped[0]
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"warning: validation input image {probes / 'a.png'} cannot be read" in out
    (probes / "b.png").write_bytes(b"not an image")
    assert main(["check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no validation input image can be read (eval_dataset_id 'probes')" in err
    assert str(probes / "a.png") in err and str(probes / "b.png") in err
    from difftune.models.kandinsky5_image import Kandinsky5ImageFamily

    def boom(*a, **k):
        raise AssertionError("a model was loaded, but this error must come before any model loads")

    monkeypatch.setattr(Kandinsky5ImageFamily, "load", boom)
    with pytest.raises(ValidationInputError, match="no validation input image can be read"):
        build_run(load_config(path))


def test_validation_input_past_twenty_unreadable_ones_and_an_empty_folder(tmp_path, dataset, capsys):
    """The 21st candidate was never tried (the run refused to start although it would have trained), and an empty
    eval_dataset_id folder was a FileNotFoundError traceback in check."""
    from PIL import Image

    from difftune.cli import main
    from difftune.train.validation_input import first_readable

    bad = []
    for i in range(25):
        (tmp_path / f"{i:02d}.png").write_bytes(b"broken")
        bad.append(tmp_path / f"{i:02d}.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "99.png")
    path, image, skipped = first_readable([*bad, tmp_path / "99.png"], "test")
    assert path == tmp_path / "99.png" and image.size == (8, 8)
    assert len(skipped) == 21 and skipped[-1] == "... and 5 more unreadable validation input images"
    make_pairs(dataset, tmp_path / "inputs")
    (tmp_path / "empty").mkdir()
    config = write_config(tmp_path / "run", dataset, dataset={"conditioning_data": "inputs"},
                          conditioning_dir=tmp_path / "inputs", validation_using_datasets=True, eval_dataset_id="empty",
                          validation_prompt="swap it", **I2I,
                          extra_datasets=[{"id": "empty", "type": "local", "instance_data_dir": str(tmp_path / "empty")}])
    assert main(["check", "--config", str(config)]) == 2
    assert "eval_dataset_id 'empty': no image in" in capsys.readouterr().err
