"""Kandinsky 5.0 Video end to end on the tiny models: video datasets (resampling, trimming, bad files),
the cache, image-to-video masking, validation videos, patched VAE convolutions and startup placement."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import load_config
from difftune.data.images import fit
from difftune.data.video import audio_only_file, decode_frames, synthetic_clip
from difftune.models import get_family, tiny_model
from difftune.train.loop import micro_step, train
from difftune.train.setup import build_run
from families import make_clips


def video_run_config(tmp_path, clips, flavour="tiny-random", video=None, **overrides):
    dataset = {"dataset_type": "video", "resolution": 32, "video": video or {"num_frames": 9}}
    dataset |= overrides.pop("dataset", {})
    return write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour=flavour,
                        dataset=dataset, **overrides)


def test_t2v_trains_on_real_world_clips_and_reports_every_file(tmp_path):
    clips = make_clips(tmp_path / "clips", count=2, frames=12)
    synthetic_clip(clips / "fast.mkv", frames=20, fps=30, seed=5)  # 19/30 s -> 16 frames at 24 fps
    synthetic_clip(clips / "short.mp4", frames=6, seed=6)  # too short for 9 frames
    synthetic_clip(clips / "turned.mov", width=32, height=24, frames=12, rotation=90, seed=7)
    synthetic_clip(clips / "odd.webm", width=33, height=25, frames=12, seed=8)
    synthetic_clip(clips / "uneven.mkv", frames=14, variable_rate=True, seed=9)
    audio_only_file(clips / "sound.mp4")
    whole = synthetic_clip(tmp_path / "whole.mp4", frames=24, seed=4).read_bytes()
    (clips / "cut.mp4").write_bytes(whole[: len(whole) * 6 // 10])  # truncated download
    (clips / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)
    (clips / "empty.mp4").write_bytes(b"")
    for name in ("fast", "short", "turned", "odd", "uneven", "sound", "broken", "empty", "cut"):
        (clips / f"{name}.txt").write_text(f"clip {name}")
    path = video_run_config(tmp_path, clips, max_train_steps=3, validation_prompt="a square",
                            validation_resolution="32x32", validation_num_video_frames=5,
                            validation_num_inference_steps=2, frame_rate=24,
                            validation_disable_unconditional=True)
    run = build_run(load_config(path))
    report = "\n".join(json.loads(line).get("text", "") for line in (run.output_dir / "events.jsonl").open())
    assert "short.mp4: 6 frame(s) at 24 fps, shorter than num_frames 9" in report
    assert "sound.mp4" in report and "audio" in report
    assert "broken.mp4" in report and "empty.mp4" in report and "cut.mp4: " in report
    assert "fast.mkv: resampled from 30 to 24 fps; trimmed to the first 9 of 16 frames" in report
    assert "rotated 90 degrees by its metadata: trained upright, 24x32" in report
    assert "odd.webm: trimmed to the first 9 of 12 frames\n" in report  # 24 fps, rounded timestamps
    assert "uneven.mkv" in report and "variable frame rate" in report
    trained = sorted(c.sample.path.name for c in run.data.items)
    assert trained == ["clip0.mp4", "clip1.mp4", "fast.mkv", "odd.webm", "turned.mov", "uneven.mkv"]
    turned = next(c for c in run.data.items if c.sample.path.name == "turned.mov")
    assert (turned.sample.width, turned.sample.height, turned.sample.frames) == (24, 32, 9)
    latents = load_file(turned.latent_file)["latents"]
    assert latents.shape == (16, 3, turned.sample.bucket[1] // 8, turned.sample.bucket[0] // 8)  # 9 frames -> 3
    train(run)
    events = [json.loads(line) for line in (run.output_dir / "events.jsonl").open()]
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    videos = sorted((run.output_dir / "validation").glob("*.mp4"))
    sheets = sorted((run.output_dir / "validation").glob("*.png"))
    assert [p.name for p in videos] == ["final-step-000003-32x32@5.mp4"] and len(sheets) == 1
    assert len(decode_frames(videos[0], [k / 24 for k in range(5)])) == 5
    assert (run.output_dir / "pytorch_lora_weights.safetensors").is_file()
    # A second run finds every clip in the cache: nothing is encoded again.
    run2 = build_run(load_config(path))
    assert [c.latent_file for c in run2.data.items] == [c.latent_file for c in run.data.items]
    messages = [json.loads(line).get("message", "") for line in (run2.output_dir / "events.jsonl").open()]
    assert any("latent cache" in m and "0 newly encoded" in m for m in messages[len(events):])


def test_cached_latents_are_framewise_and_reproducible(tmp_path):
    """A 33-frame clip is longer than the VAE's 16-frame window: the cache holds exactly what a fresh
    framewise encode gives. Image-to-video also caches the first frame encoded on its own (as the pipeline
    encodes its input image), which is not the clip's first latent frame (GroupNorm spans all frames)."""
    family = get_family("kandinsky5-video")
    comps = family.load(str(tiny_model("kandinsky5-video", "tiny-random")), torch.float32)
    assert comps.vae.use_framewise_encoding and comps.vae.tile_sample_min_num_frames == 16
    clips = tmp_path / "clips"
    clips.mkdir()
    synthetic_clip(clips / "long.mp4", frames=33, seed=3)
    (clips / "long.txt").write_text("a long clip")
    run = build_run(load_config(video_run_config(tmp_path, clips, flavour="tiny-random-i2v",
                                                 video={"num_frames": 33})))
    entry = load_file(run.data.items[0].latent_file)
    cached = entry["latents"]
    from difftune.data.latents import sample_pixels

    pixels = sample_pixels(run.data.items[0].sample, "center", (0.5, 0.5))
    with torch.no_grad():
        fresh = family.encode_images(comps, pixels[None])[0]
        first = family.encode_images(comps, pixels[None, :, 0])[0]
    assert cached.shape[1] == 9
    torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entry["first_frame"], first, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(cached[:, :1], first, atol=1e-3)
    assert torch.equal(next(iter(run.data)).conditioning[0], entry["first_frame"])


