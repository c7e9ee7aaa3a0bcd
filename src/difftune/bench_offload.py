"""`python -m difftune.bench_offload`: a LoRA training step of the real-size Lumina2 transformer (random bf16
weights, the real architecture config from bench_memory) with block streaming and without: step time and
peak accelerator memory. Meant for a machine with a GPU; with `--layers N` only the first N of the 26 main
blocks are built (quicker, less memory), and `--tiny` runs the tiny test model (a check that runs anywhere).

Each configuration is built fresh; the first steps warm up and are not counted. Figures are printed, never
stored: BENCHMARKS.md holds only numbers measured on a named machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from peft import LoraConfig

from difftune.adapters.casts import skip_casts_under_autocast
from difftune.bench import machine_info
from difftune.bench_memory import LUMINA2, materialize
from difftune.models.registry import FAMILY_FACTS
from difftune.train.offload import BlockStreamer, streamed_blocks

TINY = dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=48, num_layers=2, num_refiner_layers=1,
            num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(8, 8, 8),
            axes_lens=(300, 512, 512), cap_feat_dim=32)


def build(config: dict, device: torch.device, checkpointing: bool) -> torch.nn.Module:
    from diffusers import Lumina2Transformer2DModel

    with torch.device("meta"):
        meta = Lumina2Transformer2DModel(**config)
    model = materialize(meta.to(torch.bfloat16)).requires_grad_(False)  # random weights, in CPU memory
    rope = model.rope_embedder  # its tables are plain attributes, not buffers: computed again on the CPU
    model.rope_embedder = type(rope)(theta=rope.theta, axes_dim=rope.axes_dim, axes_lens=rope.axes_lens,
                                     patch_size=rope.patch_size)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    skip_casts_under_autocast(model)  # as the trainer's LoRA (adapters/casts.py)
    if checkpointing:
        model.enable_gradient_checkpointing()
    return model


def step(model: torch.nn.Module, config: dict, size: int, device: torch.device) -> None:
    latent = size // 8
    x = torch.randn(1, config["in_channels"], latent, latent, device=device, dtype=torch.bfloat16)
    text = torch.randn(1, 128, config["cap_feat_dim"], device=device, dtype=torch.bfloat16)
    mask = torch.ones(1, 128, dtype=torch.bool, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(hidden_states=x, timestep=torch.rand(1, device=device), encoder_hidden_states=text,
                    encoder_attention_mask=mask).sample
    out.float().pow(2).mean().backward()


def measure(config: dict, mode: str, args: argparse.Namespace, device: torch.device) -> dict:
    model = build(config, device, not args.no_checkpointing)
    if mode == "resident":
        model.to(device)
    else:
        per_group, prefetch = (1, True) if mode == "stream" else (1, False)
        blocks = streamed_blocks(model, FAMILY_FACTS["lumina2"].block_stacks, None)
        BlockStreamer(model, blocks, per_group, device, prefetch)
        model.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        started = time.perf_counter()
        step(model, config, args.size, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"mode": mode, "step_s": statistics.median(times), "peak_gib": peak}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="main blocks to build (default: all 26)")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels (default 1024)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-checkpointing", action="store_true", help="without gradient checkpointing")
    parser.add_argument("--tiny", action="store_true", help="the tiny test model (runs on the CPU)")
    parser.add_argument("--modes", default="resident,stream,no-stream")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = dict(TINY if args.tiny else LUMINA2)
    if args.tiny:
        args.size = min(args.size, 64)
    if args.layers is not None:
        config["num_layers"] = args.layers
    print(" | ".join(f"{k}: {v}" for k, v in machine_info().items()))
    print(f"Lumina2 ({config['num_layers']} main blocks), LoRA r16, {args.size}px, batch 1, bf16, "
          f"gradient checkpointing {'off' if args.no_checkpointing else 'on'}")
    for mode in args.modes.split(","):
        result = measure(config, mode, args, device)
        print(f"{mode:>10}: step {result['step_s']:.3f} s, peak {result['peak_gib']:.2f} GiB", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
