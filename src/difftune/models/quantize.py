"""Quantized frozen weights, weight-only, linear layers: the transformer (`base_model_precision`) and the
text encoders (`text_encoder_1_precision`, `text_encoder_2_precision`).

One call, `quantize_transformer`, between loading the transformer and attaching the adapter; one,
`quantize_text_encoders`, between loading the text encoders and encoding the first caption (the text
cache's fingerprint holds their precisions: a quantized encoder gives other embeddings). The
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

from difftune.models.quantized_saves import lean_saves


def _quanto(weights: str) -> Callable[[torch.nn.Module, list[str]], None]:
    def apply(module: torch.nn.Module, names: list[str]) -> None:
        from optimum import quanto

        if weights == "qint8":
            # torch's CPU kernel for qint8 weights and bf16 inputs (`_weight_int8pack_mm`, torch 2.13) kills the
            # process on inputs of more than a few rows whose width is not a multiple of 16 (Kandinsky 5's visual
            # embedder, 132 = (16 + 16 + 1) x 2 x 2 inputs): such a layer, one small embedder, stays unquantized.
            names = [n for n in names if getattr(module.get_submodule(n), "in_features", 16) % 16 == 0]
        quanto.quantize(module, weights=getattr(quanto, weights), include=names)
        quanto.freeze(module)  # the quantized weights replace the float ones
        for layer in map(module.get_submodule, names):  # these alone: a module quantized in pieces comes here again
            if isinstance(layer, quanto.QModuleMixin):
                layer.register_forward_pre_hook(_aligned_input)
                layer.register_forward_hook(_autocast_back, always_call=True)

    return apply


def _aligned_input(layer: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The input in the dtype of the layer's scales, and a copy of a CPU input that does not start on a 64-byte
    boundary.

    dtype: optimum-quanto's matmuls (int8 `_weight_int8pack_mm`, the int4 and fp8 ones) take the input in the dtype
    of the weight's scales, the weights' dtype before quantizing. fp32 weights (base_model_default_dtype 'fp32')
    under bf16 mixed precision got bf16 activations and failed ("expected scalar type BFloat16 but found Float"),
    and where autocast cast the scales too, the backward failed instead. Such a layer runs in its weights' dtype,
    outside autocast (as an fp32 linear layer would under `autocast(enabled=False)`), its output in that dtype.

    alignment: for qint8 weights and bf16 inputs on the CPU, `_weight_int8pack_mm`'s vector loads assume an aligned
    input: a view that starts 16 bytes into its storage kills the process with a segmentation fault (torch 2.13;
    seen in Kandinsky 5's time embedding while validation sampled in bf16). A new tensor starts aligned."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        return None
    wanted, device = getattr(layer.weight, "dtype", x.dtype), x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != wanted:
        # autocast would cast the quantized weight's scales to its dtype, and quanto's backward then multiplies the
        # gradient of that dtype with the scales as they are: the layer runs outside autocast (_autocast_back)
        layer.__dict__["_difftune_autocast"] = device
        torch.set_autocast_enabled(device, False)
    if x.is_floating_point() and x.dtype != wanted:
        x = x.to(wanted)
    elif not (device == "cpu" and x.data_ptr() % 64):
        return None
    if device == "cpu" and x.data_ptr() % 64:
        x = x.clone(memory_format=torch.contiguous_format)
    return (x, *args[1:])


def _autocast_back(layer: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """Autocast on again after a layer `_aligned_input` ran outside it (also when the forward raised)."""
    device = layer.__dict__.pop("_difftune_autocast", None)
    if device is not None:
        torch.set_autocast_enabled(device, True)


def _torchao(config: str) -> Callable[[torch.nn.Module, list[str]], None]:
    def apply(module: torch.nn.Module, names: list[str]) -> None:
        import torchao.quantization as ao

        wanted = set(names)
        ao.quantize_(module, getattr(ao, config)(), filter_fn=lambda m, fqn: fqn in wanted)

    return apply


def _bnb_nf4(module: torch.nn.Module, names: list[str]) -> None:
    """Each named nn.Linear becomes a bitsandbytes Linear4bit (NF4, blocks of 64) under the same name, so
    adapters wrap it as they wrap the linear layer (peft has LoRA layers for it). The weights quantize
    where they are, when the layer is moved there (`Params4bit` quantizes on its first `.to`)."""
    import bitsandbytes as bnb

    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        linear = getattr(parent, child)
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=linear.weight.dtype, quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4")
        # On a CPU with AVX512-BF16, bitsandbytes repacks the weight in place at the first no-grad forward (a
        # layout only its CPU kernel reads, in blocks of 32 output rows: it asserts on other sizes), behind the
        # back of block streaming, which re-installs the stored bytes. Keep the one layout everywhere.
        layer.support_avx512bf16_for_cpu = False
        if linear.bias is not None:
            layer.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
        setattr(parent, child, layer.to(linear.weight.device))


# precision -> how its layers are quantized (weight-only: activations stay in the training dtype)
QUANTIZERS: dict[str, Callable[[torch.nn.Module, list[str]], None]] = {
    "int8-quanto": _quanto("qint8"),
    "int4-quanto": _quanto("qint4"),
    "int2-quanto": _quanto("qint2"),
    "fp8-quanto": _quanto("qfloat8"),
    "fp8uz-quanto": _quanto("qfloat8_e4m3fnuz"),  # the fp8 variant of AMD's accelerators
    "int8-torchao": _torchao("Int8WeightOnlyConfig"),
    "fp8-torchao": _torchao("Float8WeightOnlyConfig"),
    "nf4-bnb": _bnb_nf4,
}


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds; a quantized tensor (a tensor subclass) is counted by its inner tensors."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = flatten()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    state = getattr(tensor, "quant_state", None)  # bitsandbytes 4-bit: packed bytes + absmax per block
    extra = 0 if state is None else sum(tensor_bytes(t) for t in (state.absmax, state.code) if t is not None)
    return tensor.numel() * tensor.element_size() + extra


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers."""
    return sum(tensor_bytes(t) for t in (*module.parameters(), *module.buffers()))


