"""`make bench-tread`: the step-time gain of TREAD token routing at real width, on the CPU.

For each family, a random-init transformer with the real model's width (hidden size, heads, feed-forward,
text width: the configs of `bench_memory`) but only `--blocks` main blocks (8 by default; refiners and text
blocks as in the real model), a LoRA of rank 16 on the family's attention projections (what training
updates), in fp32. One training step is a forward pass of `Family.predict` on random latents and a random
caption (128 tokens) and a backward pass of the mean squared output, with and without TREAD at
`selection_ratio` 0.5 over the specs' route (`start_layer_idx` 2, `end_layer_idx` -2: blocks 2 to 6 of 8).
The two settings alternate, after one untimed step each; the table gives the median of `--repeats` steps.

The gain depends on the share of the work inside the route: a real model routes 23 of Lumina2's 26 blocks
or 47 of Kandinsky 5 Lite's 50 with the same indices, so these 8-block models understate it. Token counts
are those of a 512x512 image (1024 image tokens) and of a 9-frame 256x256 clip (3 latent frames, 768
tokens). No GPU figure is claimed here.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from types import SimpleNamespace as NS

import torch
from diffusers import Kandinsky5Transformer3DModel, Lumina2Transformer2DModel
from peft import LoraConfig

from difftune.bench import machine_info
from difftune.bench_memory import K5_IMAGE_LITE, K5_VIDEO_LITE, LUMINA2
from difftune.models import get_family
from difftune.train import tread

CAPTION = 128


def build(name: str, blocks: int) -> tuple[object, torch.nn.Module, dict]:
    """(family, transformer with a LoRA, predict's inputs) of a real-width model with `blocks` main blocks."""
    torch.manual_seed(0)
    if name == "lumina2":
        net = Lumina2Transformer2DModel(**{**LUMINA2, "num_layers": blocks})
        inputs = {"noisy": torch.randn(1, 16, 64, 64), "conditioning": None,
                  "text": {"prompt_embeds": torch.randn(1, CAPTION, LUMINA2["cap_feat_dim"]),
                           "attention_mask": torch.ones(1, CAPTION, dtype=torch.long)}}
    else:
        config = K5_IMAGE_LITE if name == "kandinsky5-image" else K5_VIDEO_LITE
        net = Kandinsky5Transformer3DModel(**{**config, "num_visual_blocks": blocks})
        shape = (1, 16, 64, 64) if name == "kandinsky5-image" else (1, 16, 3, 32, 32)
        inputs = {"noisy": torch.randn(*shape), "conditioning": None,
                  "text": {"prompt_embeds": torch.randn(1, CAPTION, config["in_text_dim"]),
                           "pooled": torch.randn(1, config["in_text_dim2"])}}
    family = get_family(name)
    net.requires_grad_(False)
    targets = family.lora_target_modules
    net.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=list(targets) if isinstance(targets, tuple)
                               else targets))
    return family, net.train(), inputs


def step(family: object, net: torch.nn.Module, inputs: dict) -> float:
    start = time.perf_counter()
    out = family.predict(net, inputs["noisy"], torch.tensor([0.6]), inputs["text"], inputs["conditioning"])
    out.float().square().mean().backward()
    net.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure(name: str, blocks: int, repeats: int, ratio: float) -> dict[str, float]:
    family, net, inputs = build(name, blocks)
    route = NS(routes=[NS(selection_ratio=ratio, start_layer_idx=2, end_layer_idx=-2)])
    router = tread.attach(route, family, net, torch.Generator().manual_seed(0), False)
    routed = tread.resolve_routes(route.routes, blocks)[0]
    router.detach()
    times: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(repeats + 1):
        for mode in ("off", "on"):
            if mode == "on":
                router.attach(net)
            took = step(family, net, inputs)
            if mode == "on":
                router.detach()
            if i:  # the first of each is a warm-up
                times[mode].append(took)
    del net
    gc.collect()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"off": off, "on": on, "speedup": off / on, "route": f"{routed.start}-{routed.end} of {blocks}"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=["lumina2", "kandinsky5-image", "kandinsky5-video"])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.5)
    args = parser.parse_args(argv)
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['torch threads']} threads), "
          f"{info['device']}")
    print(f"| family | tokens | route (blocks) | step without TREAD | step with TREAD {args.ratio} | speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    tokens = {"lumina2": "1024 image + 128 caption", "kandinsky5-image": "1024 image (+128 text, own stream)",
              "kandinsky5-video": "768 video (+128 text, own stream)"}
    for name in args.families:
        r = measure(name, args.blocks, args.repeats, args.ratio)
        print(f"| {name} | {tokens[name]} | {r['route']} | {r['off']:.2f} s | {r['on']:.2f} s | "
              f"{r['speedup']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
