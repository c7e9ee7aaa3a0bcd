"""DoRA (`use_dora`) beside peft's own: where its magnitudes start, and the base weights ComfyUI's export needs.

peft's DoRA layer (peft/tuners/lora/dora.py, `DoraLinearLayer`) keeps one magnitude m per output row in
`lora_magnitude_vector["default"].weight` and computes the adapted layer as
`W' = m / |W + s·B·A| · (W + s·B·A)` (row norms, detached in training as the DoRA paper suggests), with W the
base weight as the layer's forward sees it (dequantized for quanto, torchao and bitsandbytes layers, cast to the
input's dtype) and s = lora_alpha / r.

peft sets m = |W + s·B·A| when the adapter is created, in the base weight's dtype. `start_magnitudes` sets it
again in fp32, from the same dense fp32 weight the forward uses, so that m / |W + s·B·A| is exactly 1 at the start:
with B = 0 the first step's model is the base model bit for bit (a bf16-rounded m would scale every row by up
to 2^-9), and after `init_lora` from a plain LoRA it is that LoRA's model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from peft.utils.integrations import dequantize_module_weight

ADAPTER = "default"


def dora_layers(transformer: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(module name, peft LoRA layer) of every layer with a DoRA magnitude."""
    for name, module in transformer.named_modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if magnitudes is not None and ADAPTER in magnitudes:
            yield name, module


def dense_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight of a linear layer (a peft layer's base layer) as a plain fp32 tensor: quantized weights
    (bitsandbytes, torchao through peft's helper; optimum-quanto's QTensor by its own `dequantize`) are
    dequantized."""
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    with torch.no_grad():
        weight = dequantize_module_weight(base)
        if type(weight) not in (torch.Tensor, torch.nn.Parameter) and hasattr(weight, "dequantize"):
            weight = weight.dequantize()
        return weight.detach().to(torch.float32)


def start_magnitudes(transformer: torch.nn.Module) -> int:
    """m = |W + s·B·A| per output row, in fp32, for every DoRA layer; returns how many layers."""
    count = 0
    with torch.no_grad():
        for _, layer in dora_layers(transformer):
            a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
            weight = dense_weight(layer).to(a.device)
            weight = weight + layer.scaling[ADAPTER] * (b.float() @ a.float())
            magnitude = layer.lora_magnitude_vector[ADAPTER].weight
            magnitude.copy_(torch.linalg.norm(weight, dim=1).to(magnitude.dtype))
            count += 1
    return count
