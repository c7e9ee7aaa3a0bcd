"""What use_dora adds to the training phase, beside the magnitude vectors (which predict.trainable_shapes counts
with the adapter: fp32, with gradients and optimizer state).

peft's DoRA layer (peft/tuners/lora/dora.py, with no LoRA dropout) computes each adapted layer's output as
`result + (m / |W + s·B·A| - 1) * base_result + m / |W + s·B·A| * lora_result * s`. What the loss's graph keeps
for that, per adapted layer, above a plain LoRA layer of the trainer (whose input cast is skipped under
autocast, adapters/casts.py), found with torch.autograd.graph.saved_tensors_hooks on one layer (bf16 base, fp32
adapter, bf16 autocast) and in whole blocks:

- the products: the two products with the trainable scale m / |W + s·B·A| keep their other factor, the base
  layer's output and the LoRA branch's output, each [rows, out_features] in the compute dtype: 2 · rows · out
  elements. Plain LoRA keeps neither (its branch is only scaled by a constant).
- the input cast: DoRA layers keep peft's input cast (casts.py: the norms meet the input before the autocast
  matmul), so `lora_A` gets x.to(fp32), which autocast casts back to a fresh bf16 [rows, in_features] copy, and
  that copy is what `lora_A` keeps for its weight's gradient: rows · in elements of the compute dtype, one per
  layer (the fp32 copy is not kept: a cast's backward needs no input). A LoRA layer with the cast skipped keeps
  its input itself, one storage shared with whatever else keeps it. So the copy is new memory except where
  the LoRA layer's saved input was kept for that layer alone: the query projection's input (to_q, to_query).
  Self-attention's q, k and v read one tensor, which skipped LoRA kept once (so two of the three copies are new,
  counted on k and v); a cross-attention's query reads the image stream alone; the output projection reads the
  attention's output, which the attention kernel keeps anyway (flash attention keeps its output); a
  cross-attention's k and v read the text context every block shares (skipped LoRA kept it once for the whole
  model: one text copy fewer model-wide than counted here). Other target modules are counted one copy each: at
  most one copy too many per input they share. In fp32 (no autocast) the casts are no-ops: no copy.
- three fp32 vectors of out_features: m / |W + s·B·A|, that minus 1 (each kept by the other product), and
  |W + s·B·A| (kept by the division, for m's gradient); whatever the rows.

Measured at real width (memory_plan/measure.py KeptBytes: what the loss's graph still holds after the forward),
2 blocks per stack, 576 image and 64 text tokens, DoRA minus the trainer's LoRA per block, this rule gives each
figure to the byte: Lumina2 2.0 context_refiner / noise_refiner / layers 2.414 / 21.164 / 23.508 MiB (the
products alone, the rule before the casts were counted: 1.5 / 13.5 / 15.0), K5 Image Lite text / visual blocks
3.555 / 47.109 MiB (products 2.5 / 35.0). tests/test_memory_plan_passes.py checks it at real width and, to the
byte, on one attention computed for real.

The weight norm |W + s·B·A| is recomputed at every forward, detached: peft builds B·A as lora_B(lora_A(eye))
with an fp32 identity of in_features² (and its compute-dtype copy under autocast), then W + s·B·A densely. That
graph dies inside the layer's forward: a transient of one layer at a time, `norm_working_set`, added once.

The rows of each layer come from the family's FLOP count (`Flops.rows_of`: which tokens each module multiplies).
With gradient checkpointing a checkpointed block keeps its inputs only: its DoRA tensors exist again while the
backward recomputes it, one block at a time (added to the recomputed block); a stack the model does not
checkpoint (Lumina2's refiners) keeps them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from difftune.memory_plan import architecture as A


@functools.lru_cache(maxsize=8)
def adapted_layers(arch: A.Architecture, targets: Any) -> tuple[tuple[str, int, int], ...]:
    """(module path, in_features, out_features) of every layer peft adapts with these targets (meta model)."""
    import torch
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    model = A.transformer_on_meta(arch)
    config = LoraConfig(r=1, target_modules=targets if isinstance(targets, str) else list(targets))
    return tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and check_target_module_exists(config, name))


def _latent_shape(cfg: Any, arch: A.Architecture, bucket: tuple[int, ...]) -> tuple[int, ...]:
    channels = arch.config.get("in_channels") or arch.config.get("out_visual_dim") or 16
    w, h = bucket[0] // 8, bucket[1] // 8
    if len(bucket) > 2 and bucket[2] and arch.family == "kandinsky5-video":
        return (cfg.train_batch_size, channels, (bucket[2] - 1) // 4 + 1, h, w)
    return (cfg.train_batch_size, channels, h, w)


def per_layer_bytes(cfg: Any, arch: A.Architecture, bucket: tuple[int, ...], text: int,
                    dtype_bytes: int) -> dict[str, int]:
    """{module path: bytes DoRA keeps there for the micro-batch, above the trainer's LoRA} (layer_bytes)."""
    from difftune.models import get_family

    flops = get_family(arch.family).forward_flops(arch.config, _latent_shape(cfg, arch, bucket), text)
    return {name: layer_bytes(name, flops.rows_of(name), n_in, n_out, dtype_bytes)
            for name, n_in, n_out in adapted_layers(arch, cfg_targets(cfg))}


QUERY_PROJECTIONS = ("to_q", "to_query")  # their input is kept for them alone by the trainer's LoRA too


def layer_bytes(name: str, rows: int, n_in: int, n_out: int, dtype_bytes: int) -> int:
    """Bytes one adapted layer's DoRA keeps above the trainer's LoRA layer (module docstring): the two products,
    the kept input cast's copy (not for a query projection, nor in fp32) and three fp32 vectors."""
    products = 2 * rows * n_out * dtype_bytes
    cast = 0 if dtype_bytes >= 4 or name.rsplit(".", 1)[-1] in QUERY_PROJECTIONS else rows * n_in * dtype_bytes
    return products + cast + 3 * n_out * 4


def cfg_targets(cfg: Any) -> Any:
    from difftune.memory_plan.predict import _targets

    return _targets(cfg)


def layer_norm_bytes(n_in: int, n_out: int, dtype_bytes: int) -> int:
    """Peak bytes one DoRA layer's forward holds above a plain LoRA layer's: 8 · in · out + in² elements of the
    compute dtype (B·A, s·B·A, W + s·B·A and the norm's own temporaries at its peak, with part of the identity
    still alive). Fitted on the CPU (measure.LiveBytes, bf16 autocast) on 2304x768, 768x2304 and 2304x2304
    layers, within 2% of each (tests/test_memory_plan_passes.py); the fp32 identity's peak comes earlier and is
    lower. The CUDA norm kernel may keep fewer temporaries: an upper bound there."""
    return (8 * n_in * n_out + n_in * n_in) * dtype_bytes


def norm_working_set(cfg: Any, arch: A.Architecture, dtype_bytes: int) -> int:
    """The largest adapted layer's weight-norm transient (layer_norm_bytes): one layer at a time."""
    return max(layer_norm_bytes(i, o, dtype_bytes) for _n, i, o in adapted_layers(arch, cfg_targets(cfg)))


def add_training(cfg: Any, arch: A.Architecture, blocks: A.Blocks, coefficients: dict, bucket: tuple[int, ...],
                 text: int, dtype_bytes: int, training: Any) -> None:
    """DoRA's lines of the training phase: what its layers keep (layer_bytes), and the weight norm's transient."""
    layers = per_layer_bytes(cfg, arch, bucket, text, dtype_bytes)
    checkpointing = bool(cfg.gradient_checkpointing)
    interval = getattr(cfg, "gradient_checkpointing_interval", None) or 1
    saved = recomputed = 0
    for stack, n in blocks.count.items():
        first = sum(size for name, size in layers.items() if name.startswith(f"{stack}.0."))
        everything = sum(size for name, size in layers.items() if name.startswith(f"{stack}."))
        # a stack is checkpointed when its 'checkpointed' coefficients are not its plain ones (measure.calibrate)
        checkpointed = checkpointing and coefficients["checkpointed"].get(stack) != coefficients["lora"].get(stack)
        if checkpointed:
            kept_blocks = n - math.ceil(n / interval)
            saved += first * kept_blocks
            recomputed = max(recomputed, first)
        else:
            saved += everything
    saved += sum(size for name, size in layers.items() if not any(name.startswith(f"{s}.") for s in blocks.count))
    training.add("DoRA: saved products", saved, "m/|W+sBA| times the base and LoRA outputs, and the input casts "
                 "DoRA keeps, per adapted layer")
    if recomputed:
        training.add("DoRA: recomputed block's products", recomputed, "gradient checkpointing: one block at a time")
    training.add("DoRA: weight norm (one layer)", norm_working_set(cfg, arch, dtype_bytes),
                 "|W + s·B·A| recomputed each forward, detached")
