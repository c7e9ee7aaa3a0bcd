"""Masked loss (`conditioning_type: "mask"` conditioning datasets, `masked_loss_probability`; train/masked_loss.py):
the config's checks, masks cropped exactly like their images, the loss against one computed by hand, the off values
(all-white masks, probability 0) bit for bit, the data report, and resume."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from conftest import config_problems as problems
from conftest import step_draws, write_config
from difftune.config import load_config
from difftune.data.latents import crop_position, mask_grid, mask_pixels, sample_pixels
from difftune.demo import make_dataset
from difftune.train import loop, objective
from difftune.train.loop import train
from difftune.train.setup import build_run
from test_train import crash_then_resume, losses

RECT = (40, 12, 72, 44)  # the white rectangle of the constructed masks (left, top, right, bottom)


def rect_image(path, size=(96, 64), fill=255, rect=RECT) -> None:
    img = Image.new("RGB", size, (0, 0, 0))
    ImageDraw.Draw(img).rectangle((rect[0], rect[1], rect[2] - 1, rect[3] - 1), fill=(fill, fill, fill))
    img.save(path)


def make_masks(images, folder, *, fill=255, rect=RECT, skip=()) -> None:
    """A mask per image (same name): `rect` in white (or grey `fill`) on black, at the image's size."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in sorted(images.glob("*.png")):
        if path.name not in skip:
            rect_image(folder / path.name, Image.open(path).size, fill, rect)


def mask_entry(folder, **extra):
    return {"id": "masks", "type": "local", "dataset_type": "conditioning", "conditioning_type": "mask",
            "instance_data_dir": str(folder)} | extra


def masked_config(root, images, masks, dataset=None, **config):
    return write_config(root, images, dataset={"conditioning_data": "masks", **(dataset or {})},
                        extra_datasets=[mask_entry(masks)], **config)


def _first_batch(run):
    return next(iter(run.data))


# --- config -------------------------------------------------------------------------------------------------


def test_config_accepts_masks_and_refuses_misuse(tmp_path, dataset):
    masks = tmp_path / "masks"
    make_masks(dataset, masks)
    cfg = load_config(masked_config(tmp_path, dataset, masks))
    plan = cfg.datasets
    assert plan.mask_dir(plan.images[0]) == str(masks) and plan.conditioning_dir(plan.images[0]) is None
    assert cfg.train.masked_loss_probability == 1.0
    assert load_config(masked_config(tmp_path, dataset, masks, masked_loss_probability=None)).train.masked_loss_probability == 1.0
    # the i2i kind stays the default
    inputs = tmp_path / "inputs"
    make_masks(dataset, inputs)
    i2i = dict(model_family="kandinsky5-image", model_flavour="tiny-random-i2i")
    plan = load_config(write_config(tmp_path, dataset, dataset={"conditioning_data": "inputs"}, conditioning_dir=inputs,
                                    **i2i)).datasets
    assert plan.conditioning["inputs"].conditioning_type == "reference_strict"
    # a mask dataset is no input image: image-to-image flavours refuse it, with the reason
    text = problems(masked_config(tmp_path, dataset, masks, **i2i))
    assert "dataset 'train': flavour 'tiny-random-i2i' trains on image pairs" in text
    assert "'masks' holds loss masks" in text and "cannot be combined with image-to-image" in text
    # a probability with nothing to mask, or out of range
    path = write_config(tmp_path, dataset, masked_loss_probability=0.5)
    text = problems(path)
    # prefixed with the file that set the key (or the command line), as every other problem is
    assert f"{path}: masked_loss_probability: 0.5: no image dataset names a mask dataset" in text
    text = problems(write_config(tmp_path, dataset), masked_loss_probability=0.5)
    assert "command line: masked_loss_probability: 0.5: no image dataset" in text
    assert "masked_loss_probability" in problems(masked_config(tmp_path, dataset, masks, masked_loss_probability=1.5))
    load_config(write_config(tmp_path, dataset, masked_loss_probability=0.0))  # nothing masked: consistent
    # an unknown kind, a video dataset, an eval dataset
    backend = tmp_path / "config" / "multidatabackend.json"
    path = masked_config(tmp_path, dataset, masks)
    entries = json.loads(backend.read_text())
    entries[1]["conditioning_type"] = "controlnet"
    backend.write_text(json.dumps(entries))
    assert "conditioning_type" in problems(path) and "'mask'" in problems(path)
    text = problems(masked_config(tmp_path, dataset, masks, dataset={"dataset_type": "video"},
                                  model_family="kandinsky5-video", model_flavour="tiny-random"))
    assert "loss masks are for image datasets only: remove conditioning_data" in text
    held = {"id": "held", "type": "local", "dataset_type": "eval", "instance_data_dir": str(dataset),
            "caption_strategy": "textfile", "resolution": 64, "conditioning_data": "masks",
            "cache_dir_vae": str(tmp_path / "cache" / "held")}
    text = problems(write_config(tmp_path, dataset, extra_datasets=[mask_entry(masks), held]))
    assert "dataset 'held': conditioning_data 'masks' holds loss masks, but the evaluation loss" in text


