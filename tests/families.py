"""Per-family facts the conformance tests need: the stock pipeline class, how to call it, and what
a perfect network outputs in the family's own convention (the oracle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import (
    Kandinsky5I2IPipeline,
    Kandinsky5I2VPipeline,
    Kandinsky5T2IPipeline,
    Kandinsky5T2VPipeline,
    Lumina2Pipeline,
)
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

    @property
    def i2v(self) -> bool:
        return self.flavour.endswith("-i2v")

    @property
    def video(self) -> bool:
        return self.family == "kandinsky5-video"

    @property
    def input_image(self) -> bool:
        return self.i2i or self.i2v

    def latents(self, channels: int, h: int, w: int, frames: int = 2) -> torch.Tensor:
        """Random latents in difftune's layout: [1, C, h, w], or [1, C, T, h, w] for video."""
        return torch.randn(1, channels, frames, h, w) if self.video else torch.randn(1, channels, h, w)

    def to_net(self, x: torch.Tensor) -> torch.Tensor:
        """difftune's layout -> the network's own (Kandinsky 5: channels last with a time axis)."""
        if self.family == "lumina2":
            return x
        return x.permute(0, 2, 3, 4, 1) if self.video else x.permute(0, 2, 3, 1).unsqueeze(1)

    def conditioning(self, x0: torch.Tensor) -> torch.Tensor | None:
        """What predict() is given as the input image: paired latents (i2i) or one latent frame (i2v); here
        the clean first frame, so that an oracle sees x0 there."""
        if self.i2v:
            return x0[:, :, :1]
        return torch.zeros_like(x0) if self.i2i else None

    def stock(self, folder, **kwargs) -> Any:
        """The stock pipeline from `folder`; `kwargs` go to from_pretrained (torch_dtype, ...)."""
        if self.family == "lumina2":
            pipe = Lumina2Pipeline.from_pretrained(folder, **kwargs)
        else:
            if self.video:
                cls = Kandinsky5I2VPipeline if self.i2v else Kandinsky5T2VPipeline
            else:
                cls = Kandinsky5I2IPipeline if self.i2i else Kandinsky5T2IPipeline
            pipe = cls.from_pretrained(folder, tokenizer=load_qwen_processor(folder), **kwargs)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def stock_sample(self, pipe, prompt, negative, width, height, steps, guidance, seed, image=None, device=None,
                     **kw):
        """`device`: where the run sampled (its noise is drawn there, as validation draws it); the CPU by default."""
        if device is not None:
            pipe.to(device)
        kwargs = dict(prompt=prompt, negative_prompt=negative, height=height, width=width,
                      num_inference_steps=steps, guidance_scale=guidance,
                      generator=torch.Generator(device=device or "cpu").manual_seed(seed), **kw)
        if self.family == "lumina2":
            return pipe(**kwargs).images
        if image is not None:
            kwargs["image"] = image
        if self.video:
            return pipe(**kwargs).frames
        pipe.resolutions = [(width, height)]  # the stock pipelines snap other sizes to 1K buckets
        return pipe(**kwargs).image

    def oracle_output(self, x0_net: torch.Tensor, hidden_states: torch.Tensor, timestep: torch.Tensor):
        """What a perfect network returns, in the family's own layout and time convention."""
        if self.family == "lumina2":
            s = (1.0 - timestep).view(-1, 1, 1, 1)  # Lumina2 time runs backwards; it predicts x0 - noise
            return -(hidden_states - x0_net) / s
        s = (timestep / 1000.0).view(-1, 1, 1, 1, 1)  # Kandinsky 5: t = 1000 s, predicts noise - x0
        return (hidden_states[..., : x0_net.shape[-1]] - x0_net) / s
    # (image-to-video: frame 0 of hidden_states is the clean input frame, so frame 0's output is not a
    # velocity; the pipeline never uses it and training leaves it out of the loss)


CASES = [Case("lumina2", "tiny-random"), Case("kandinsky5-image", "tiny-random"),
         Case("kandinsky5-image", "tiny-random-i2i"), Case("kandinsky5-video", "tiny-random"),
         Case("kandinsky5-video", "tiny-random-i2v")]


def make_pairs(images, conditioning) -> None:
    """Input images for an image-to-image dataset: each target mirrored, same file name."""
    conditioning.mkdir(parents=True, exist_ok=True)
    for path in images.glob("*.png"):
        ImageOps.mirror(Image.open(path).convert("RGB")).save(conditioning / path.name)


def make_clips(folder, count: int = 3, frames: int = 12):
    """Captioned synthetic clips (moving shapes, 32x24, 24 fps), one seed each."""
    from difftune.data.video import synthetic_clip

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        synthetic_clip(folder / f"clip{i}.mp4", frames=frames, seed=i)
        (folder / f"clip{i}.txt").write_text(f"a moving square number {i}")
    return folder


def case_data(case: Case, tmp_path, dataset) -> tuple[Any, dict[str, Any]]:
    """The dataset folder a case trains on and the config keys it needs: input images beside the targets
    for i2i, captioned clips (9 frames; 17 validation frames for i2v, as the stock pipeline needs) for video."""
    if case.i2i:
        make_pairs(dataset, tmp_path / "inputs")
        return dataset, {"dataset": {"conditioning_data": "inputs"}, "conditioning_dir": tmp_path / "inputs"}
    if case.video:
        return make_clips(tmp_path / "clips"), {
            "dataset": {"dataset_type": "video", "resolution": 32, "video": {"num_frames": 9}},
            "validation_num_video_frames": 17 if case.i2v else 9}
    return dataset, {}


def wake_lora(model) -> None:
    """Give every lora_B random values: they start at zero, so an untrained LoRA changes nothing and a
    comparison of samples would not see it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
