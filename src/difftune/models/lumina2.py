"""Lumina2 (Lumina-Image-2.0): Lumina2Transformer2DModel, Flux-style AutoencoderKL, Gemma2 text encoder.

Conventions of the stock `Lumina2Pipeline` that training must follow:
- text: the pipeline's own `encode_prompt` (system prompt + " <Prompt Start> ", Gemma2 hidden state -2,
  right padding with an attention mask); we call it rather than re-implement it;
- latents: (z - shift_factor) * scaling_factor, 8x spatial compression, sides multiple of 16;
- time runs the other way round: the network sees t = 1 - s (t = 0 is noise), and predicts
  x0 - noise, which the pipeline negates before the Euler step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    Lumina2Pipeline,
    Lumina2Transformer2DModel,
)
from PIL import Image
from transformers import AutoTokenizer, Gemma2Config, Gemma2Model

from difftune.models.base import Components, SampleRequest
from difftune.models.flops import Flops, attention, matmul, routed_tokens
from difftune.models.hub import load_component, model_index
from difftune.models.registry import FAMILY_FACTS, FamilyFacts
from difftune.models.sources import ModelSource, cache_origin, hub_kwargs, load_transformer, loading
from difftune.models.tiny import gemma_tokenizer
from difftune.models.vae_dtype import load_vae
from difftune.train.objective import resolution_shift

MAX_SEQUENCE_LENGTH = FAMILY_FACTS["lumina2"].text_lengths[0]  # the pipeline's default (256)


def text_length(comps: Components) -> int:
    """The max_sequence_length prompts are encoded at (tokenizer_max_length, else the pipeline's default);
    validation pads to it, as the stock pipeline does."""
    return comps.text_length or MAX_SEQUENCE_LENGTH


class Lumina2Family:
    facts: FamilyFacts = FAMILY_FACTS["lumina2"]
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    tread_layout = "joint"  # TREAD: caption and image tokens share one sequence (train/tread.py)

    def build_tiny(self, folder: Path, flavour: str) -> None:
        torch.manual_seed(0)
        tokenizer = gemma_tokenizer()
        text_encoder = Gemma2Model(
            Gemma2Config(
                vocab_size=len(tokenizer.get_vocab()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                pad_token_id=0, eos_token_id=1, bos_token_id=2,
            )
        )
        transformer = Lumina2Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, hidden_size=48, num_layers=2, num_refiner_layers=1,
            num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(8, 8, 8),
            axes_lens=(300, 512, 512), cap_feat_dim=32,
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
            latent_channels=4, norm_num_groups=4, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
            use_quant_conv=False, use_post_quant_conv=False,
        )
        # Same scheduler settings as the real repository (static shift 6).
        scheduler = FlowMatchEulerDiscreteScheduler(shift=6.0, use_dynamic_shifting=False)
        pipe = Lumina2Pipeline(
            transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler
        )
        pipe.save_pretrained(folder)

    def load(self, source: str | ModelSource, dtype: torch.dtype, vae_dtype: torch.dtype | None = None) -> Components:
        where = ModelSource.of(source)
        main = where.model
        index = model_index(main, where.revision)
        return Components(
            source=main,
            transformer=load_transformer(Lumina2Transformer2DModel, where, dtype),  # elsewhere / one file too
            vae=load_vae(AutoencoderKL, where, dtype, vae_dtype),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(
                main, subfolder="scheduler", **hub_kwargs(where, main, weights=False)),
            text={  # of the classes model_index.json names, as the stock pipeline loads them
                "text_encoder": loading(f"{main} (text_encoder/)", "pretrained_model_name_or_path", where,
                                        lambda: load_component(main, "text_encoder", index, Gemma2Model, dtype,
                                                               **hub_kwargs(where, main))),
                "tokenizer": load_component(main, "tokenizer", index, AutoTokenizer,
                                            **hub_kwargs(where, main, weights=False)),
            },
            sources=where,
        )

    def takes_conditioning(self, comps: Components) -> bool:
        return False

    def identity(self, comps: Components) -> dict[str, Any]:
        return {
            "vae": {**cache_origin(comps.origin(), "vae"), "config": dict(comps.vae.config),
                    "dtype": str(comps.vae.dtype)},
            "text": {
                **cache_origin(comps.origin(), "text"),
                "config": comps.text["text_encoder"].config.to_dict(),
                "dtype": str(comps.text["text_encoder"].dtype),
                "max_sequence_length": text_length(comps),
            },
        }

    def text_length_limit(self, comps: Components) -> int:
        """The pipeline takes at most 512 tokens; the transformer's caption positions run along its first RoPE axis,
        whose table has axes_lens[0] entries, and the image tokens sit at the caption's length on it."""
        limit = min(FAMILY_FACTS["lumina2"].max_text_length, comps.transformer.config.axes_lens[0] - 1)
        return min(limit, comps.text["tokenizer"].model_max_length)

    def encode_text(
        self, comps: Components, prompts: list[str], negative: bool = False, images: list | None = None
    ) -> list[dict[str, torch.Tensor]]:
        if images is not None:
            raise ValueError("Lumina2 is text-to-image only: it takes no input images")
        encoder = Lumina2Pipeline(transformer=None, vae=None, scheduler=None, **comps.text)
        device = comps.text["text_encoder"].device
        if negative:
            # The pipeline encodes negative prompts without its system prompt: ask it for exactly that.
            _, _, embeds, mask = encoder.encode_prompt(
                [""] * len(prompts), do_classifier_free_guidance=True, negative_prompt=prompts, device=device,
                max_sequence_length=text_length(comps),
            )
        else:
            embeds, mask, _, _ = encoder.encode_prompt(
                prompts, do_classifier_free_guidance=False, device=device, max_sequence_length=text_length(comps)
            )
        lengths = mask.sum(dim=1).tolist()
        # Right padding: the valid tokens are a prefix. Gemma is causal, so they do not depend on padding.
        return [{"prompt_embeds": embeds[i, : int(n)].cpu().clone()} for i, n in enumerate(lengths)]

    def collate_text(self, items: list[dict[str, torch.Tensor]], length: int | None = None) -> dict[str, torch.Tensor]:
        """Right-pad to the longest prompt (or `length`): prompt_embeds [B, L, D], attention_mask [B, L]."""
        longest = length or max(item["prompt_embeds"].shape[0] for item in items)
        dim = items[0]["prompt_embeds"].shape[1]
        embeds = torch.zeros(len(items), longest, dim, dtype=items[0]["prompt_embeds"].dtype)
        mask = torch.zeros(len(items), longest, dtype=torch.long)
        for i, item in enumerate(items):
            n = item["prompt_embeds"].shape[0]
            embeds[i, :n] = item["prompt_embeds"]
            mask[i, :n] = 1
        return {"prompt_embeds": embeds, "attention_mask": mask}

    def encode_images(self, comps: Components, pixels: torch.Tensor) -> torch.Tensor:
        vae = comps.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

    def predict(
        self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor],
        conditioning: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = transformer(
            hidden_states=noisy,
            timestep=1.0 - sigmas,
            encoder_hidden_states=text["prompt_embeds"].to(noisy.device, noisy.dtype),
            encoder_attention_mask=text["attention_mask"].to(noisy.device),
            return_dict=False,
        )[0]
        return -out

    def auto_shift(self, comps: Components, latent_shape: tuple[int, ...]) -> float:
        tokens = (latent_shape[-2] // 2) * (latent_shape[-1] // 2)  # 2x2 patches
        return resolution_shift(dict(comps.scheduler.config), tokens)

    def sample(self, comps: Components, transformer: Any, request: SampleRequest) -> Image.Image:
        pipe = Lumina2Pipeline(
            transformer=transformer, vae=comps.vae, text_encoder=None, tokenizer=None,
            scheduler=FlowMatchEulerDiscreteScheduler.from_config(comps.scheduler.config),
        )
        pipe.set_progress_bar_config(disable=True)
        device = next(transformer.parameters()).device
        dtype = transformer.dtype  # the first floating parameter (a 4-bit layer holds packed uint8)
        length = text_length(comps)
        cond = self.collate_text([request.text], length)
        kwargs: dict[str, Any] = {}
        if request.guidance > 1.0 and request.negative is not None:
            neg = self.collate_text([request.negative], length)
            kwargs = {
                "negative_prompt_embeds": neg["prompt_embeds"].to(device, dtype),
                "negative_prompt_attention_mask": neg["attention_mask"].to(device),
            }
        generator = request.generator(device)
        with torch.no_grad():
            return pipe(
                prompt_embeds=cond["prompt_embeds"].to(device, dtype),
                prompt_attention_mask=cond["attention_mask"].to(device),
                height=request.height, width=request.width, num_inference_steps=request.steps,
                guidance_scale=request.guidance, generator=generator, max_sequence_length=length, **kwargs,
            ).images[0]

    def forward_flops(
        self, config: Mapping[str, Any], latent_shape: Sequence[int], text_tokens: int, routes: Sequence[Any] = (),
        first_frame: bool = False, longest_caption: int | None = None,
    ) -> Flops:
        """FLOPs of one forward of Lumina2Transformer2DModel (models/flops.py) for latents [B, C, H, W] and
        captions padded to `text_tokens`. The context refiner runs over the padded captions; the joint blocks
        over the longest caption + the image tokens (training pads to the longest caption, so that is
        `text_tokens` unless `longest_caption` says otherwise). Masked positions are computed all the same."""
        batch, channels, height, width = latent_shape[0], latent_shape[1], latent_shape[-2], latent_shape[-1]
        p, d = config["patch_size"], config["hidden_size"]
        heads, kv_heads = config["num_attention_heads"], config.get("num_kv_heads") or config["num_attention_heads"]
        head_dim, temb = d // heads, min(d, 1024)
        inner = 4 * d  # LuminaFeedForward: 4·dim, times ffn_dim_multiplier, rounded up to multiple_of
        if config.get("ffn_dim_multiplier") is not None:
            inner = int(config["ffn_dim_multiplier"] * inner)
        multiple = config["multiple_of"]
        inner = multiple * ((inner + multiple - 1) // multiple)
        image = (height // p) * (width // p)
        joint = (longest_caption or text_tokens) + image
        out_channels = config.get("out_channels") or channels
        f = Flops(tokens=batch * image)
        f.inputs += matmul(batch, 256, temb) + matmul(batch * image, p * p * channels, d)  # time, patch embedding
        f.conditioning += matmul(batch, temb, temb) + matmul(batch * text_tokens, config["cap_feat_dim"], d)

        def block(seq: int, modulation: bool) -> None:
            rows = batch * seq
            f.linear += 2 * matmul(rows, d, d) + 2 * matmul(rows, d, kv_heads * head_dim)  # q, out; k, v
            f.linear += 3 * matmul(rows, d, inner)  # SwiGLU: linear_1, linear_3, linear_2
            f.attention += attention(batch, heads, seq, seq, head_dim)
            if modulation:
                f.conditioning += matmul(batch, temb, 4 * d)  # LuminaRMSNormZero

        for _ in range(config["num_refiner_layers"]):
            block(text_tokens, modulation=False)  # context refiner
            block(image, modulation=True)  # noise refiner
        routed = []
        for index in range(config["num_layers"]):
            dropped = routed_tokens(routes, index, image)  # TREAD routes only image tokens
            block(joint - dropped, modulation=True)
            if dropped:
                routed.append((rf"(^|\.)layers\.{index}\.", batch * (joint - dropped)))
        f.conditioning += matmul(batch, temb, d)  # norm_out.linear_1
        f.linear += matmul(batch * joint, d, p * p * out_channels)  # norm_out.linear_2
        f.rows = [(r"norm1\.linear|norm_out\.linear_1|timestep_embedder", batch),
                  (r"caption_embedder|context_refiner\.", batch * text_tokens),
                  (r"noise_refiner\.|x_embedder", batch * image), *routed,
                  (r"(^|\.)layers\.|norm_out", batch * joint)]
        return f

    def save_lora(self, folder: Path, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Path:
        Lumina2Pipeline.save_lora_weights(
            folder, transformer_lora_layers=state_dict, safe_serialization=True,
            transformer_lora_adapter_metadata=metadata,
        )
        return folder / "pytorch_lora_weights.safetensors"


FAMILY = Lumina2Family()
