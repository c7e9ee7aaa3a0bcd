"""The model-family interface: a few facts and functions per family.

A family speaks one canonical flow convention to the rest of difftune:
    x_t = (1 - s) * x0 + s * noise,   s in [0, 1] (s = 1 is pure noise),
    target = noise - x0  (the velocity the sampler integrates from s = 1 to s = 0).
Each family translates to its own network's convention inside `predict`.

This module stays import-light (no torch at import time) so that `models.registry` and the config
schema can be imported without loading the heavy stack.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from difftune.models.sources import ModelSource

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from difftune.models.flops import Flops
    from difftune.models.registry import FamilyFacts


@dataclass
class Components:
    """What `Family.load` returns. `text` holds the text encoders and tokenizers by their pipeline
    component names; it is emptied once the caches are complete, and `vae` becomes None (or stays on
    the CPU for validation)."""

    source: str
    transformer: Any
    vae: Any
    scheduler: Any
    text: dict[str, Any]
    pipeline: str = ""  # the model_index.json pipeline class, where a family needs it to tell flavours apart
    # tokenizer_max_length: the max_sequence_length prompts are encoded and sampled at; None: the pipeline's default
    text_length: int | None = None
    # where each part came from (config/model_source_keys.py); None: everything from `source`
    sources: ModelSource | None = None

    def text_modules(self) -> list[Any]:
        return [m for m in self.text.values() if hasattr(m, "parameters")]

    def origin(self) -> ModelSource:
        return self.sources or ModelSource(self.source)


@dataclass(frozen=True)
class SampleRequest:
    """One validation sample. `text`/`negative` are cached text conditions (see `encode_text`)."""

    text: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    image: Image.Image | None = None  # input image of image-to-image flavours
    name: str | None = None  # library prompt name; None for the main validation_prompt
    frames: int = 0  # video families: frames of the validation video (4k+1)
    fps: float = 0.0  # video families: frame rate the video is written at
    prompt: str = ""  # the prompt's text (CLIP evaluation scores the sample against it); "" for unconditional
    noise_on_cpu: bool = False  # validation_seed_source 'cpu': the noise is drawn by a CPU generator

    def generator(self, device: torch.device) -> torch.Generator:
        """The seeded generator of the sample's noise: on `device`, or on the CPU (validation_seed_source 'cpu';
        diffusers draws the latents there and moves them)."""
        import torch

        return torch.Generator(device="cpu" if self.noise_on_cpu else device).manual_seed(self.seed)


class Family(Protocol):
    facts: FamilyFacts
    lora_target_modules: tuple[str, ...] | str  # module-name suffixes, or a regex (peft target_modules)
    tread_layout: str  # where TREAD finds the blocks and the routable tokens: 'joint' or 'visual' (train/tread.py)

    def build_tiny(self, folder: Path, flavour: str) -> None:
        """Write a tiny random-init model of a tiny flavour in the hub folder layout (deterministic)."""

    def load(self, source: str | ModelSource, dtype: torch.dtype, vae_dtype: torch.dtype | None = None) -> Components:
        """Load every component with diffusers/transformers `from_pretrained` (hub id or folder), in `dtype`; the
        VAE in `vae_dtype` when given (models/vae_dtype.py). A `ModelSource` (models/sources.py) may take the
        transformer and the VAE from elsewhere, and sets the hub revision and weight variant."""

    def takes_conditioning(self, comps: Components) -> bool:
        """Whether the loaded model is conditioned on an input image (image-to-image: paired input-image
        latents; image-to-video: the first frame of each clip)."""

    def identity(self, comps: Components) -> dict[str, Any]:
        """What makes cached latents / embeddings of this model distinct: {'vae': ..., 'text': ...}."""

    def text_length_limit(self, comps: Components) -> int:
        """The longest prompt (tokens, the pipeline's max_sequence_length) the loaded model and its pipeline take."""

    def encode_text(
        self, comps: Components, prompts: list[str], negative: bool = False,
        images: list[Image.Image] | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """One dict of CPU tensors per prompt, without padding (variable length). `negative`: encode as
        the pipeline encodes negative prompts (some families treat them differently). `images`: the
        input image of each prompt, for image-to-image flavours whose text encoder sees it."""

    def collate_text(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stack per-prompt dicts into one batch dict (padding as the network expects)."""

    def encode_images(self, comps: Components, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] -> normalized latents [B, C, H/8, W/8] (the network's input space).
        Video families: [B, 3, F, H, W] -> [B, C, T, h, w] (images become one-frame clips)."""

    def predict(
        self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, torch.Tensor],
        conditioning: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Canonical velocity prediction (noise - x0) [B, C, h, w] for x_t [B, C, h, w] at noise level
        `sigmas` [B]. `conditioning`: latents [B, C, h, w] of the input images (image-to-image).
        Video families: [B, C, T, h, w]; `conditioning` is the input image's latents [B, C, 1, h, w]
        (image-to-video), which replace frame 0 of x_t as the pipeline does."""

    def auto_shift(self, comps: Components, latent_shape: tuple[int, ...]) -> float:
        """The timestep shift for latents of this shape (after the channel axis: (h, w) or (T, h, w))."""

    def sample(self, comps: Components, transformer: Any, request: SampleRequest) -> Image.Image | list[Image.Image]:
        """One image (video families: the frames of one video) through the family's stock diffusers pipeline."""

    def forward_flops(
        self, config: Mapping[str, Any], latent_shape: Sequence[int], text_tokens: int, routes: Sequence[Any] = (),
        first_frame: bool = False,
    ) -> Flops:
        """Model FLOPs of one forward of the transformer with diffusers `config` on latents of `latent_shape` (the
        batch's, [B, C, h, w] or [B, C, T, h, w]) and `text_tokens` padded text tokens, by kind (models/flops.py).
        `routes`: TREAD's resolved routes; `first_frame`: image-to-video (its first frame is never routed)."""

    def save_lora(self, folder: Path, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Path:
        """Write a LoRA (peft state dict of the transformer) in the pipeline's diffusers layout.
        `metadata` is the peft LoraConfig as a dict, so loaders recover rank and alpha."""
