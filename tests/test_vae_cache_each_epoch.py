"""vae_cache_clear_each_epoch (a dataset entry key): a new random crop of every image each epoch of its dataset,
encoded during training. The crops against the epoch (new ones each epoch, the same ones for the same epoch), the
refusals, the data report and the memory plan, exact resume across an epoch boundary, and the option off (today's
crops, cached latents) bit for bit."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from conftest import config_problems as problems
from conftest import write_config
from difftune.config import load_config
from difftune.data.buckets import crop_box
from difftune.data.discovery import Sample
from difftune.data.latents import crop_position, sample_pixels
from difftune.data.sampler import BucketSampler
from difftune.demo import make_dataset
from difftune.memory_plan.predict import predict
from difftune.train.loop import train
from difftune.train.plan import discover_all
from difftune.train.setup import build_run
from test_train import crash_then_resume, losses

RANDOM = {"crop": True, "crop_style": "random", "crop_aspect": "square"}
EACH = {**RANDOM, "vae_cache_clear_each_epoch": True}


@pytest.fixture
def wide(tmp_path) -> Path:
    """Three 96x64 images: their square 64x64 crop can sit anywhere along 32 pixels of width."""
    folder = tmp_path / "wide"
    make_dataset(folder, count=3, size=(96, 64))
    return folder


def _sample(path: str = "/data/a.png") -> Sample:
    return Sample("train", Path(path), ("a",), 96, 64, (64, 64), None)


def test_crop_is_drawn_per_epoch_and_the_seed_draw_is_unchanged():
    s = _sample()
    digest = hashlib.sha256(b"7|/data/a.png").digest()  # today's draw (the latent cache's keys depend on it)
    assert crop_position(s, "random", 7) == (int.from_bytes(digest[:4], "little") / 2**32,
                                             int.from_bytes(digest[4:8], "little") / 2**32)
    epochs = [crop_position(s, "random", 7, e) for e in range(8)]
    assert epochs == [crop_position(s, "random", 7, e) for e in range(8)]  # a function of (seed, file, epoch)
    assert len(set(epochs)) == 8 and crop_position(s, "random", 7) not in epochs
    assert len({crop_box(96, 64, (64, 64), "random", *uv) for uv in epochs}) > 1
    assert crop_position(s, "random", 8, 0) != epochs[0]  # another seed
    assert crop_position(_sample("/b.png"), "random", 7, 0) != epochs[0]  # another file
    assert {crop_position(s, style, 7, 3) for style in ("center", "corner")} == {(0.5, 0.5)}


def test_sampler_reports_each_dataset_epoch():
    """drawn_epoch: the epoch of the last batch's own dataset, also when datasets are drawn by probability."""
    plain = BucketSampler([([0, 1], [(64, 64)] * 2, None)], 1, seed=0, keep_partial=True)
    seen = [plain.drawn_epoch for _ in zip(range(6), plain, strict=False)]
    assert seen == [0, 0, 1, 1, 2, 2]
    mixed = BucketSampler([([0], [(64, 64)], 1.0), ([1, 2, 3], [(64, 64)] * 3, 1.0)], 1, seed=0, keep_partial=True,
                          uniform=True)  # by probability alone: the small dataset is drawn as often as the large
    passes = {0: -1, 1: -1}
    for batch in zip(range(40), mixed, strict=False):
        d = 0 if batch[1] == [0] else 1
        assert mixed.drawn_epoch == mixed.state.streams[d][0]
        passes[d] = mixed.drawn_epoch
    assert passes[0] > passes[1] >= 1  # the one-image dataset went round more often


def test_config_accepts_random_crops_and_switches_off_the_rest(tmp_path, wide, dino):
    plain = load_config(write_config(tmp_path, wide, dataset=RANDOM)).datasets.images[0]
    for off in (False, None, "false"):
        assert load_config(write_config(tmp_path, wide, dataset={**RANDOM, "vae_cache_clear_each_epoch": off})
                           ).datasets.images[0] == plain
    assert load_config(write_config(tmp_path, wide, dataset=EACH)).datasets.images[0].vae_cache_clear_each_epoch
    switched_off = {  # only time would be lost: cached once, with a note (SimpleTuner's own example sets it so)
        "crop is false": {"crop": False, "crop_style": "random"},
        "crop_style is 'center'": {"crop": True},
        "crop_style is 'corner'": {"crop": True, "crop_style": "corner"},
        "crop_aspect 'random' draws each image's aspect": {"crop": True, "crop_aspect": "random",
                                                           "crop_aspect_buckets": [0.75, 1.0]},
    }
    for expected, keys in switched_off.items():
        run = load_config(write_config(tmp_path, wide, dataset={**keys, "vae_cache_clear_each_epoch": True}))
        assert not run.datasets.images[0].vae_cache_clear_each_epoch
        text = "\n".join(run.notes())
        assert "vae_cache_clear_each_epoch on dataset 'train'" in text and expected in text
        assert "set crop to true and crop_style to 'random'" in text
    held = {"id": "held", "type": "local", "dataset_type": "eval", "instance_data_dir": str(wide), **EACH}
    assert "an eval dataset is measured on the same crops" in problems(write_config(tmp_path, wide,
                                                                                    extra_datasets=[held]))
    drop = dict(crepa_enabled=True, crepa_encoder=dino, crepa_encoder_image_size=28, crepa_block_index=1,
                crepa_drop_vae_encoder=True)
    text = problems(write_config(tmp_path, wide, dataset=EACH, **drop))
    assert "dataset 'train': vae_cache_clear_each_epoch encodes its latents during training" in text
    from families import make_pairs

    make_pairs(wide, tmp_path / "inputs")
    i2i = dict(model_family="kandinsky5-image", model_flavour="tiny-random-i2i", conditioning_dir=tmp_path / "inputs")
    load_config(write_config(tmp_path, wide, dataset={**RANDOM, "conditioning_data": "inputs"}, **i2i))
    text = problems(write_config(tmp_path, wide, dataset={**EACH, "conditioning_data": "inputs"}, **i2i))
    assert "dataset 'train': vae_cache_clear_each_epoch draws a new crop each epoch" in text
    clips = tmp_path / "clips"
    clips.mkdir()
    video = dict(model_family="kandinsky5-video", model_flavour="tiny-random", validation_num_video_frames=17)
    load_config(write_config(tmp_path, clips, dataset={"dataset_type": "video", "resolution": 32, **EACH}, **video))


