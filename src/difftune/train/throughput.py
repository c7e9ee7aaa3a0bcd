"""Throughput in the log: model FLOP/s, latent tokens/s, MFU and peak accelerator memory of each step.

`Throughput.add(batch)` is called once per micro-batch and reads only shapes (no device sync: the batch may
still be on its way to the accelerator); `step_fields(seconds)` turns the step's sums into the "step" event's
fields and starts the next step:
- `tflops`: model TFLOP/s of this process (models/flops.py: forward + backward of the transformer, without
  gradient checkpointing's recomputation), over the step's wall time. A micro-batch of regularisation data
  (`Batch.regularisation`, train/regularisation.py) adds the teacher's forward: the base model, no adapter, no
  backward, unrouted (TREAD routes only passes with gradients), over the whole micro-batch as the loop runs it.
  use_dora adds, per adapted layer and forward, peft's B·A built as lora_B(lora_A(I)): 2·r·in·(in + out), for
  the weight norm |W + s·B·A| (used detached: no backward; its elementwise work is not counted, as elsewhere);
- `tokens_per_s`: image/video latent tokens after patchify per second, this process;
- `mfu`: tflops / the device's peak dense bf16 TFLOP/s, only where the peak is known (`gpu_peak_tflops`, else
  `PEAK_TFLOPS` by device name);
- `peak_memory_gib`: CUDA's `max_memory_allocated` (an allocator query on the host): the most memory this run's
  steps have held so far (kept here: train/memory.py resets the counter at its "memory" events, and around the
  first validation, whose peak is an event of its own). Absent on the CPU.
The step FLOPs of a bucket shape are computed once and cached: one dict lookup per micro-batch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from difftune.models.flops import Flops, lora_forward

# Peak dense (no 2:4 sparsity) bf16 tensor TFLOP/s by device name, with FP32 accumulation (what torch's bf16 matmuls
# use; GeForce cards run it at half their FP16-accumulate rate). Sources: NVIDIA's product datasheets (the
# "with sparsity" figures halved) and architecture whitepapers (GA102 and Ada appendices, RTX Blackwell). Checked
# against other MFU tables (torchtitan / zeroband `get_peak_flops`: H100 SXM 989, PCIe 756, NVL 835, H200 989,
# B200 2250, A100 312, MI300X 1300). The first pattern that matches `torch.cuda.get_device_name()` wins: the
# specific variants come first.
PEAK_TFLOPS: list[tuple[str, float]] = [
    (r"GH200", 989.4),  # Grace Hopper: H100/H200 SXM compute
    (r"H100 NVL", 835.0),  # H100 NVL datasheet: 1,671 with sparsity
    (r"H[18]00 PCIe", 756.0),  # H100 PCIe datasheet: 1,513 with sparsity; H800 PCIe: the same compute
    (r"H100|H800", 989.4),  # H100 SXM5 ("NVIDIA H100 80GB HBM3"): 1,979 with sparsity; H800: the same compute
    (r"H200 NVL", 835.0),  # H200 NVL datasheet: 1,671 with sparsity
    (r"H200", 989.4),  # H200 SXM datasheet: 1,979 with sparsity
    (r"\bH20\b", 148.0),  # H20 (China export Hopper): 148 dense, as MFU tables list it (LLMRoofline)
    (r"GB200", 2500.0),  # GB200 NVL72: 5 PFLOPS per GPU with sparsity
    (r"B200", 2250.0),  # HGX B200 datasheet: 4.5 PFLOPS per GPU with sparsity
    (r"\bA[18]00\b", 312.0),  # A100 datasheet (SXM4 and PCIe): 624 with sparsity; A800: the same compute
    (r"\bA40\b", 149.7),  # A40 datasheet: 299.4 with sparsity
    (r"\bA30\b", 165.0),  # A30 datasheet: 330 with sparsity
    (r"\bA10\b", 125.0),  # A10 datasheet: 250 with sparsity
    (r"L40S", 362.05),  # L40S datasheet: 733 with sparsity
    (r"\bL40\b", 181.05),  # L40 datasheet: 362.1 with sparsity
    (r"\bL20\b", 119.5),  # L20: 239 with sparsity (LLMRoofline lists 119.5)
    (r"\bL4\b", 121.0),  # L4 datasheet: 242 with sparsity
    (r"RTX 6000 Ada", 364.2),  # RTX 6000 Ada datasheet: 1,457 FP8 with sparsity / 4
    (r"RTX A6000", 154.8),  # RTX A6000 datasheet: 309.7 tensor TFLOPS with sparsity
    (r"RTX 5090", 209.5),  # 838.4 FP16 with sparsity and FP16 accumulation: / 2 dense, / 2 FP32 accumulation
    (r"RTX 4090 D", 147.0),  # 114 of the RTX 4090's 128 SMs at its clocks
    (r"RTX 4090", 165.2),  # Ada whitepaper: 165.2 bf16 dense with FP32 accumulation (330.3 with sparsity)
    (r"RTX 4080", 97.5),  # Ada whitepaper: 97.5 dense with FP32 accumulation
    (r"RTX 3090 Ti", 80.0),  # GA102 whitepaper: 80 dense with FP32 accumulation
    (r"RTX 3090", 71.0),  # GA102 whitepaper: 71 dense with FP32 accumulation (142 with sparsity)
    (r"MI300X|MI325X", 1307.4),  # AMD Instinct MI300X / MI325X datasheets: 1,307.4 dense bf16
]


def peak_tflops(device_name: str) -> float | None:
    """The device's peak dense bf16 TFLOP/s from `PEAK_TFLOPS`; None for a device it does not list."""
    for pattern, tflops in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


