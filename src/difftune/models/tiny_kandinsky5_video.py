"""Tiny random-init Kandinsky 5.0 video pipelines (T2V and I2V), built offline in the hub folder layout.

Components and model_index.json entries match the real `kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers` and
`kandinskylab/Kandinsky-5.0-I2V-Pro-sft-5s-Diffusers` repositories: Kandinsky5Transformer3DModel (`visual_cond` on
in both, as in every real video model: T2V feeds zero conditioning and a zero mask), AutoencoderKLHunyuanVideo
(16 latent channels, 8x spatial, 4x temporal), Qwen2_5_VLForConditionalGeneration + Qwen2VLProcessor,
CLIPTextModel + CLIPTokenizer and FlowMatchEulerDiscreteScheduler(shift=5.0, the 5s models' value).

Everything but the VAE and the Qwen tokenizer comes from `tiny_kandinsky5` (same tiny sizes, same modulation
init); without torchvision, load the `tokenizer` component with `load_qwen_processor` as explained there.

The Qwen tokenizer: the video pipelines drop the first `prompt_template_encode_start_idx` = 128 hidden states,
which with the real tokenizer are exactly the system prompt plus "<|im_start|>user\\n". A BPE trained on the
video template with all merges makes every word one token and gives 125; the real tokenizer splits a few rare
words ("scren", ...). `video_qwen_tokenizer` does the same by stopping the merges just early enough: the rarest
(frequency one) merges are left out, so 3 words stay in two pieces and the prefix is exactly 128 tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5I2VPipeline,
    Kandinsky5T2VPipeline,
)
from transformers import Qwen2Tokenizer

from difftune.models.tiny_kandinsky5 import (
    LATENT_CHANNELS,
        blank_pipeline,
    clip_text_encoder,
    clip_tokenizer,
    qwen_processor,
    qwen_text_encoder,
    qwen_tokenizer,
    save_hub_pipeline,
    tiny_transformer,
)

# The real HunyuanVideo VAE's latent scale (its config and the Kandinsky video repositories' vae/ use it).
HUNYUAN_VAE_SCALING_FACTOR = 0.476986


def video_prompt_prefix() -> tuple[str, int]:
    """The video template's text before the user prompt, and the pipelines' slice offset (128)."""
    t2v, i2v = blank_pipeline(Kandinsky5T2VPipeline), blank_pipeline(Kandinsky5I2VPipeline)
    # One tokenizer serves both builders only while the two pipelines share the template; fail loudly otherwise.
    if (t2v.prompt_template, t2v.prompt_template_encode_start_idx) != (
        i2v.prompt_template, i2v.prompt_template_encode_start_idx
    ):
        raise RuntimeError("Kandinsky5T2VPipeline and Kandinsky5I2VPipeline no longer share their prompt template")
    return t2v.prompt_template.split("{}")[0], t2v.prompt_template_encode_start_idx


def video_qwen_tokenizer() -> Qwen2Tokenizer:
    """`qwen_tokenizer` trained on the video template, with the vocab size for which the template's prefix is
    exactly `prompt_template_encode_start_idx` tokens. Each merge left out adds at least one token to the
    prefix (the whole corpus is the prefix), so the answer lies within `missing` sizes below the full vocab."""
    prefix, target = video_prompt_prefix()
    template = blank_pipeline(Kandinsky5T2VPipeline).prompt_template

    def prefix_length(tokenizer: Qwen2Tokenizer) -> int:
        return len(tokenizer(prefix)["input_ids"])

    tokenizer = qwen_tokenizer(templates=[template])
    missing = target - prefix_length(tokenizer)
    if missing < 0:
        raise RuntimeError(f"the video prompt prefix is {-missing} tokens longer than {target} even fully merged")
    full_vocab = len(tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False))
    for vocab_size in range(full_vocab, full_vocab - missing - 1, -1):
        candidate = qwen_tokenizer(templates=[template], vocab_size=vocab_size)
        if prefix_length(candidate) == target:
            return candidate
    # Only if a merge that must go to reach the target is used more than once in the prefix (jumps past it).
    raise RuntimeError(f"no vocab size gives a {target}-token video prompt prefix")


def tiny_hunyuan_vae() -> AutoencoderKLHunyuanVideo:
    """AutoencoderKLHunyuanVideo with the real block layout and compression (8x spatial via three spatial
    downsamples, 4x temporal via two causal time downsamples, mid-block attention) but 8-16 channels."""
    return AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1,
        norm_num_groups=4,  # must divide every block's channels (GroupNorm)
        scaling_factor=HUNYUAN_VAE_SCALING_FACTOR, spatial_compression_ratio=8, temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )


def build_tiny_kandinsky5_video(folder: Path, i2v: bool) -> None:
    """Save a tiny random-init Kandinsky5T2VPipeline (or Kandinsky5I2VPipeline) into `folder`."""
    folder = Path(folder)
    torch.manual_seed(0)
    tokenizer = video_qwen_tokenizer()
    processor = qwen_processor(tokenizer)
    text_encoder = qwen_text_encoder(tokenizer)
    tokenizer_2 = clip_tokenizer()
    text_encoder_2 = clip_text_encoder(tokenizer_2)
    # Both real video transformers take [noise, conditioning latents, mask]; T2V passes zeros for the last two.
    transformer = tiny_transformer(visual_cond=True)
    vae = tiny_hunyuan_vae()
    # As the real 5s repositories: static shift 5, no dynamic shifting.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0, use_dynamic_shifting=False)
    pipeline_class = Kandinsky5I2VPipeline if i2v else Kandinsky5T2VPipeline
    pipe = pipeline_class(
        transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=processor,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, scheduler=scheduler,
    )
    save_hub_pipeline(pipe, folder)
