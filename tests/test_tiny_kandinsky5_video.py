"""The tiny Kandinsky 5 video pipelines: hub layout, 128-token prompt prefix, stock from_pretrained + generation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Kandinsky5I2VPipeline, Kandinsky5T2VPipeline
from PIL import Image

from difftune.models.tiny_kandinsky5 import load_qwen_processor
from difftune.models.tiny_kandinsky5_video import build_tiny_kandinsky5_video, video_prompt_prefix

PIPELINES = {"t2v": Kandinsky5T2VPipeline, "i2v": Kandinsky5I2VPipeline}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-kandinsky5-video")
    for name in PIPELINES:
        build_tiny_kandinsky5_video(root / name, i2v=name == "i2v")
    return {name: root / name for name in PIPELINES}


def load(folder: Path, pipeline_class):
    # The only override: without torchvision the stock Qwen2VLProcessor cannot be loaded (see tiny_kandinsky5).
    pipe = pipeline_class.from_pretrained(folder, tokenizer=load_qwen_processor(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_hub_layout(folders):
    for name, pipeline_class in PIPELINES.items():
        index = json.loads((folders[name] / "model_index.json").read_text())
        assert index["_class_name"] == pipeline_class.__name__
        assert {k: v for k, v in index.items() if not k.startswith("_")} == {
            "transformer": ["diffusers", "Kandinsky5Transformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLHunyuanVideo"],
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
            "tokenizer": ["transformers", "Qwen2VLProcessor"],
            "text_encoder_2": ["transformers", "CLIPTextModel"],
            "tokenizer_2": ["transformers", "CLIPTokenizer"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        }
        processor = json.loads((folders[name] / "tokenizer" / "processor_config.json").read_text())
        assert processor["processor_class"] == "Qwen2VLProcessor"
        assert processor["video_processor"]["video_processor_type"] == "Qwen2VLVideoProcessor"
        scheduler = json.loads((folders[name] / "scheduler" / "scheduler_config.json").read_text())
        assert scheduler["shift"] == 5.0 and not scheduler["use_dynamic_shifting"]
        transformer = json.loads((folders[name] / "transformer" / "config.json").read_text())
        # Both real video transformers have visual_cond (T2V feeds zero conditioning and mask).
        assert transformer["visual_cond"] and transformer["in_visual_dim"] == 16
        assert transformer["patch_size"] == [1, 2, 2] and transformer["attention_type"] == "regular"
        vae = json.loads((folders[name] / "vae" / "config.json").read_text())
        assert vae["latent_channels"] == 16 and vae["scaling_factor"] == 0.476986
        assert vae["spatial_compression_ratio"] == 8 and vae["temporal_compression_ratio"] == 4


def test_prompt_prefix_is_the_slice_offset(folders):
    prefix, offset = video_prompt_prefix()
    assert offset == 128
    for name, pipeline_class in PIPELINES.items():
        processor = load_qwen_processor(folders[name])
        pipe = pipeline_class(transformer=None, vae=None, text_encoder=None, tokenizer=processor,
                              text_encoder_2=None, tokenizer_2=None, scheduler=None)
        assert pipe.prompt_template.split("{}")[0] == prefix
        prefix_ids = processor(text=[prefix])["input_ids"][0]
        assert len(prefix_ids) == pipe.prompt_template_encode_start_idx == 128
        # The slice must cut exactly between the system prefix and the user text.
        full_ids = processor(text=[pipe.prompt_template.format("A cat walks, slowly.")])["input_ids"][0]
        assert full_ids[:128] == prefix_ids
        assert processor.tokenizer.decode(full_ids[128:]) == "A cat walks, slowly.<|im_end|>"


def test_build_is_deterministic(folders, tmp_path):
    build_tiny_kandinsky5_video(tmp_path / "again", i2v=False)
    for path in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                 "text_encoder/model.safetensors", "tokenizer/tokenizer.json", "vae/config.json"):
        assert (tmp_path / "again" / path).read_bytes() == (folders["t2v"] / path).read_bytes(), path


def test_t2v_generates(folders):
    pipe = load(folders["t2v"], Kandinsky5T2VPipeline)
    out = pipe(prompt="a red square", height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=3.5,
               output_type="np", generator=torch.Generator().manual_seed(0))
    assert out.frames.shape == (1, 5, 32, 32, 3) and np.isfinite(out.frames).all()


def test_i2v_generates(folders):
    pipe = load(folders["i2v"], Kandinsky5I2VPipeline)
    image = Image.effect_noise((32, 32), 64).convert("RGB")
    latents = pipe.prepare_latents(image=image, batch_size=1, num_channels_latents=16, height=32, width=32,
                                   num_frames=17, dtype=torch.float32, device=torch.device("cpu"),
                                   generator=torch.Generator().manual_seed(0))
    assert latents.shape == (1, 5, 4, 4, 2 * 16 + 1)
    assert (latents[:, 0, ..., -1] == 1).all() and (latents[:, 1:, ..., -1] == 0).all()  # first frame is the image
    # 17 frames, not 5: the pipeline's normalize_first_frame takes reference statistics from latent frames 4.., so
    # under 5 latent frames (17 video frames) it divides by an empty mean/std and returns NaN (diffusers 0.42).
    out = pipe(image=image, prompt="it moves", height=32, width=32, num_frames=17, num_inference_steps=2,
               guidance_scale=3.5, output_type="pil", generator=torch.Generator().manual_seed(0))
    frames = out.frames[0]
    assert len(frames) == 17 and frames[0].size == (32, 32)
