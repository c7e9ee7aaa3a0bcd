"""Kandinsky 5.0 Image (T2I and I2I Lite): Kandinsky5Transformer3DModel, Flux VAE, Qwen2.5-VL + CLIP.

Conventions of the stock `Kandinsky5T2IPipeline` / `Kandinsky5I2IPipeline` that training follows:
- text: the pipelines' own `encode_prompt` (Qwen2.5-VL last hidden state after the prompt template's
  prefix, plus CLIP's pooled output); for I2I the Qwen encoder also sees the input image;
- latents: `z * scaling_factor` (the pipelines ignore the VAE's shift_factor), channels-last with a
  time axis: the network sees [B, 1, h, w, C];
- I2I: the input image's latents and an all-ones mask channel are concatenated to the noisy latents
  (16 + 16 + 1 channels); only the first 16 are predicted;
- time: the network sees t = 1000 * s and predicts noise - x0, the canonical velocity itself.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5I2IPipeline,
    Kandinsky5T2IPipeline,
    Kandinsky5Transformer3DModel,
)
from PIL import Image
from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, Qwen2_5_VLForConditionalGeneration

from difftune.models.base import Components, SampleRequest
from difftune.models.flops import Flops, attention, matmul, routed_tokens
from difftune.models.hub import ComponentError, component_class, is_processor, load_component, model_index
from difftune.models.registry import FAMILY_FACTS, FamilyFacts
from difftune.models.sources import ModelSource, cache_origin, hub_kwargs, load_transformer, loading
from difftune.models.tiny_kandinsky5 import build_tiny_kandinsky5_image
from difftune.models.vae_dtype import load_vae
from difftune.train.objective import resolution_shift

# diffusers' Kandinsky 5 attention (video too) normalises query and key as `attn.query_norm(query.float())` with the
# RMSNorm weight in the model's dtype; on bf16 weights torch then says, once per process, that it "Cannot dispatch to
# fused implementation". The stock pipelines do the same, so the line is no news to the user: only it is filtered.
warnings.filterwarnings("ignore", message=r"Mismatch dtype between input and weight: input dtype = float, weight "
                        r"dtype = c10::BFloat16", category=UserWarning, module=r"torch\.nn\.functional")

# Self- and cross-attention projections only: not feed-forward, modulation or embedding layers.
ATTENTION_PROJECTIONS = r".*(self_attention|cross_attention)\.(to_query|to_key|to_value|out_layer)"


def _to_network(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, 1, h, w, C]."""
    return latents.permute(0, 2, 3, 1).unsqueeze(1)