# --- data ---------------------------------------------------------------------------------------------------


def test_simpletuner_mask_entry_with_its_image_settings(tmp_path, dataset):
    """SimpleTuner's Dreambooth example gives the mask entry its image dataset's size and crop settings, and caption
    keys: accepted when they agree (captions noted as unused), refused naming both datasets when they differ."""
    make_masks(dataset, tmp_path / "masks")
    same = {"resolution": 64, "resolution_type": "pixel_area", "crop": True, "crop_style": "center",
            "crop_aspect": "square", "minimum_image_size": 0}
    image = {"conditioning_data": "masks", **same}
    entry = mask_entry(tmp_path / "masks", **same, caption_strategy="instanceprompt",
                       instance_prompt="a shape", cache_file_suffix="square-mask")
    path = write_config(tmp_path, dataset, dataset=image, extra_datasets=[entry])
    notes = "\n".join(load_config(path).notes())
    assert "'masks': caption_strategy, instance_prompt, cache_file_suffix not used" in notes
    entry |= {"crop_style": "random", "resolution": 128}
    text = problems(write_config(tmp_path, dataset, dataset=image, extra_datasets=[entry]))
    assert "crop_style 'random' differs from 'center' on dataset 'train'" in text
    assert "resolution 128 differs from 64 on" in text and "config.json" not in text


def test_masks_get_their_images_random_crop(tmp_path):
    """The images are their masks (a white rectangle on black, 96x64): after a random square crop the mask's
    latent-grid weights equal the image's own pixels averaged the same way, so the mask landed on the same region."""
    images, masks = tmp_path / "images", tmp_path / "masks"
    images.mkdir()
    for i in range(2):
        rect_image(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"a rectangle {i}")
    make_masks(images, masks)
    crop = {"crop": True, "crop_style": "random", "crop_aspect": "square"}
    # The crop position hashes the seed with the file's dataset and name: take the first seed that puts both crops
    # well off the centre, so the comparison with the centre crop below always means something.
    seed = next(n for n in range(100) if all(
        abs(crop_position(SimpleNamespace(ident=f"train/{i}.png"), "random", n)[0] - 0.5) > 0.3 for i in range(2)))
    run = build_run(load_config(masked_config(tmp_path, images, masks, dataset=crop, seed=seed)))
    seen = 0
    for item in run.data.items:
        s = item.sample
        assert s.mask == masks / s.path.name and s.bucket == (64, 64) and s.path.parent == images
        uv = crop_position(s, "random", seed)
        assert abs(uv[0] - 0.5) > 0.3
        pixels = (sample_pixels(s, "random", uv)[0:1] + 1.0) / 2.0  # the image's red channel as the image is cut
        expected = mask_grid(pixels, (8, 8))
        assert torch.allclose(mask_pixels(s, "random", uv), pixels, atol=1 / 255)
        centre = mask_grid((sample_pixels(s, "center", (0.5, 0.5))[0:1] + 1.0) / 2.0, (8, 8))
        assert not torch.allclose(expected, centre, atol=0.05)  # the random crop moved the rectangle
        seen += 1
    assert seen == 2
    for batch, _ in zip(run.data, range(2), strict=False):
        (path,) = batch.paths
        item = next(i for i in run.data.items if i.sample.path == path)
        uv = crop_position(item.sample, "random", seed)
        expected = mask_grid((sample_pixels(item.sample, "random", uv)[0:1] + 1.0) / 2.0, (8, 8))
        assert batch.mask.shape == (1, 1, 8, 8)
        torch.testing.assert_close(batch.mask[0], expected, atol=1 / 255, rtol=0)
    run.events.close()