class Throughput:
    """Per-step FLOPs and tokens of one process, from the shapes of its micro-batches (module docstring)."""

    def __init__(self, flops_of: Callable[[tuple[int, ...], int], Flops], full: bool,
                 adapter_shapes: Sequence[tuple[str, int]] = (), peak: float | None = None,
                 device: torch.device | None = None,
                 teacher_of: Callable[[tuple[int, ...], int], Flops] | None = None, per_forward: float = 0.0):
        """`flops_of(latent_shape, text_tokens)`: the family's forward count for one micro-batch. `full`: every
        weight trains; else `adapter_shapes` are the LoRA matrices (name, numel), whose own FLOPs are added.
        `teacher_of`: the same count for the regularisation teacher's pass (unrouted); `flops_of` when None.
        `per_forward`: FLOPs each training forward adds whatever the shapes (DoRA's B·A, `dora_flops`)."""
        self.per_forward = per_forward
        self.flops_of, self.full, self.adapter_shapes = flops_of, full, list(adapter_shapes)
        self.teacher_of = teacher_of or flops_of
        self.peak = peak
        self.device = device or torch.device("cpu")
        self._cache: dict[tuple[tuple[int, ...], int, bool], tuple[float, int]] = {}
        self.flops = 0.0  # this step's model FLOPs so far
        self.tokens = 0
        self.most = 0  # the CUDA peak of the steps so far (peak_memory_gib)

    def micro_batch(self, latent_shape: tuple[int, ...], text_tokens: int, teacher: bool = False) -> tuple[float, int]:
        """(step FLOPs, latent tokens) of one micro-batch of these shapes (cached per shape); `teacher`: it holds
        regularisation data, so the base model's no-grad forward runs first (module docstring)."""
        key = (latent_shape, text_tokens, teacher)
        if key not in self._cache:
            f = self.flops_of(latent_shape, text_tokens)
            adapter = 0.0 if self.full else lora_forward(f, self.adapter_shapes)
            extra = self.teacher_of(latent_shape, text_tokens).forward if teacher else 0.0
            self._cache[key] = (f.step(self.full, adapter) + self.per_forward + extra, f.tokens)
        return self._cache[key]

    def add(self, batch: Any) -> None:
        """Count one micro-batch: shapes only, nothing is read from the device."""
        teacher = getattr(batch, "regularisation", None) is not None  # train/regularisation.target's condition
        flops, tokens = self.micro_batch(tuple(batch.latents.shape), int(batch.text["prompt_embeds"].shape[1]),
                                         teacher)
        self.flops += flops
        self.tokens += tokens

    def step_fields(self, seconds: float) -> dict[str, float]:
        """The "step" event's fields for the micro-batches added since the last call, which took `seconds`."""
        fields: dict[str, float] = {}
        if seconds > 0 and self.flops > 0:
            tflops = self.flops / seconds / 1e12
            fields["tflops"] = _figures(tflops)
            fields["tokens_per_s"] = _figures(self.tokens / seconds)
            if self.peak:
                fields["mfu"] = _figures(tflops / self.peak)
        if self.device.type == "cuda":  # the counter is reset around the first validation (train/memory.py)
            self.most = max(self.most, torch.cuda.max_memory_allocated(self.device))
            fields["peak_memory_gib"] = _figures(self.most / 2**30)
        self.flops, self.tokens = 0.0, 0
        return fields