def _quantized(layer: torch.nn.Module) -> bool:
    """Whether a layer's weight is a quantized one (a tensor subclass, plain or inside its Parameter)."""
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return False
    return type(weight) not in (torch.Tensor, torch.nn.Parameter) or type(weight.data) is not torch.Tensor


def _pieces(module: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.nn.Module]]:
    """(name, piece): each item of the module's ModuleLists (a transformer's blocks, a text encoder's layers, however
    deep) and each other child that holds none, but for linear layers (a piece is quantized as a module of its own:
    its linear layers are below it)."""
    out = []
    for name, child in module.named_children():
        if isinstance(child, torch.nn.ModuleList):
            out += [(f"{prefix}{name}.{sub}", item) for sub, item in child.named_children()
                    if not isinstance(item, torch.nn.Linear)]
        elif any(isinstance(m, torch.nn.ModuleList) for m in child.modules()):
            out += _pieces(child, f"{prefix}{name}.")
        elif not isinstance(child, torch.nn.Linear):
            out.append((f"{prefix}{name}", child))
    return out


def quantized_layers(module: torch.nn.Module) -> list[str]:
    """Names of the layers to quantize: every nn.Linear (the bulk of a transformer's weights)."""
    return [name for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)]


def quantize_frozen(
    module: torch.nn.Module, precision: str, via: str, device: torch.device, park: bool, emit: Callable[..., Any],
    what: str, key: str,
) -> None:
    """Quantize a frozen module's linear layers in place (nothing at 'no_change').

    via 'cpu': quantize where it was loaded (the CPU), so the accelerator never holds the full-precision
    module; 'accelerator': on the accelerator (faster on a GPU), a block at a time, so that it holds one block at
    full precision beside the quantized ones, not the whole module (Kandinsky 5 Pro's 40 GiB in bf16, with block
    streaming meant to keep it in CPU memory). `park`: leave it on the CPU afterwards. `emit`: the events' emit, for
    the memory line; `what` names the module in it, `key` the setting."""
    if precision == "no_change":
        return
    before = weight_bytes(module)
    module.requires_grad_(False)
    layers = every = quantized_layers(module)
    moved: list[torch.nn.Module] = []  # layers taken to the accelerator by themselves (parked again afterwards)
    if via == "accelerator":
        pieces = _pieces(module)
        for piece in {id(p): p for _, p in pieces}.values():  # a module registered under two names: once
            if own := quantized_layers(piece):
                piece.to(device)
                QUANTIZERS[precision](piece, own)
                if park:
                    piece.to("cpu")
        # the linear layers outside the pieces (a final projection), quantized through the module
        layers = [n for n in layers if not any(n.startswith(f"{prefix}.") for prefix, _ in pieces)]
        moved = [module.get_submodule(n) for n in layers]
        for layer in moved:
            layer.to(device)
    if layers:
        QUANTIZERS[precision](module, layers)
    if park:
        for layer in moved:
            layer.to("cpu")
        if via != "accelerator":
            module.to("cpu")
    elif via == "accelerator":
        module.to(device)  # the rest too: the run trains there
    after = weight_bytes(module)
    done = sum(map(_quantized, (module.get_submodule(name) for name in every)))  # int8-quanto keeps some (_quanto)
    emit("info", message=f"{key} {precision}: {what} weights {before / 2**20:.1f} MiB -> "
                         f"{after / 2**20:.1f} MiB ({done} of {len(every)} linear layers, "
                         f"quantized on the {'accelerator' if via == 'accelerator' else 'CPU'})",
         bytes_before=before, bytes_after=after, module=what)