def test_mask_of_another_size_is_stretched_to_its_image(tmp_path):
    images, masks = tmp_path / "images", tmp_path / "masks"
    images.mkdir()
    masks.mkdir()
    rect_image(images / "a.png")
    (images / "a.txt").write_text("a rectangle")
    rect_image(masks / "a.png", size=(48, 32), rect=tuple(v // 2 for v in RECT))  # half size, same rectangle
    run = build_run(load_config(masked_config(tmp_path, images, masks)))
    (item,) = run.data.items
    got = mask_grid(mask_pixels(item.sample, "center", (0.5, 0.5)), (8, 8))
    full = mask_grid((sample_pixels(item.sample, "center", (0.5, 0.5))[0:1] + 1.0) / 2.0, (8, 8))
    torch.testing.assert_close(got, full, atol=0.05, rtol=0)
    events = (tmp_path / "output" / "events.jsonl").read_text()
    assert "its loss mask is 48x32, the image 96x64: the mask is stretched" in events
    run.events.close()


def test_the_report_names_the_masks_and_an_image_without_one_is_left_out(tmp_path, dataset):
    masks = tmp_path / "masks"
    names = sorted(p.name for p in dataset.glob("*.png"))
    make_masks(dataset, masks, skip=(names[0],))
    run = build_run(load_config(masked_config(tmp_path, dataset, masks)))
    events = (tmp_path / "output" / "events.jsonl").read_text()
    assert "loss masks: train (from 'masks')" in events
    assert f"{names[0]}: no loss mask of the same name in {masks}" in events
    assert len(run.data.items) == len(names) - 1 and all(i.mask_file is not None for i in run.data.items)
    run.events.close()


# --- the loss -----------------------------------------------------------------------------------------------


def _by_hand(run, batch):
    """The per-element squared error as micro_step draws it (noise, noise levels from the run's generator)."""
    x0, noise, sigmas, x = step_draws(run, batch)
    with torch.no_grad():
        pred = run.family.predict(run.comps.transformer, x, sigmas, batch.text, None)
    return (pred.float() - objective.velocity_target(x0, noise).float()) ** 2


def _step_loss(run, batch):
    state = run.generator.get_state()
    loss = loop.micro_step(run, batch).detach()
    return loss, state


def test_loss_is_the_masked_mean_and_the_off_values_change_nothing(tmp_path, dataset):
    grey, white = tmp_path / "grey", tmp_path / "white"
    make_masks(dataset, grey, fill=128)  # partial weights: 128/255 inside the rectangle
    make_masks(dataset, white, rect=(0, 0, 64, 64))
    common = dict(train_batch_size=2)
    masked = build_run(load_config(masked_config(tmp_path / "m", dataset, grey, **common)))
    batch = _first_batch(masked)
    assert batch.mask.shape == (2, 1, 8, 8) and 0.0 < float(batch.mask.max()) <= 128 / 255 + 1e-6
    loss, state = _step_loss(masked, batch)
    masked.generator.set_state(state)
    error = _by_hand(masked, batch)
    torch.testing.assert_close(loss, (error * batch.mask).mean(), rtol=1e-5, atol=0)  # mean over every element
    assert loss < error.mean()
    masked.events.close()

    plain = build_run(load_config(write_config(tmp_path / "p", dataset, **common)))
    reference = _first_batch(plain)
    assert reference.mask is None and torch.equal(reference.latents, batch.latents)
    expected, _ = _step_loss(plain, reference)
    plain.events.close()
    for masks, keys in ((white, {}), (grey, {"masked_loss_probability": 0.0})):
        run = build_run(load_config(masked_config(tmp_path / f"o{len(keys)}", dataset, masks, **common, **keys)))
        got = _first_batch(run)
        state = run.generator.get_state()
        assert torch.equal(_step_loss(run, got)[0], expected)  # bit for bit
        torch.testing.assert_close(run.generator.get_state(), plain.generator.get_state())
        assert not torch.equal(state, run.generator.get_state())
        run.events.close()


def test_black_masks_are_warned_about(tmp_path, dataset):
    """A mask saved with values 0 and 1 (or black over its crop) weighs its sample's loss to nothing: said once,
    when the masks are cached, naming a file."""
    ones, grey = tmp_path / "ones", tmp_path / "grey"
    make_masks(dataset, ones, fill=1)
    make_masks(dataset, grey, fill=128)
    for folder, warned in ((ones, True), (grey, False)):
        run = build_run(load_config(masked_config(tmp_path / f"run-{folder.name}", dataset, folder)))
        run.events.close()
        lines = [json.loads(line) for line in (run.output_dir / "events.jsonl").read_text().splitlines()]
        black = [e["message"] for e in lines if e["event"] == "warning" and "black over" in e.get("message", "")]
        count = len(list(dataset.glob("*.png")))
        assert black == ([f"dataset 'train': {count} loss mask(s) black over the whole trained crop, e.g. "
                          f"{sorted(ones.glob('*.png'))[0]}: those samples add nothing to the loss. White (255) "
                          "marks the area to train; a mask saved with values 0 and 1 looks black (scale it to 0 "
                          "and 255)"] if warned else [])


def test_probability_draws_per_batch_from_the_run_generator(tmp_path, dataset):
    grey = tmp_path / "grey"
    make_masks(dataset, grey, fill=128)
    run = build_run(load_config(masked_config(tmp_path, dataset, grey, masked_loss_probability=0.5)))
    batch = _first_batch(run)
    outcomes = set()
    for _ in range(12):
        state = run.generator.get_state()
        loss = loop.micro_step(run, batch).detach()
        after = run.generator.get_state()
        run.generator.set_state(state)
        error = _by_hand(run, batch)
        use = bool(torch.rand((), generator=run.generator) < 0.5)  # the one extra draw, after the noise
        assert torch.equal(run.generator.get_state(), after)
        expected = (error * batch.mask).mean() if use else error.mean()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
        outcomes.add(use)
    assert outcomes == {True, False}
    run.events.close()


@pytest.mark.slow  # about 20 s on 2 cores: two short trainings
def test_resume_is_exact(tmp_path, dataset, monkeypatch):
    grey = tmp_path / "grey"
    make_masks(dataset, grey, fill=128)
    common = dict(max_train_steps=3, checkpoint_step_interval=2, resume_from_checkpoint="latest", lr_scheduler="linear",
                  masked_loss_probability=0.5, scheduled_sampling_max_step_offset=1, scheduled_sampling_probability=0.5,
                  tread_config={"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": -1}]})
    train(build_run(load_config(masked_config(tmp_path / "a", dataset, grey, **common))))
    crash_then_resume(monkeypatch, masked_config(tmp_path / "b", dataset, grey, **common), at_step=2)
    expected, got = losses(tmp_path / "a" / "output"), losses(tmp_path / "b" / "output")
    assert len(expected) == 3 and got == expected


