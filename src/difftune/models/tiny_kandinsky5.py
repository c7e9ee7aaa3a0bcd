"""Tiny random-init Kandinsky 5.0 image pipelines (T2I and I2I), built offline in the hub folder layout.

Components and model_index.json entries match the real `kandinskylab/Kandinsky-5.0-{T2I,I2I}-Lite-*-Diffusers`
repositories: Kandinsky5Transformer3DModel, a Flux-style AutoencoderKL (16 latent channels, 8x),
Qwen2_5_VLForConditionalGeneration + Qwen2VLProcessor, CLIPTextModel + CLIPTokenizer and
FlowMatchEulerDiscreteScheduler(shift=5.0).

Why `load_qwen_processor` exists: `Qwen2VLProcessor` always has a video processor, and the only video
processor transformers has for Qwen2-VL (`Qwen2VLVideoProcessor`) requires torchvision. Without torchvision
`Qwen2VLProcessor.from_pretrained` - which is how `Kandinsky5*Pipeline.from_pretrained(folder)` loads the
`tokenizer` component - raises ImportError ("Qwen2VLVideoProcessor requires the Torchvision library"), although
the pipelines never pass videos. No saved file can avoid that: diffusers calls the class named in
model_index.json, with no backend argument, and the video processor has no PIL backend.
`ImageOnlyQwen2VLProcessor` is the same processor minus the video processor; its image processor comes from
AutoImageProcessor, which picks the PIL backend (`Qwen2VLImageProcessorPil`) when torchvision is missing.
`load_qwen_processor` returns it (or the stock processor when torchvision is installed); pass it as
`tokenizer=` to `from_pretrained`. The tokenizer/ folder holds what a stock Qwen2VLProcessor saves
(video-only settings left at their defaults), so with torchvision the folder loads with plain `from_pretrained`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5I2IPipeline,
    Kandinsky5T2IPipeline,
    Kandinsky5Transformer3DModel,
)
from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Modulation
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils import is_torchvision_available

# Qwen2-VL's added tokens, in the real tokenizer's order (ids 151643.. there; right after the BPE vocab here).
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
QWEN_HIDDEN = 32
CLIP_HIDDEN = 32
LATENT_CHANNELS = 16  # the Flux VAE's; the transformer's in_visual_dim must equal it (I2I concatenates both)
# The real processor's defaults, except at most 64 merged image tokens (28x28 px each) to keep the tower cheap.
IMAGE_MIN_PIXELS = 56 * 56
IMAGE_MAX_PIXELS = 28 * 28 * 64


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without a video processor: ProcessorMixin derives a processor's parts from its
    __init__ signature, so dropping `video_processor` from it is all it takes. Text and images behave
    exactly as in Qwen2VLProcessor (which is what the Kandinsky 5 pipelines use)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_qwen_processor(path_or_repo: str | Path, subfolder: str = "tokenizer", **kwargs) -> Qwen2VLProcessor:
    """The pipelines' `tokenizer` component: the stock processor when torchvision is installed, otherwise the
    image-only one (image processor resolved by AutoImageProcessor, which picks the PIL backend)."""
    cls = Qwen2VLProcessor if is_torchvision_available() else ImageOnlyQwen2VLProcessor
    return cls.from_pretrained(str(path_or_repo), subfolder=subfolder, **kwargs)


def blank_pipeline(pipeline_class):
    """A pipeline instance without components: enough to read its prompt template and slice offset."""
    return pipeline_class(transformer=None, vae=None, text_encoder=None, tokenizer=None,
                          text_encoder_2=None, tokenizer_2=None, scheduler=None)


def qwen_tokenizer(templates: Sequence[str] | None = None, vocab_size: int = 4096) -> Qwen2Tokenizer:
    """A byte-level BPE Qwen2Tokenizer trained on prompt templates (by default the image pipelines'), so every
    template word is one token: the T2I system prefix is then 40 tokens, exactly `prompt_template_encode_start_idx`,
    as with the real tokenizer. A `vocab_size` below what the corpus can use stops the merges early, leaving the
    rarest words in pieces (the video builder uses that to hit its offset). Special tokens are added after the BPE
    vocab, in Qwen's order. Training is deterministic."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if templates is None:
        templates = [blank_pipeline(cls).prompt_template for cls in (Kandinsky5T2IPipeline, Kandinsky5I2IPipeline)]
    splitter = "|".join(re.escape(s) for s in QWEN_SPECIAL_TOKENS + ["{}"])
    corpus = [part for text in templates for part in re.split(splitter, text) if part]

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = Qwen2Tokenizer(vocab={"<|endoftext|>": 0}).backend_tokenizer.pre_tokenizer  # Qwen's split
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], model_max_length=131072
    )
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    return tokenizer