def quantize_transformer(
    transformer: torch.nn.Module, precision: str, via: str, device: torch.device, park: bool,
    emit: Callable[..., Any],
) -> None:
    """Quantize the frozen transformer (base_model_precision), and let its quantized layers keep only their
    quantized weight for the backward pass (models/quantized_saves.py). `park`: offload_during_startup."""
    quantize_frozen(transformer, precision, via, device, park, emit, "transformer", "base_model_precision")
    if precision != "no_change":
        wrapped = lean_saves(transformer)
        if wrapped:
            saves = f"{wrapped} quantized linear layers keep only their quantized weight for the backward pass"
        elif precision == "nf4-bnb":
            saves = "bitsandbytes keeps only the 4-bit weight for the backward pass"
        else:  # lean_saves needs torch >= 2.8
            saves = "the backward pass keeps what the library saves (dequantized weights or layer inputs)"
        emit("info", message=f"base_model_precision {precision}: {saves}", lean_layers=wrapped)


def quantize_text_encoders(
    text: dict[str, Any], precisions: dict[str, str], names: tuple[str, ...], via: str, device: torch.device,
    emit: Callable[..., Any],
) -> None:
    """Quantize the text encoders (text_encoder_1_precision, text_encoder_2_precision) in place, right
    after loading and before any caption is encoded. `text`: the components by pipeline name; `precisions`:
    component name ('text_encoder', 'text_encoder_2') -> precision; `names`: the family's encoders, in order."""
    for index, component in enumerate(("text_encoder", "text_encoder_2")):
        if component not in precisions:
            continue
        if component not in text:  # the config check refuses this first; a model folder may still lack it
            raise ValueError(f"text_encoder_{index + 1}_precision: the model has no component {component!r}")
        label = f"text encoder {index + 1}" + (f" ({names[index]})" if index < len(names) else "")
        # parked: caching places an encoder on the accelerator only when it has captions to encode (train/caching.py)
        quantize_frozen(text[component], precisions[component], via, device, True, emit, label,
                        f"text_encoder_{index + 1}_precision")