def _epochs(run, batches: int) -> dict[Path, list[tuple[int, torch.Tensor]]]:
    """path -> [(its dataset's epoch, its latents)] over the next `batches` batches (batch size 1)."""
    seen: dict[Path, list[tuple[int, torch.Tensor]]] = {}
    for batch in zip(range(batches), run.data, strict=False):
        seen.setdefault(batch[1].paths[0], []).append((run.data.sampler.drawn_epoch, batch[1].latents[0]))
    return seen


def test_each_epoch_draws_new_crops_and_the_same_ones_again(tmp_path, wide):
    run = build_run(load_config(write_config(tmp_path, wide, dataset=EACH)))
    assert all(item.latent_file is None and item.each_epoch for item in run.data.items)
    assert not (tmp_path / "cache" / "vae").exists() or not any((tmp_path / "cache" / "vae").rglob("*.safetensors"))
    seed, comps = run.cfg.seed, run.comps
    start = run.data.sampler.state_dict()
    seen = _epochs(run, 12)  # 3 images, 4 epochs
    boxes = []
    for path, uses in seen.items():
        assert [e for e, _ in uses] == [0, 1, 2, 3]
        sample = next(i.sample for i in run.data.items if i.sample.path == path)
        for epoch, latents in uses:  # exactly the encoding of this epoch's crop
            uv = crop_position(sample, "random", seed, epoch)
            with torch.no_grad():
                expected = run.family.encode_images(comps, sample_pixels(sample, "random", uv)[None]).float()[0]
            torch.testing.assert_close(latents, expected.cpu(), rtol=0, atol=0)
        boxes.append({crop_box(96, 64, (64, 64), "random", *crop_position(sample, "random", seed, e))
                      for e in range(4)})
    assert any(len(b) > 1 for b in boxes)  # four epochs of three images: new crops
    run.data.sampler.load_state_dict(start)
    again = _epochs(run, 12)
    assert all(torch.equal(a, b) for p in seen for (_, a), (_, b) in zip(seen[p], again[p], strict=True))
    report = (tmp_path / "output" / "events.jsonl").read_text()
    assert "new crops each epoch: train" in report and "with a new random crop each epoch" in report
    run.events.close()


def test_off_keeps_the_crop_of_the_seed(tmp_path, wide):
    """Off, a random crop is today's: drawn once per image and seed, cached (or, with vae_cache_disable, encoded on
    the fly) with the same crop every epoch."""
    cached = build_run(load_config(write_config(tmp_path / "a", wide, dataset=RANDOM)))
    assert all(i.latent_file is not None and not i.each_epoch for i in cached.data.items)
    cached.events.close()
    fly = build_run(load_config(write_config(tmp_path / "b", wide, dataset={**RANDOM, "vae_cache_disable": True})))
    assert all(not i.each_epoch and i.uv == crop_position(i.sample, "random", 7) for i in fly.data.items)
    for uses in _epochs(fly, 6).values():
        assert len(uses) == 2 and torch.equal(uses[0][1], uses[1][1])
    assert "new crops each epoch" not in (tmp_path / "b" / "output" / "events.jsonl").read_text()
    fly.events.close()


def test_memory_plan_keeps_the_vae_for_training(tmp_path, wide):
    def training_lines(dataset):
        run_cfg = load_config(write_config(tmp_path, wide, dataset=dataset, validation_resolution="64x64"))
        return {li.label for li in predict(run_cfg.train, discover_all(run_cfg, write_metadata=False))
                .phase("training").lines}

    plain, each = training_lines(RANDOM), training_lines(EACH)
    assert each - plain == {"VAE (latents encoded during training)"}
    assert training_lines({**RANDOM, "vae_cache_disable": True}) == each


@pytest.mark.slow  # 9 s alone on 2 cores, more under load: three short trainings (as test_masked_loss's resume)
def test_resume_across_an_epoch_boundary_is_exact(tmp_path, wide, monkeypatch):
    """Killed at step 4 (epoch 1, 3 batches an epoch) and resumed from its checkpoint: epochs 1 and 2 draw the crops
    an unbroken run draws."""
    common = dict(dataset=EACH, max_train_steps=7, checkpoint_step_interval=2, resume_from_checkpoint="latest")
    train(build_run(load_config(write_config(tmp_path / "a", wide, **common))))
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", wide, **common), at_step=4)
    expected, got = losses(tmp_path / "a" / "output"), losses(tmp_path / "b" / "output")
    assert len(expected) == 7 and got == expected
