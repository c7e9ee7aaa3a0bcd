"""Kandinsky 5.0 Video (T2V and I2V, Lite and Pro): Kandinsky5Transformer3DModel, HunyuanVideo VAE,
Qwen2.5-VL + CLIP. Text handling, the LoRA layout and the time convention are those of Kandinsky 5.0
Image (`kandinsky5_image`), which this family extends.

Conventions of the stock `Kandinsky5T2VPipeline` / `Kandinsky5I2VPipeline` that training follows:
- latents: `z * scaling_factor` of a clip of 4k+1 frames, k+1 latent frames; the network sees
  [B, T, h, w, C] followed by (the video transformers have `visual_cond`) 16 zero channels and a mask
  channel;
- I2V: the first latent frame is the input image encoded on its own, with mask 1; the sampler never
  updates it, so training puts the clip's first frame, encoded on its own the same way, in frame 0 of
  x_t and leaves frame 0 out of the loss. (Encoded within the clip it would differ: the VAE's GroupNorm
  takes its statistics over every frame.)
- RoPE is scaled by the pipeline's own `_get_scale_factor(height, width)`, and NABLA sparse attention
  (Pro 10s) gets the pipeline's own `get_sparse_params`, so training sees what sampling sees.
- Encoding is frame-window by frame-window (the VAE's framewise encoding, 16-frame windows) and spatially
  tiled above 256 px, with fixed windows: cached latents come out the same way every time, and the
  settings are part of the cache identity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5I2VPipeline,
    Kandinsky5T2VPipeline,
    Kandinsky5Transformer3DModel,
)
from PIL import Image

from difftune.models.base import Components, SampleRequest
from difftune.models.hub import model_index
from difftune.models.kandinsky5_image import Kandinsky5ImageFamily
from difftune.models.registry import FAMILY_FACTS, FamilyFacts
from difftune.models.sources import ModelSource, hub_kwargs, load_transformer
from difftune.models.tiny_kandinsky5_video import build_tiny_kandinsky5_video
from difftune.models.vae_dtype import load_vae
from difftune.train.objective import resolution_shift

# Fixed encode settings (the diffusers defaults, pinned so that a library update cannot change cached latents).
ENCODE_SETTINGS = {
    "framewise": True, "tile_frames": 16, "tile_frames_stride": 12,
    "tiling": True, "tile_size": 256, "tile_stride": 192, "slicing": True,
}
I2V_PIPELINE = "Kandinsky5I2VPipeline"


def configure_vae(vae: AutoencoderKLHunyuanVideo) -> None:
    s = ENCODE_SETTINGS
    vae.use_framewise_encoding = vae.use_framewise_decoding = s["framewise"]
    vae.enable_tiling(tile_sample_min_height=s["tile_size"], tile_sample_min_width=s["tile_size"],
                      tile_sample_min_num_frames=s["tile_frames"], tile_sample_stride_height=s["tile_stride"],
                      tile_sample_stride_width=s["tile_stride"], tile_sample_stride_num_frames=s["tile_frames_stride"])
    vae.use_slicing = s["slicing"]  # one clip at a time through the encoder: same latents, bounded memory


def _to_network(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, T, h, w] -> [B, T, h, w, C]."""
    return latents.permute(0, 2, 3, 4, 1)