def test_patch_conv_gives_the_same_cache(tmp_path, monkeypatch):
    """vae_enable_patch_conv patches the VAE used for caching; with a threshold small enough that every 3D
    conv of the tiny VAE really runs in tiles, the cached latents equal the unpatched ones."""
    from difftune.models import patch_conv

    clips = make_clips(tmp_path / "clips", count=1, frames=9)
    plain = build_run(load_config(video_run_config(tmp_path / "a", clips, dataset={"cache_dir_vae": str(tmp_path / "va")})))
    tiles = []
    real_plan = patch_conv._plan

    def small(vae, max_elements=2**27):
        return real_enable(vae, max_elements=2000)

    def counting_plan(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        if plan is not None:
            tiles.append(plan)
        return plan

    real_enable = patch_conv.enable_patch_conv
    monkeypatch.setattr(patch_conv, "enable_patch_conv", small)
    monkeypatch.setattr(patch_conv, "_plan", counting_plan)
    patched = build_run(load_config(video_run_config(
        tmp_path / "b", clips, vae_enable_patch_conv=True, dataset={"cache_dir_vae": str(tmp_path / "vb")})))
    assert tiles  # the patched forward ran and planned tiles
    a = load_file(plain.data.items[0].latent_file)["latents"]
    b = load_file(patched.data.items[0].latent_file)["latents"]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("on_the_fly", [False, True], ids=["cached", "on-the-fly"])
def test_i2v_masks_the_first_frame(tmp_path, on_the_fly):
    """The loss is the stock I2V convention: frame 0 of x_t is the input image's latents (mask 1) and
    only frames 1.. are trained. Cached latents and on-the-fly encoding (vae_cache_disable) agree."""
    clips = make_clips(tmp_path / "clips", count=2, frames=9)
    run = build_run(load_config(video_run_config(tmp_path, clips, flavour="tiny-random-i2v",
                                                 vae_cache_disable=on_the_fly)))
    assert run.first_frame
    batch = next(iter(run.data))
    state = run.generator.get_state()
    loss = micro_step(run, batch)
    run.generator.set_state(state)
    x0 = batch.latents
    noise = torch.randn(x0.shape, generator=run.generator)
    from difftune.train import objective

    sigmas = objective.sample_sigmas(x0.shape[0], run.cfg.flow_schedule_shift, run.generator, run.sampling)
    x_t = objective.noisy_input(x0, noise, sigmas)
    calls = []
    forward = run.transformer.forward

    def spy(hidden_states, **kw):
        calls.append(hidden_states.detach().clone())
        return forward(hidden_states=hidden_states, **kw)

    run.transformer.forward = spy
    assert batch.conditioning.shape == (*x0.shape[:2], 1, *x0.shape[3:])
    pred = run.family.predict(run.transformer, x_t, sigmas, batch.text, batch.conditioning)
    channels = x0.shape[1]
    seen = calls[0]
    torch.testing.assert_close(seen[:, 0, ..., :channels], batch.conditioning[:, :, 0].permute(0, 2, 3, 1))
    assert torch.all(seen[:, 0, ..., -1] == 1) and torch.all(seen[:, 1:, ..., -1] == 0)  # the mask
    assert torch.all(seen[..., channels:-1] == 0)  # the visual_cond channels stay zero, as in the pipeline
    expected = objective.flow_loss(pred[:, :, 1:], objective.velocity_target(x0, noise)[:, :, 1:])
    torch.testing.assert_close(loss, expected)


def test_i2v_validates_with_an_image_dataset(tmp_path, dataset):
    clips = make_clips(tmp_path / "clips", count=2, frames=9)
    path = video_run_config(tmp_path, clips, flavour="tiny-random-i2v", max_train_steps=1,
                            validation_prompt="a square", validation_resolution="32x32",
                            validation_num_video_frames=17, validation_num_inference_steps=1,
                            validation_using_datasets=True, eval_dataset_id="stills")
    backend = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    backend.append({"id": "stills", "dataset_type": "image", "instance_data_dir": str(dataset)})
    (tmp_path / "config" / "multidatabackend.json").write_text(json.dumps(backend))
    run = build_run(load_config(path))
    first = Image.open(sorted(dataset.glob("*.png"))[0]).convert("RGB")
    expected = fit(first, (32, 32), "center", (0.5, 0.5))  # covered and center-cropped, not stretched
    assert np.array_equal(np.asarray(run.validation[0].image), np.asarray(expected))
    assert {c.sample.dataset_id for c in run.data.items} == {"train"}  # the stills are not trained on
    assert run.validation[0].frames == 17


def test_offload_during_startup_orders_devices(tmp_path, monkeypatch):
    """Where each model is moved, in order: the text encoders and the VAE never at the same time, and the
    transformer only after the caches with offload_during_startup (before them without)."""
    moves = []
    original = torch.nn.Module.to

    def spy(self, *args, **kwargs):
        name = type(self).__name__
        if name in ("Kandinsky5Transformer3DModel", "AutoencoderKLHunyuanVideo", "Qwen2_5_VLForConditionalGeneration",
                    "CLIPTextModel"):
            moves.append(name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", spy)
    clips = make_clips(tmp_path / "clips", count=1, frames=9)
    build_run(load_config(video_run_config(tmp_path, clips, offload_during_startup=True)))
    text = moves.index("Qwen2_5_VLForConditionalGeneration")
    assert moves.index("AutoencoderKLHunyuanVideo") > text
    assert moves.index("Kandinsky5Transformer3DModel") > moves.index("AutoencoderKLHunyuanVideo")
    moves.clear()
    build_run(load_config(video_run_config(tmp_path / "eager", clips, offload_during_startup=False)))
    assert moves.index("Kandinsky5Transformer3DModel") < moves.index("Qwen2_5_VLForConditionalGeneration")


def test_t2v_trains_on_images_as_one_frame_clips(tmp_path, dataset):
    clips = make_clips(tmp_path / "clips", count=2, frames=9)
    path = video_run_config(tmp_path, clips, max_train_steps=4)
    backend = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    backend.append({"id": "stills", "dataset_type": "image", "instance_data_dir": str(dataset), "resolution": 32,
                    "cache_dir_vae": str(tmp_path / "cache" / "stills")})
    (tmp_path / "config" / "multidatabackend.json").write_text(json.dumps(backend))
    run = build_run(load_config(path))
    still = next(c for c in run.data.items if c.sample.dataset_id == "stills")
    assert load_file(still.latent_file)["latents"].shape[1] == 1  # [C, 1, h, w]
    train(run)
    losses = [json.loads(line)["loss"] for line in (run.output_dir / "events.jsonl").open()
              if json.loads(line)["event"] == "step"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
