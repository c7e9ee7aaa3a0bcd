"""Quantized base weights (`base_model_precision`): the frozen transformer's linear layers, weight-only.

One call, `quantize_transformer`, between loading the transformer and attaching the adapter. The
libraries do the work: optimum-quanto (`quantize` + `freeze`) and torchao (`quantize_` with a
weight-only config). LoRA and LyCORIS then wrap the quantized layers under the same module names, so
saved adapters keep the key names of an unquantized run and load into the unquantized stock pipeline.
The trainable adapter weights stay in the training dtype; checkpoints hold only them, and a resumed run
quantizes the base again (round-to-nearest: the same weights every time).

Which precisions exist is a config fact (`config/schema.py`: `QUANTIZED_PRECISIONS`); this module
only knows how each one is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _quanto(weights: str) -> Callable[[torch.nn.Module, list[str]], None]:
    def apply(module: torch.nn.Module, names: list[str]) -> None:
        from optimum import quanto

        quanto.quantize(module, weights=getattr(quanto, weights), include=names)
        quanto.freeze(module)  # the quantized weights replace the float ones

    return apply


def _torchao(config: str) -> Callable[[torch.nn.Module, list[str]], None]:
    def apply(module: torch.nn.Module, names: list[str]) -> None:
        import torchao.quantization as ao

        wanted = set(names)
        ao.quantize_(module, getattr(ao, config)(), filter_fn=lambda m, fqn: fqn in wanted)

    return apply


# base_model_precision -> how its layers are quantized (weight-only: activations stay in the training dtype)
QUANTIZERS: dict[str, Callable[[torch.nn.Module, list[str]], None]] = {
    "int8-quanto": _quanto("qint8"),
    "int4-quanto": _quanto("qint4"),
    "fp8-quanto": _quanto("qfloat8"),
    "int8-torchao": _torchao("Int8WeightOnlyConfig"),
    "fp8-torchao": _torchao("Float8WeightOnlyConfig"),
}


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds; a quantized tensor (a tensor subclass) is counted by its inner tensors."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = flatten()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers."""
    return sum(tensor_bytes(t) for t in (*module.parameters(), *module.buffers()))


def quantized_layers(module: torch.nn.Module) -> list[str]:
    """Names of the layers to quantize: every nn.Linear (the bulk of a transformer's weights)."""
    return [name for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)]


def quantize_transformer(
    transformer: torch.nn.Module, precision: str, via: str, device: torch.device, park: bool,
    emit: Callable[..., Any],
) -> None:
    """Quantize the frozen transformer's linear layers in place.

    via 'cpu': quantize where it was loaded (the CPU), so the accelerator never holds the full-precision
    model; 'accelerator': move it there first (faster on a GPU). `park`: leave it on the CPU afterwards
    (offload_during_startup). `emit`: the events' emit, for the memory line."""
    if precision == "no_change":
        return
    before = weight_bytes(transformer)
    transformer.requires_grad_(False)
    if via == "accelerator":
        transformer.to(device)
    QUANTIZERS[precision](transformer, quantized_layers(transformer))
    if park:
        transformer.to("cpu")
    after = weight_bytes(transformer)
    emit("info", message=f"base_model_precision {precision}: transformer weights {before / 2**20:.1f} MiB -> "
                         f"{after / 2**20:.1f} MiB ({len(quantized_layers(transformer))} linear layers, "
                         f"quantized on the {'accelerator' if via == 'accelerator' else 'CPU'})",
         bytes_before=before, bytes_after=after)
