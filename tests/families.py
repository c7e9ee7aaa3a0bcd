"""Per-family facts the conformance tests need: the stock pipeline class, how to call it, and what
a perfect network outputs in the family's own convention (the oracle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import Kandinsky5I2IPipeline, Kandinsky5T2IPipeline, Lumina2Pipeline
from PIL import Image, ImageOps

from difftune.models.tiny_kandinsky5 import load_qwen_processor


@dataclass(frozen=True)
class Case:
    family: str
    flavour: str

    @property
    def id(self) -> str:
        return f"{self.family}:{self.flavour}"

    @property
    def i2i(self) -> bool:
        return self.flavour.endswith("-i2i")

    def stock(self, folder) -> Any:
        if self.family == "lumina2":
            pipe = Lumina2Pipeline.from_pretrained(folder)
        else:
            cls = Kandinsky5I2IPipeline if self.i2i else Kandinsky5T2IPipeline
            pipe = cls.from_pretrained(folder, tokenizer=load_qwen_processor(folder))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def stock_sample(self, pipe, prompt, negative, width, height, steps, guidance, seed, image=None, **kw):
        kwargs = dict(prompt=prompt, negative_prompt=negative, height=height, width=width,
                      num_inference_steps=steps, guidance_scale=guidance,
                      generator=torch.Generator().manual_seed(seed), **kw)
        if self.family == "lumina2":
            return pipe(**kwargs).images
        pipe.resolutions = [(width, height)]  # the stock pipelines snap other sizes to 1K buckets
        if image is not None:
            kwargs["image"] = image
        return pipe(**kwargs).image

    def oracle_output(self, x0_net: torch.Tensor, hidden_states: torch.Tensor, timestep: torch.Tensor):
        """What a perfect network returns, in the family's own layout and time convention."""
        if self.family == "lumina2":
            s = (1.0 - timestep).view(-1, 1, 1, 1)  # Lumina2 time runs backwards; it predicts x0 - noise
            return -(hidden_states - x0_net) / s
        s = (timestep / 1000.0).view(-1, 1, 1, 1, 1)  # Kandinsky 5: t = 1000 s, predicts noise - x0
        return (hidden_states[..., : x0_net.shape[-1]] - x0_net) / s


CASES = [Case("lumina2", "tiny-random"), Case("kandinsky5-image", "tiny-random"),
         Case("kandinsky5-image", "tiny-random-i2i")]


def make_pairs(images, conditioning) -> None:
    """Input images for an image-to-image dataset: each target mirrored, same file name."""
    conditioning.mkdir(parents=True, exist_ok=True)
    for path in images.glob("*.png"):
        ImageOps.mirror(Image.open(path).convert("RGB")).save(conditioning / path.name)
