"""A LyCORIS network in the key layout ComfyUI loads (`lora_type: lycoris` with `lora_format: comfyui`).

difftune's LyCORIS file (`pytorch_lora_weights.safetensors`, LyCORIS's `save_weights`) names each module
`lycoris_<diffusers module path with _>`. ComfyUI maps that prefix for a few architectures only: for Kandinsky 5 it
maps nothing, and for Lumina2 it maps Z-Image's diffusers names, not Lumina2Transformer2DModel's, with q/k/v offsets
that assume as many key/value heads as query heads. So every key of that file is "lora key not loaded" there.

ComfyUI's generic map does take `diffusion_model.<its module>` for every weight of every model (`comfy/lora.py`
`model_lora_keys_unet`), and its weight adapters read LyCORIS's own tensor names after that stem: `lora_up`/
`lora_down`/`alpha` (LoCon), `hada_*` (LoHa), `lokr_*` (LoKr), `diff`/`diff_b` (a weight difference,
`comfy/lora.py` `load_lora`). So this module writes, per LyCORIS module:
- its own tensors, renamed to `diffusion_model.<ComfyUI module>.<LyCORIS name>`, for LoCon, LoHa, LoKr and full
  (its `diff`), where the ComfyUI module is one weight (the name tables of adapters/comfyui.py);
- its weight difference as `.diff` (and `.diff_b`) where ComfyUI's formula would not be LyCORIS's: a module whose
  weight ComfyUI fuses with others (Lumina2's to_q, to_k and to_v are one `attention.qkv`: the three differences
  are stacked in its rows, a projection the network does not adapt gets zero rows), GLoRA (ComfyUI has two readings of
  its tensors, told apart by shape), and weight-decomposed (DoRA) modules (LyCORIS normalises over another axis than
  ComfyUI's dora_scale).
A difference is a full-size tensor: for Lumina-Image-2.0's qkv 3840 x 2304 values per block, 30 blocks, written in
bf16 (the dtype the model is patched in), so its export is about 530 MB where the LyCORIS file is a few MB.

The network's `multiplier` is not in the file: ComfyUI's strength plays its part (strength = multiplier).
"""

from __future__ import annotations

from typing import Any

import torch

from difftune.adapters.comfyui import COMFY_PREFIX, kandinsky5_module, lumina2_module
from difftune.models.registry import FAMILY_FACTS

MODULE_OF = {"lumina2": lumina2_module, "kandinsky5": kandinsky5_module}  # by the family fact `comfyui_layout`
RENAMED = ("LoConModule", "LohaModule", "LokrModule", "FullModule")  # ComfyUI reads their tensors as LyCORIS does
DIFF_DTYPE = torch.bfloat16


def lycoris_to_comfyui(family: str, network: Any, transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ComfyUI's file for `network` (a LycorisNetwork applied to `transformer`, a diffusers model
    of `family`)."""
    module_of = MODULE_OF[FAMILY_FACTS[family].comfyui_layout]
    names = {id(m): n for n, m in transformer.named_modules()}
    saved = network.state_dict()  # what save_weights writes: `<lora_name>.<LyCORIS name>`
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for lora in network.loras:
        target, slot = module_of(names[id(lora.org_module[0])])
        own = {k[len(lora.lora_name) + 1:]: v for k, v in saved.items() if k.startswith(lora.lora_name + ".")}
        if slot is None and type(lora).__name__ in RENAMED and not getattr(lora, "wd", False):
            out |= {f"{COMFY_PREFIX}{target}.{name}": t.detach().cpu().contiguous() for name, t in own.items()}
            continue
        weight, bias = _difference(lora)
        if slot is not None:
            fused.setdefault(target, {})[slot] = weight
            continue
        out[f"{COMFY_PREFIX}{target}.diff"] = weight
        if bias is not None:
            out[f"{COMFY_PREFIX}{target}.diff_b"] = bias
    rows = _slot_rows(transformer, module_of) if fused else {}
    for target, parts in fused.items():
        width = next(iter(parts.values())).shape[1]
        stacked = [parts.get(slot, torch.zeros(size, width, dtype=DIFF_DTYPE)) for slot, size in rows[target]]
        out[f"{COMFY_PREFIX}{target}.diff"] = torch.cat(stacked).contiguous()
    return out


def _difference(lora: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A module's weight (and bias) difference at multiplier 1, as its forward adds it, in DIFF_DTYPE on the CPU.
    LoKr's and LoHa's get_diff_weight apply their scale twice (lycoris-lora 4.1.3; their forward applies it once):
    their difference is their bypass path (the forward's added term) applied to the identity."""
    with torch.no_grad():
        if type(lora).__name__ in ("FullModule", "GLoRAModule"):  # get_diff_weight is what their forward adds
            weight, bias = lora.get_diff_weight(multiplier=1)
        else:
            first = next(lora.parameters())
            eye = torch.eye(lora.org_module[0].in_features, device=first.device, dtype=first.dtype)
            weight, bias = lora.bypass_forward_diff(eye, scale=1).T, None
            if getattr(lora, "wd", False):  # weight-decomposed: the normalised merged weight minus the base
                base = lora.org_weight.to(weight.device, torch.float32)
                weight = lora.apply_weight_decompose(base + weight.float(), 1) - base
    bias = None if bias is None or not bool(bias.any()) else bias.detach().to("cpu", DIFF_DTYPE)
    return weight.detach().float().reshape(weight.shape[0], -1).to("cpu", DIFF_DTYPE), bias


def _slot_rows(transformer: torch.nn.Module, module_of: Any) -> dict[str, list[tuple[int, int]]]:
    """Each fused ComfyUI module -> [(slot, rows)] in slot order: the output widths of the diffusers modules it
    fuses (Lumina2: q, k, v)."""
    rows: dict[str, dict[int, int]] = {}
    for name, module in transformer.named_modules():
        try:
            target, slot = module_of(name)
        except ValueError:
            continue
        if slot is not None:
            rows.setdefault(target, {})[slot] = module.out_features
    return {target: sorted(slots.items()) for target, slots in rows.items()}
