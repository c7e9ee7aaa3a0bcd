"""`make bench-host-optimizer`: how fast each optimizer steps on the CPU, which is what a step costs with
`optimizer_cpu_offload_method: cpu` (train/optimizer_offload.py) beyond the PCIe copies.

For each optimizer and weight dtype: 50 tensors of 1M elements (a block's worth of weights, sizes like a real
model's linear layers), random gradients, one warm-up step, then the median of a few timed steps. The figure is
millions of weights stepped per second on this machine's cores (torch's thread count), so a user can divide
their model's trained weights by it: Lumina2's 2.6B at 100 M/s is 26 s per step. Device copies are not timed
here (bench_gpu's territory)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from difftune.train.optimizers import build_optimizer

# (label, optimizer name, optimizer_config settings)
CASES = [
    ("adamw_bf16 (Kahan)", "adamw_bf16", {}),
    ("adamw", "adamw", {}),
    ("adamw fused=true", "adamw", {"fused": True}),
    ("lion", "lion", {}),
    ("optimi-lion", "optimi-lion", {}),
    ("adamw8bit", "adamw8bit", {}),
]


def rate(name: str, settings: dict, dtype: torch.dtype, tensors: int, size: int, repeats: int) -> float:
    """Millions of weights per second of `repeats` timed steps (median)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size, generator=g).to(dtype)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(size, generator=g).to(dtype)
    optimizer = build_optimizer(name, params, 1e-4, (0.9, 0.999), 0.01, 1e-8, settings)
    optimizer.step()  # the state is made here
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return tensors * size / statistics.median(times) / 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"CPU optimizer steps, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.tensors} x {args.size:,} weights")
    print("| optimizer | bf16 weights (M/s) | fp32 weights (M/s) |\n|---|---|---|")
    for label, name, settings in CASES:
        cells = []
        for dtype in (torch.bfloat16, torch.float32):
            try:
                cells.append(f"{rate(name, settings, dtype, args.tensors, args.size, args.repeats):.3g}")
            except Exception as e:  # an optimizer this CPU cannot run: say why, go on
                cells.append(f"n/a ({type(e).__name__})")
        print(f"| {label} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