class Kandinsky5VideoFamily(Kandinsky5ImageFamily):
    facts: FamilyFacts = FAMILY_FACTS["kandinsky5-video"]

    def build_tiny(self, folder: Path, flavour: str) -> None:
        build_tiny_kandinsky5_video(folder, i2v=self.facts.first_frame(flavour))

    def load(self, source: str | ModelSource, dtype: torch.dtype, vae_dtype: torch.dtype | None = None) -> Components:
        """Both video pipelines encode prompts from text alone: a plain Qwen tokenizer serves i2v too."""
        where = ModelSource.of(source)
        source = where.model
        index = model_index(source, where.revision)
        vae = load_vae(AutoencoderKLHunyuanVideo, where, dtype, vae_dtype)
        configure_vae(vae)
        return Components(
            source=source,
            transformer=load_transformer(Kandinsky5Transformer3DModel, where, dtype),  # from elsewhere too
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(
                source, subfolder="scheduler", **hub_kwargs(where, source, weights=False)),
            text=self.load_text(where, dtype, index),
            pipeline=index["_class_name"],
            sources=where,
        )

    def takes_conditioning(self, comps: Components) -> bool:
        """An image-to-video model: conditioned on the first frame of each clip."""
        return comps.pipeline == I2V_PIPELINE

    def identity(self, comps: Components) -> dict[str, Any]:
        ident = super().identity(comps)
        ident["vae"]["encode"] = ENCODE_SETTINGS
        return ident

    def pipeline_class(self, with_image: bool) -> type:
        return Kandinsky5I2VPipeline if with_image else Kandinsky5T2VPipeline

    def encode_text(
        self, comps: Components, prompts: list[str], negative: bool = False,
        images: list[Image.Image] | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """Both video pipelines encode prompts (and negative prompts) from text alone, with the video template."""
        return super().encode_text(comps, prompts, negative)

    def encode_images(self, comps: Components, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, F, H, W] clips (or [B, 3, H, W] images, as one-frame clips) -> [B, C, T, h, w]."""
        return super().encode_images(comps, pixels.unsqueeze(2) if pixels.dim() == 4 else pixels)

    def predict(
        self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor],
        conditioning: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`conditioning`: [B, C, 1, h, w] latents of the input image (image-to-video): the first frame."""
        hidden = _to_network(noisy)
        if conditioning is not None:
            hidden = torch.cat([_to_network(conditioning).to(hidden.dtype), hidden[:, 1:]], dim=1)
        if getattr(transformer, "module", transformer).config.visual_cond:
            mask = torch.zeros_like(hidden[..., :1])
            if conditioning is not None:
                mask[:, :1] = 1.0
            hidden = torch.cat([hidden, torch.zeros_like(hidden), mask], dim=-1)
        t, h, w = noisy.shape[-3:]
        device = noisy.device
        net = getattr(transformer, "module", transformer)  # several processes: the DDP wrapper has no config
        shell = Kandinsky5T2VPipeline(transformer=net, vae=None, text_encoder=None, tokenizer=None,
                                      text_encoder_2=None, tokenizer_2=None, scheduler=None)
        embeds = text["prompt_embeds"].to(device, noisy.dtype)
        out = transformer(
            hidden_states=hidden,
            encoder_hidden_states=embeds,
            pooled_projections=text["pooled"].to(device, noisy.dtype),
            timestep=(sigmas * 1000.0).to(noisy.dtype),
            visual_rope_pos=[torch.arange(t, device=device), torch.arange(h // 2, device=device),
                             torch.arange(w // 2, device=device)],
            text_rope_pos=torch.arange(embeds.shape[1], device=device),
            scale_factor=shell._get_scale_factor(h * shell.vae_scale_factor_spatial, w * shell.vae_scale_factor_spatial),
            sparse_params=shell.get_sparse_params(hidden, device),
            return_dict=True,
        ).sample
        return out.permute(0, 4, 1, 2, 3)

    def auto_shift(self, comps: Components, latent_shape: tuple[int, ...]) -> float:
        t, h, w = (1, *latent_shape) if len(latent_shape) == 2 else latent_shape[-3:]
        return resolution_shift(dict(comps.scheduler.config), t * (h // 2) * (w // 2))

    def sample(self, comps: Components, transformer: Any, request: SampleRequest) -> list[Image.Image]:
        """The frames of one validation video."""
        pipe, kwargs = self._pipeline_call(comps, transformer, request)
        with torch.no_grad():
            return pipe(num_frames=request.frames, output_type="pil", **kwargs).frames[0]


FAMILY = Kandinsky5VideoFamily()
