"""The tiny Kandinsky 5 image pipelines: hub layout, stock from_pretrained + generation, tokenizer round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import Kandinsky5I2IPipeline, Kandinsky5T2IPipeline
from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Modulation
from PIL import Image
from transformers import CLIPTokenizer, Qwen2VLProcessor
from transformers.utils import is_torchvision_available

from difftune.models.tiny_kandinsky5 import (
    QWEN_SPECIAL_TOKENS,
    ImageOnlyQwen2VLProcessor,
    build_tiny_kandinsky5_image,
    load_qwen_processor,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-kandinsky5")
    for name in ("t2i", "i2i"):
        build_tiny_kandinsky5_image(root / name, i2i=name == "i2i")
    return {"t2i": root / "t2i", "i2i": root / "i2i"}


def load(folder: Path, pipeline_class):
    # The only override: without torchvision the stock Qwen2VLProcessor cannot be loaded (see the module).
    pipe = pipeline_class.from_pretrained(folder, tokenizer=load_qwen_processor(folder))
    pipe.set_progress_bar_config(disable=True)
    pipe.resolutions = [(64, 64)]  # the pipelines snap any other size to their 1K buckets
    return pipe


def test_hub_layout(folders):
    for name, pipeline_class in (("t2i", Kandinsky5T2IPipeline), ("i2i", Kandinsky5I2IPipeline)):
        index = json.loads((folders[name] / "model_index.json").read_text())
        assert index["_class_name"] == pipeline_class.__name__
        assert {k: v for k, v in index.items() if not k.startswith("_")} == {
            "transformer": ["diffusers", "Kandinsky5Transformer3DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
            "tokenizer": ["transformers", "Qwen2VLProcessor"],
            "text_encoder_2": ["transformers", "CLIPTextModel"],
            "tokenizer_2": ["transformers", "CLIPTokenizer"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        }
        processor = json.loads((folders[name] / "tokenizer" / "processor_config.json").read_text())
        assert processor["processor_class"] == "Qwen2VLProcessor"
        assert processor["image_processor"]["image_processor_type"] == "Qwen2VLImageProcessor"
        assert processor["video_processor"]["video_processor_type"] == "Qwen2VLVideoProcessor"
        scheduler = json.loads((folders[name] / "scheduler" / "scheduler_config.json").read_text())
        assert scheduler["shift"] == 5.0 and not scheduler["use_dynamic_shifting"]
    transformer = json.loads((folders["i2i"] / "transformer" / "config.json").read_text())
    assert transformer["visual_cond"] and transformer["in_visual_dim"] == 16


def test_build_is_deterministic(folders, tmp_path):
    build_tiny_kandinsky5_image(tmp_path / "again", i2i=False)
    for path in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                 "tokenizer/tokenizer.json", "tokenizer/processor_config.json", "vae/config.json"):
        assert (tmp_path / "again" / path).read_bytes() == (folders["t2i"] / path).read_bytes(), path


def test_t2i_generates(folders):
    pipe = load(folders["t2i"], Kandinsky5T2IPipeline)
    # Every template word is one token, so the system prefix is exactly the pipeline's slice offset.
    prefix = pipe.prompt_template.split("{}")[0]
    assert len(pipe.tokenizer(text=[prefix])["input_ids"][0]) == pipe.prompt_template_encode_start_idx
    out = pipe(prompt="a red square", height=64, width=64, num_inference_steps=2, guidance_scale=3.5,
               generator=torch.Generator().manual_seed(0))
    assert out.image[0].size == (64, 64)


def test_i2i_generates_with_image_tokens(folders):
    pipe = load(folders["i2i"], Kandinsky5I2IPipeline)
    assert pipe.transformer.visual_embeddings.in_layer.in_features == 4 * (2 * 16 + 1)  # noise, image, mask
    image = Image.effect_noise((64, 64), 64).convert("RGB")
    inputs = pipe.tokenizer(text=[pipe.prompt_template.format("a cat")], images=[image.resize((32, 32))],
                            return_tensors="pt")
    assert (inputs["input_ids"] == pipe.tokenizer.image_token_id).sum() > 0 and "pixel_values" in inputs
    out = pipe(image=image, prompt="make it blue", num_inference_steps=2, guidance_scale=3.5,
               generator=torch.Generator().manual_seed(0))
    assert out.image[0].size == (64, 64)


def test_modulations_pass_gradients(folders):
    """diffusers zero-initialises the modulations; ours are not, so attention weights get gradients."""
    pipe = load(folders["t2i"], Kandinsky5T2IPipeline)
    net = pipe.transformer
    assert all(m.out_layer.weight.abs().sum() > 0 for m in net.modules() if isinstance(m, Kandinsky5Modulation))
    out = net(
        hidden_states=torch.randn(1, 1, 8, 8, 16), encoder_hidden_states=torch.randn(1, 5, 32),
        timestep=torch.tensor([500.0]), pooled_projections=torch.randn(1, 32),
        visual_rope_pos=[torch.arange(1), torch.arange(4), torch.arange(4)], text_rope_pos=torch.arange(5),
    ).sample
    out.square().mean().backward()
    for block in (net.text_transformer_blocks[0], net.visual_transformer_blocks[0]):
        assert block.self_attention.to_query.weight.grad.abs().sum() > 0


def test_tokenizers_round_trip(folders, tmp_path):
    processor = load_qwen_processor(folders["t2i"])
    expected = ImageOnlyQwen2VLProcessor if not is_torchvision_available() else Qwen2VLProcessor
    assert type(processor) is expected
    text = "<|im_start|>user\nA red square, ünïcode ✓<|vision_start|><|image_pad|><|vision_end|><|im_end|>"
    ids = processor.tokenizer(text)["input_ids"]
    processor.save_pretrained(tmp_path / "qwen")
    reloaded = load_qwen_processor(tmp_path, subfolder="qwen")
    assert reloaded.tokenizer(text)["input_ids"] == ids
    assert reloaded.tokenizer.decode(ids) == text
    special = processor.tokenizer.convert_tokens_to_ids(QWEN_SPECIAL_TOKENS)
    assert special == reloaded.tokenizer.convert_tokens_to_ids(QWEN_SPECIAL_TOKENS)
    assert len(set(special)) == len(special) and min(special) > 255
    config = json.loads((folders["t2i"] / "text_encoder" / "config.json").read_text())
    assert config["image_token_id"] == processor.image_token_id == special[QWEN_SPECIAL_TOKENS.index("<|image_pad|>")]
    assert config["vision_start_token_id"] == special[QWEN_SPECIAL_TOKENS.index("<|vision_start|>")]

    clip = CLIPTokenizer.from_pretrained(folders["t2i"], subfolder="tokenizer_2")
    clip_ids = clip("A red square!", padding="max_length", max_length=77)["input_ids"]
    assert clip_ids[0] == clip.bos_token_id and clip.eos_token_id in clip_ids and len(clip_ids) == 77
    clip.save_pretrained(tmp_path / "clip")
    assert CLIPTokenizer.from_pretrained(tmp_path / "clip")("A red square!", padding="max_length",
                                                            max_length=77)["input_ids"] == clip_ids