def _figures(value: float) -> float:
    """Four significant figures: a readable log at any scale (a tiny CPU run's TFLOP/s and an H100's alike)."""
    return float(f"{value:.4g}")


def adapter_shapes(transformer: torch.nn.Module) -> list[tuple[str, int]]:
    """(name, numel) of the trainable LoRA matrices of peft's layers (the only adapter with a per-row term here)."""
    return [(name, p.numel()) for name, p in transformer.named_parameters()
            if p.requires_grad and (".lora_A." in name or ".lora_B." in name)]


def dora_flops(transformer: torch.nn.Module) -> float:
    """FLOPs of peft's DoRA B·A products in one forward: 2·r·in·(in + out) per layer with a magnitude vector
    (lora_A applied to an in x in identity, then lora_B)."""
    from difftune.adapters.dora import ADAPTER, dora_layers

    total = 0.0
    for _, layer in dora_layers(transformer):
        r, n_in = layer.lora_A[ADAPTER].weight.shape
        total += 2.0 * r * n_in * (n_in + layer.lora_B[ADAPTER].weight.shape[0])
    return total


def build(cfg: Any, family: Any, transformer: torch.nn.Module, routes: Sequence[Any], first_frame: bool,
          device: torch.device, emit: Callable[..., None]) -> Throughput:
    """The run's Throughput: `transformer` is the unwrapped model with its adapter attached, `routes` TREAD's
    resolved routes. Says once, in an "info" event, when MFU cannot be shown and how to get it."""
    config = dict(transformer.config)
    full = cfg.model_type == "full"
    shapes = [] if full or cfg.lora_type != "standard" else adapter_shapes(transformer)
    peak = cfg.gpu_peak_tflops
    if peak is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        peak = peak_tflops(name) if name else None
        if peak is None:
            what = f"the peak bf16 TFLOP/s of {name!r} is not known" if name else f"training on the {device.type}"
            # in the log either way; on the console only for a GPU, where setting gpu_peak_tflops helps
            emit("info", quiet=name is None, message=f"MFU is not shown: {what}. Set gpu_peak_tflops to the "
                 "device's dense bf16 TFLOP/s to see it (TFLOP/s and tokens/s are logged either way)")

    def flops_of(latent_shape: tuple[int, ...], text_tokens: int) -> Flops:
        return family.forward_flops(config, latent_shape, text_tokens, routes=routes, first_frame=first_frame)

    def teacher_of(latent_shape: tuple[int, ...], text_tokens: int) -> Flops:  # the teacher runs unrouted
        return family.forward_flops(config, latent_shape, text_tokens, routes=(), first_frame=first_frame)

    dora = dora_flops(transformer) if getattr(cfg, "use_dora", False) else 0.0
    return Throughput(flops_of, full, shapes, peak, device, teacher_of, dora)