def _seen(image: Image.Image | None) -> list[Image.Image] | None:
    """What the pipeline shows the Qwen encoder of an input image (I2I): the image at half its size."""
    return None if image is None else [image.resize((image.size[0] // 2, image.size[1] // 2))]


def _overflow(pipe: Any, prompt: str, image: Image.Image | None, length: int) -> int:
    """How many tokens the templated prompt (and its input image) is over `length`."""
    ids = pipe.tokenizer(text=[pipe.prompt_template.format(prompt)], images=_seen(image), return_tensors="pt")
    return ids["input_ids"].shape[-1] - (pipe.prompt_template_encode_start_idx + length)


def fit_prompt(pipe: Any, prompt: str, image: Image.Image, length: int) -> str:
    """An image-to-image prompt cut at its end so that it and its input image's tokens fit `length`: the I2I
    pipeline's own truncation cuts the image's tokens out, and the processor then raises."""
    text_tokenizer = getattr(pipe.tokenizer, "tokenizer", pipe.tokenizer)
    for _ in range(4):  # decoding and encoding again can merge tokens differently: check, and cut again
        over = _overflow(pipe, prompt, image, length)
        if over <= 0:
            return prompt
        tokens = text_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not tokens:
            break
        prompt = text_tokenizer.decode(tokens[: max(0, len(tokens) - over)])
    raise ValueError(f"the input image's tokens alone are over {length} tokens")


class Kandinsky5ImageFamily:
    facts: FamilyFacts = FAMILY_FACTS["kandinsky5-image"]
    lora_target_modules = ATTENTION_PROJECTIONS
    tread_layout = "visual"  # TREAD: the visual tokens are a stream of their own, text another (train/tread.py)

    def build_tiny(self, folder: Path, flavour: str) -> None:
        build_tiny_kandinsky5_image(folder, i2i=self.facts.needs_conditioning(flavour))

    def load(self, source: str | ModelSource, dtype: torch.dtype, vae_dtype: torch.dtype | None = None) -> Components:
        where = ModelSource.of(source)
        source = where.model
        transformer = load_transformer(Kandinsky5Transformer3DModel, where, dtype)  # from elsewhere too
        index = model_index(source, where.revision)
        if transformer.config.visual_cond and not is_processor(component_class(index, "tokenizer")):
            # Image-to-image: the Qwen encoder sees the input image, which only the processor can prepare.
            raise ComponentError(
                f"{source}: this image-to-image model's tokenizer/ is a plain tokenizer "
                f"({component_class(index, 'tokenizer')}), but its text encoder must see the input image: it needs "
                "the Qwen2-VL processor (Qwen2VLProcessor, with preprocessor_config.json) as the stock "
                "Kandinsky5I2IPipeline does; use the original repository's tokenizer/ folder")
        return Components(
            source=source,
            transformer=transformer,
            vae=load_vae(AutoencoderKL, where, dtype, vae_dtype),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(
                source, subfolder="scheduler", **hub_kwargs(where, source, weights=False)),
            text=self.load_text(where, dtype, index),
            sources=where,
        )

    @staticmethod
    def load_text(where: ModelSource, dtype: torch.dtype, index: dict[str, Any]) -> dict[str, Any]:
        """The text encoders and tokenizers of the main model by their pipeline component names, each of the class
        that model_index.json names (the Qwen `tokenizer` is a processor in some repositories, a plain
        tokenizer in others)."""
        source, weights, other = where.model, hub_kwargs(where, where.model), hub_kwargs(where, where.model, False)

        def encoder(name: str, fallback: type) -> Any:
            return loading(f"{source} ({name}/)", "pretrained_model_name_or_path", where,
                           lambda: load_component(source, name, index, fallback, dtype, **weights))

        return {
            "text_encoder": encoder("text_encoder", Qwen2_5_VLForConditionalGeneration),
            "tokenizer": load_component(source, "tokenizer", index, AutoTokenizer, **other),
            "text_encoder_2": encoder("text_encoder_2", CLIPTextModel),
            "tokenizer_2": load_component(source, "tokenizer_2", index, CLIPTokenizer, **other),
        }

    def takes_conditioning(self, comps: Components) -> bool:
        return bool(comps.transformer.config.visual_cond)

    def identity(self, comps: Components) -> dict[str, Any]:
        text = {name: m.config.to_dict() for name, m in comps.text.items() if hasattr(m, "config")}
        ident = {
            "vae": {**cache_origin(comps.origin(), "vae"), "config": dict(comps.vae.config),
                    "dtype": str(comps.vae.dtype)},
            "text": {**cache_origin(comps.origin(), "text"), "configs": text,
                     "dtype": str(comps.text["text_encoder"].dtype),
                     # captions are fitted one by one (fit_prompts): entries written before, by a batch that held
                     # a long caption, may be empty, so they are encoded again
                     "long_captions": "fitted"},
        }
        if comps.text_length is not None:  # only when set: caches made at the pipeline's default stay valid
            ident["text"]["max_sequence_length"] = comps.text_length
        return ident

    def text_length_limit(self, comps: Components) -> int:
        """The pipelines refuse more than 1024 tokens, and the transformer's text RoPE table has as many rows."""
        rope = comps.transformer.text_rope_embeddings.max_pos
        tokenizer = comps.text["tokenizer"]
        return min(self.facts.max_text_length, rope, getattr(tokenizer, "tokenizer", tokenizer).model_max_length)

    def encode_text(
        self, comps: Components, prompts: list[str], negative: bool = False,
        images: list[Image.Image] | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """Negative prompts are encoded like prompts in these pipelines (with the image, for I2I)."""
        encoder = comps.text["text_encoder"]
        device, dtype = encoder.device, encoder.dtype
        # Right padding keeps each prompt's states a prefix that does not depend on the batch (causal).
        tokenizer = comps.text["tokenizer"]
        getattr(tokenizer, "tokenizer", tokenizer).padding_side = "right"  # a processor holds its tokenizer
        pipe = self.pipeline_class(images is not None)(transformer=None, vae=None, scheduler=None, **comps.text)
        length = comps.text_length or inspect.signature(pipe.encode_prompt).parameters["max_sequence_length"].default
        # diffusers 0.42 cuts every prompt of a batch by what the longest is over its length (`_encode_prompt_qwen`),
        # which empties the others' embeddings (silently): a prompt over the length is encoded alone, where that cut
        # is the stock pipeline's own for that prompt; with an input image it is fitted first (fit_prompt)
        long = [_overflow(pipe, p, None if images is None else images[i], length) > 0 for i, p in enumerate(prompts)]
        short = [i for i, over in enumerate(long) if not over]
        groups = ([short] if short else []) + [[i] for i, over in enumerate(long) if over]
        out: dict[int, dict[str, torch.Tensor]] = {}
        for group in groups:
            texts = [prompts[i] for i in group]
            extra: dict[str, Any] = {}
            if comps.text_length is not None:  # tokenizer_max_length; else the pipeline's own default
                extra["max_sequence_length"] = comps.text_length
            try:
                if images is not None:
                    extra["image"] = [images[i] for i in group]
                    if long[group[0]]:
                        texts = [fit_prompt(pipe, texts[0], images[group[0]], length)]
                qwen, clip, cu_seqlens = pipe.encode_prompt(texts, device=device, dtype=dtype, **extra)
            except ValueError as e:  # the processor refuses a length that cuts into the input image's tokens
                if images is None or "image" not in str(e):
                    raise
                fix = (f"raise tokenizer_max_length or remove it (the pipeline's default is {self.facts.text_lengths[1]})"
                       if comps.text_length is not None else  # already the pipeline's most: only the image can shrink
                       "train (and validate: validation_resolution) at a smaller resolution, so that the input images "
                       "are smaller")
                raise ComponentError(
                    f"tokenizer_max_length {length} is too short for this image-to-image prompt: the Qwen encoder "
                    "sees the input image's tokens (one per 28x28 pixels of the image at half its size) within that "
                    f"length ({e}); {fix}") from e
            for row, (i, n) in enumerate(zip(group, cu_seqlens.diff().tolist(), strict=True)):
                out[i] = {"prompt_embeds": qwen[row, : int(n)].cpu().clone(), "pooled": clip[row].cpu().clone()}
        return [out[i] for i in range(len(prompts))]

    def collate_text(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """prompt_embeds [B, L, D] (zero-padded to the longest), pooled [B, D2], lengths [B].

        The network has no text mask: in a batch of unequal prompts the zero padding is attended.
        A batch of one (or of equal lengths) is exactly what the pipeline computes.
        """
        lengths = [item["prompt_embeds"].shape[0] for item in items]
        first = items[0]["prompt_embeds"]
        embeds = first.new_zeros(len(items), max(lengths), first.shape[1])
        for i, item in enumerate(items):
            embeds[i, : lengths[i]] = item["prompt_embeds"]
        pooled = torch.stack([item["pooled"] for item in items])
        return {"prompt_embeds": embeds, "pooled": pooled, "lengths": torch.tensor(lengths)}

    def encode_images(self, comps: Components, pixels: torch.Tensor) -> torch.Tensor:
        vae = comps.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        return latents * vae.config.scaling_factor

    def predict(
        self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor],
        conditioning: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = _to_network(noisy)
        if conditioning is not None:
            mask = torch.ones_like(hidden[..., :1])
            hidden = torch.cat([hidden, _to_network(conditioning), mask], dim=-1)
        h, w = noisy.shape[-2:]
        device = noisy.device
        embeds = text["prompt_embeds"].to(device, noisy.dtype)
        out = transformer(
            hidden_states=hidden,
            encoder_hidden_states=embeds,
            pooled_projections=text["pooled"].to(device, noisy.dtype),
            timestep=(sigmas * 1000.0).to(noisy.dtype),
            visual_rope_pos=[torch.arange(1, device=device), torch.arange(h // 2, device=device),
                             torch.arange(w // 2, device=device)],
            text_rope_pos=torch.arange(embeds.shape[1], device=device),
            scale_factor=[1.0, 1.0, 1.0],
            sparse_params=None,
            return_dict=True,
        ).sample
        return out.squeeze(1).permute(0, 3, 1, 2)

    def auto_shift(self, comps: Components, latent_shape: tuple[int, ...]) -> float:
        tokens = (latent_shape[-2] // 2) * (latent_shape[-1] // 2)  # 2x2 patches
        return resolution_shift(dict(comps.scheduler.config), tokens)

    def forward_flops(
        self, config: Mapping[str, Any], latent_shape: Sequence[int], text_tokens: int, routes: Sequence[Any] = (),
        first_frame: bool = False,
    ) -> Flops:
        """FLOPs of one forward of Kandinsky5Transformer3DModel (models/flops.py) for latents [B, C, h, w] (video:
        [B, C, T, h, w]) and `text_tokens` padded text tokens: the text blocks over the text, the visual blocks'
        self-attention over the visual tokens and their cross-attention from them to the text. NABLA sparse
        attention (Pro 10s) is counted dense. `first_frame`: image-to-video, whose first latent frame TREAD
        never routes."""
        batch = latent_shape[0]
        frames = latent_shape[2] if len(latent_shape) == 5 else 1
        pt, ph, pw = config["patch_size"]
        d, td, ff = config["model_dim"], config["time_dim"], config["ff_dim"]
        head_dim = sum(config["axes_dims"])
        heads = d // head_dim
        frame = (latent_shape[-2] // ph) * (latent_shape[-1] // pw)
        visual = (frames // pt) * frame
        in_dim = config["in_visual_dim"] * (2 if config["visual_cond"] else 1) + (1 if config["visual_cond"] else 0)
        patch = math.prod(config["patch_size"])
        text = batch * text_tokens
        f = Flops(tokens=batch * visual)
        f.inputs += matmul(text, config["in_text_dim"], d) + matmul(batch, config["in_text_dim2"], td)
        f.inputs += matmul(batch, d, td) + matmul(batch * visual, patch * in_dim, d)  # time; patch embedding
        f.conditioning += matmul(batch, td, td)  # time_embeddings.out_layer

        def self_attention_block(rows: int, seq: int) -> None:
            f.linear += 4 * matmul(batch * rows, d, d) + 2 * matmul(batch * rows, d, ff)  # q, k, v, out; FFN
            f.attention += attention(batch, heads, seq, seq, head_dim)

        for _ in range(config["num_text_blocks"]):
            f.conditioning += matmul(batch, td, 6 * d)
            self_attention_block(text_tokens, text_tokens)
        routed = []
        fixed = frame if first_frame else 0  # the input frame of image-to-video always stays
        for index in range(config["num_visual_blocks"]):
            tokens = visual - routed_tokens(routes, index, visual - fixed)
            f.conditioning += matmul(batch, td, 9 * d)
            self_attention_block(tokens, tokens)
            f.linear += 2 * matmul(batch * tokens, d, d) + 2 * matmul(text, d, d)  # cross: q, out; k, v
            f.attention += attention(batch, heads, tokens, text_tokens, head_dim)
            if tokens != visual:
                routed.append((rf"visual_transformer_blocks\.{index}\.", batch * tokens))
        f.conditioning += matmul(batch, td, 2 * d)  # out_layer.modulation
        f.linear += matmul(batch * visual, d, patch * config["out_visual_dim"])
        f.rows = [(r"modulation|time_embeddings|pooled_text_embeddings", batch),
                  (r"text_embeddings|text_transformer_blocks\.|cross_attention\.(to_key|to_value)", text),
                  *routed, (r"visual_transformer_blocks\.|visual_embeddings|out_layer", batch * visual)]
        return f

    def pipeline_class(self, with_image: bool) -> type:
        """The stock pipeline that encodes prompts and samples (with an input image, or from text alone)."""
        return Kandinsky5I2IPipeline if with_image else Kandinsky5T2IPipeline

    def sample(self, comps: Components, transformer: Any, request: SampleRequest) -> Image.Image:
        pipe, kwargs = self._pipeline_call(comps, transformer, request)
        size = (request.width, request.height)
        if size not in pipe.resolutions:
            # The pipelines snap other sizes to their seven 1K buckets; sample exactly what was asked.
            pipe.resolutions = [*pipe.resolutions, size]
        with torch.no_grad():
            return pipe(**kwargs).image[0]

    def _pipeline_call(self, comps: Components, transformer: Any, request: SampleRequest) -> tuple[Any, dict]:
        """The stock pipeline around `transformer` (no text encoders: the cached embeddings are passed), and
        the arguments of its call for `request`."""
        pipe = self.pipeline_class(request.image is not None)(
            transformer=transformer, vae=comps.vae, text_encoder=None, tokenizer=None, text_encoder_2=None,
            tokenizer_2=None, scheduler=FlowMatchEulerDiscreteScheduler.from_config(comps.scheduler.config),
        )
        pipe.set_progress_bar_config(disable=True)
        device = next(transformer.parameters()).device
        kwargs: dict[str, Any] = self._embeds("", request.text, device)
        if request.guidance > 1.0 and request.negative is not None:
            kwargs |= self._embeds("negative_", request.negative, device)
        if request.image is not None:
            kwargs["image"] = request.image
        if comps.text_length is not None:  # the prompts come as embeddings; the pipeline checks the length
            kwargs["max_sequence_length"] = comps.text_length
        kwargs |= {"height": request.height, "width": request.width, "num_inference_steps": request.steps,
                   "guidance_scale": request.guidance, "generator": request.generator(device)}
        return pipe, kwargs

    def _embeds(self, prefix: str, text: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
        n = text["prompt_embeds"].shape[0]
        return {
            f"{prefix}prompt_embeds_qwen": text["prompt_embeds"][None].to(device),
            f"{prefix}prompt_embeds_clip": text["pooled"][None].to(device),
            f"{prefix}prompt_cu_seqlens": torch.tensor([0, n], dtype=torch.int32, device=device),
        }

    def save_lora(self, folder: Path, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Path:
        self.pipeline_class(False).save_lora_weights(
            folder, transformer_lora_layers=state_dict, safe_serialization=True,
            transformer_lora_adapter_metadata=metadata,
        )
        return folder / "pytorch_lora_weights.safetensors"


FAMILY = Kandinsky5ImageFamily()