def test_with_regularisation_rollout_reflexflow_and_on_the_fly_latents(tmp_path, dataset):
    """A masked regularisation dataset encoded on the fly, with rollouts and ReflexFlow: the masks reach the batch
    (computed from the pixels, as the cache would have them) and the loss is finite and trains."""
    grey, reg = tmp_path / "grey", tmp_path / "reg"
    make_dataset(reg, count=2, seed=5)
    make_masks(reg, grey, fill=200)
    entry = {"id": "reg", "type": "local", "instance_data_dir": str(reg), "caption_strategy": "textfile",
             "resolution": 64, "cache_dir_vae": str(tmp_path / "cache" / "reg"), "is_regularisation_data": True,
             "vae_cache_disable": True, "conditioning_data": "masks"}
    keys = dict(scheduled_sampling_max_step_offset=2, scheduled_sampling_probability=1.0,
                scheduled_sampling_reflexflow=True)
    run = build_run(load_config(write_config(tmp_path, dataset, extra_datasets=[entry, mask_entry(grey)], **keys)))
    assert "loss masks: reg (from 'masks')" in (tmp_path / "output" / "events.jsonl").read_text()
    masked = next(b for b in run.data if b.mask is not None)
    assert masked.regularisation is not None and masked.mask.shape == (1, 1, 8, 8)
    item = next(i for i in run.data.items if i.sample.path == masked.paths[0])
    expected = mask_grid(mask_pixels(item.sample, "center", (0.5, 0.5)), (8, 8))
    torch.testing.assert_close(masked.mask[0], expected)
    assert np.isclose(float(masked.mask.max()), 200 / 255, atol=1e-6)
    with torch.no_grad():
        for p in run.params:  # away from the base model, or a regularisation batch's loss is exactly 0
            p.add_(torch.randn_like(p) * 0.05)
    loss = loop.micro_step(run, masked)
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    assert all(p.grad is not None for p in run.params)
    run.events.close()