def clip_tokenizer() -> CLIPTokenizer:
    """A character-level CLIP BPE (byte-level alphabet, with and without the end-of-word suffix, no merges);
    start/end tokens last, as in the real vocab (49406, 49407)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[])


def qwen_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    ids = dict(zip(QWEN_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(QWEN_SPECIAL_TOKENS), strict=True))
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": (len(tokenizer) + 63) // 64 * 64, "hidden_size": QWEN_HIDDEN, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            # head_dim 16: the three M-RoPE sections (time, height, width) must add up to 16 / 2.
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 2, 4]},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2, "hidden_size": QWEN_HIDDEN, "intermediate_size": 64, "num_heads": 2,
            "out_hidden_size": QWEN_HIDDEN, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "window_size": 112, "fullatt_block_indexes": [1],
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def qwen_processor(tokenizer: Qwen2Tokenizer) -> ImageOnlyQwen2VLProcessor:
    """The `tokenizer` component to save (`save_hub_pipeline` then gives tokenizer/ the stock processor's files)."""
    return ImageOnlyQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS),
        tokenizer=tokenizer,
    )


def clip_text_encoder(tokenizer_2: CLIPTokenizer) -> CLIPTextModel:
    return CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer_2), hidden_size=CLIP_HIDDEN, intermediate_size=64, projection_dim=CLIP_HIDDEN,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
            # The pooled output is taken at the first eos token (eos id != 2 selects that rule).
            bos_token_id=tokenizer_2.bos_token_id, eos_token_id=tokenizer_2.eos_token_id, pad_token_id=1,
        )
    )


def tiny_transformer(visual_cond: bool) -> Kandinsky5Transformer3DModel:
    """The tiny Kandinsky5Transformer3DModel; `visual_cond` as the real I2I and all real video models have it."""
    transformer = Kandinsky5Transformer3DModel(
        in_visual_dim=LATENT_CHANNELS, out_visual_dim=LATENT_CHANNELS, in_text_dim=QWEN_HIDDEN,
        in_text_dim2=CLIP_HIDDEN, time_dim=32, patch_size=(1, 2, 2), model_dim=32, ff_dim=64,
        num_text_blocks=1, num_visual_blocks=4, axes_dims=(4, 6, 6),  # head_dim = sum(axes_dims) = 16
        # 4 visual blocks: the specs' TREAD route (start_layer_idx 2 to end_layer_idx -2) fits.
        # visual_cond: the visual input is [noise, conditioning latents, mask] = 2 * 16 + 1 channels.
        visual_cond=visual_cond, attention_type="regular",
    )
    # diffusers zero-initialises every modulation (shift/scale/gate), which zeroes each block's gates and
    # hence every gradient reaching attention/feed-forward LoRA. A trained model has gates of order one;
    # so does this one (bias std 1), or the adapter's effect would be scaled down to nothing.
    for module in transformer.modules():
        if isinstance(module, Kandinsky5Modulation):
            torch.nn.init.normal_(module.out_layer.weight, std=0.02)
            torch.nn.init.normal_(module.out_layer.bias, std=1.0)
    return transformer


def _hub_processor_files(tokenizer_dir: Path) -> None:
    """Make tokenizer/ exactly what a stock Qwen2VLProcessor (with torchvision) saves: the processor and the
    image processor under their canonical class names, plus the video processor section it would write."""
    config_path = tokenizer_dir / "processor_config.json"
    config = json.loads(config_path.read_text())
    image = config["image_processor"]
    image["image_processor_type"] = "Qwen2VLImageProcessor"  # resolved per machine: torchvision or PIL backend
    # Same sizes and normalisation as the images; video-only settings keep Qwen2VLVideoProcessor's defaults.
    video = {k: v for k, v in image.items() if k != "image_processor_type"}
    video["video_processor_type"] = "Qwen2VLVideoProcessor"
    config.update(video_processor=video, processor_class="Qwen2VLProcessor")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok_path = tokenizer_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_path.read_text())
    tok_config["processor_class"] = "Qwen2VLProcessor"
    tok_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")


def save_hub_pipeline(pipe, folder: Path) -> None:
    """save_pretrained, then the hub's names for the Qwen processor (see `_hub_processor_files`)."""
    folder = Path(folder)
    pipe.save_pretrained(folder)
    # diffusers records a component's own class; ours is the image-only subclass, the hub names the stock one.
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index["tokenizer"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _hub_processor_files(folder / "tokenizer")


def build_tiny_kandinsky5_image(folder: Path, i2i: bool) -> None:
    """Save a tiny random-init Kandinsky5T2IPipeline (or Kandinsky5I2IPipeline) into `folder`."""
    folder = Path(folder)
    torch.manual_seed(0)
    tokenizer = qwen_tokenizer()
    processor = qwen_processor(tokenizer)
    text_encoder = qwen_text_encoder(tokenizer)
    tokenizer_2 = clip_tokenizer()
    text_encoder_2 = clip_text_encoder(tokenizer_2)
    transformer = tiny_transformer(visual_cond=i2i)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
        latent_channels=LATENT_CHANNELS, norm_num_groups=4, sample_size=64, force_upcast=True,
        scaling_factor=0.3611, shift_factor=0.1159,  # Flux values; the pipelines only use scaling_factor
        use_quant_conv=False, use_post_quant_conv=False,
    )
    # As the real repositories: static shift 5, no dynamic shifting.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0, use_dynamic_shifting=False)
    pipeline_class = Kandinsky5I2IPipeline if i2i else Kandinsky5T2IPipeline
    pipe = pipeline_class(
        transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=processor,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, scheduler=scheduler,
    )
    save_hub_pipeline(pipe, folder)
