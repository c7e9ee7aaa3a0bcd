"""Convert a difftune LoRA (diffusers layout) into the key layout ComfyUI loads without any conversion.

difftune saves LoRAs with `<Pipeline>.save_lora_weights`: keys `transformer.<module>.lora_A.weight` /
`.lora_B.weight` (peft names), the LoRA alpha only in the safetensors metadata (`lora_adapter_metadata`, a JSON
object with keys `transformer.lora_alpha`, `transformer.r`, ... written by diffusers' `LoraBaseMixin.write_lora_layers`).

ComfyUI (Comfy-Org/ComfyUI, formerly comfyanonymous/ComfyUI) loads a LoRA file as follows (`comfy/sd.py`
`load_lora_for_models`): `comfy.lora.model_lora_keys_unet` builds a map from LoRA key stems to model weights; for every
model weight `diffusion_model.<module>.weight` it maps the stem `diffusion_model.<module>` to it (the "generic lora
format"). `comfy.lora_convert.convert_lora` leaves such keys alone, and `comfy.lora.load_lora` reads, per stem `x`,
`x.alpha` and the first of `x.lora_up.weight`/`x.lora_down.weight`, `x_lora.up.weight`, `x.lora_B.weight`/`x.lora_A.weight`,
... (`comfy/weight_adapter/lora.py`, `LoRAAdapter.load`). The patch is
`W += strength * (alpha / lora_down.shape[0]) * (lora_up @ lora_down).reshape(W.shape)`
(`LoRAAdapter.calculate_weight`; without an `.alpha` key the scale is 1.0). Keys nothing maps are logged as
"lora key not loaded" and ignored.

So this module writes, for every adapted module, `diffusion_model.<ComfyUI module>.lora_up.weight`,
`.lora_down.weight` and `.alpha` (a 0-d float32 tensor) with `alpha = scale * lora_down.shape[0]`, where
`scale = lora_alpha / r` is peft's. `lora_up/lora_down` is the first naming ComfyUI's loader tries (the kohya one);
`lora_B/lora_A` would load too, and either way the `.alpha` key is what carries the scale.

Why not the diffusers keys themselves:
- Lumina2: ComfyUI's Lumina2 branch of `model_lora_keys_unet` maps diffusers-style keys through
  `comfy.utils.z_image_to_diffusers`, which is written for Z-Image (`ZImageTransformer2DModel`): its names are
  `layers.N.attention.to_q`, not Lumina2Transformer2DModel's `layers.N.attn.to_q`, so a difftune Lumina2 LoRA matches
  nothing; and its q/k/v row offsets are `(0, dim)`, `(dim, dim)`, `(2*dim, dim)`, i.e. they assume as many key/value
  heads as query heads, while Lumina-Image-2.0 uses grouped-query attention (24 heads, 8 kv heads: q has 2304 rows,
  k and v 768 each; see diffusers' `convert_lumina2_to_diffusers`). ComfyUI's NextDiT keeps one fused
  `attention.qkv` Linear with rows [q | k | v] (`comfy/ldm/lumina/model.py`, `JointAttention`), so the three LoRAs
  are written as one LoRA of that weight (below).
- Kandinsky 5: ComfyUI's Kandinsky5 module names equal diffusers' (both come from the original Kandinsky 5 code), and
  its branch of `model_lora_keys_unet` also maps `transformer.<module>`, so the diffusers keys would load, but the alpha
  (in the metadata only) would be lost: ComfyUI would apply the LoRA at scale 1 instead of `lora_alpha / r`.

Key mapping, Lumina2 (diffusers `Lumina2Transformer2DModel` -> ComfyUI `comfy.ldm.lumina.model.NextDiT`); `B.N` is
`layers.N`, `noise_refiner.N` or `context_refiner.N` (same index on both sides); the names are the inverse of diffusers'
`convert_lumina2_to_diffusers` (`diffusers/loaders/single_file_utils.py`), which a test checks:

| diffusers module                                 | ComfyUI module (after `diffusion_model.`)  | how                          |
|--------------------------------------------------|--------------------------------------------|------------------------------|
| `B.N.attn.to_q`                                  | `B.N.attention.qkv`                        | rows `[0, q)` of the fused   |
| `B.N.attn.to_k`                                  | `B.N.attention.qkv`                        | rows `[q, q + kv)`           |
| `B.N.attn.to_v`                                  | `B.N.attention.qkv`                        | rows `[q + kv, q + 2 kv)`    |
| `B.N.attn.to_out.0`                              | `B.N.attention.out`                        | renamed                      |
| `B.N.feed_forward.linear_1` / `linear_2` / `linear_3` | `B.N.feed_forward.w1` / `w2` / `w3`   | renamed                      |
| `B.N.norm1.linear` (layers, noise_refiner)       | `B.N.adaLN_modulation.1`                   | renamed                      |
| `x_embedder`                                     | `x_embedder`                               | same                         |
| `time_caption_embed.timestep_embedder.linear_1` / `linear_2` | `t_embedder.mlp.0` / `t_embedder.mlp.2` | renamed            |
| `time_caption_embed.caption_embedder.1`          | `cap_embedder.1`                           | renamed                      |
| `norm_out.linear_1`                              | `final_layer.adaLN_modulation.1`           | renamed                      |
| `norm_out.linear_2`                              | `final_layer.linear`                       | renamed                      |

(q = n_heads * head_dim = the model width; kv = n_kv_heads * head_dim.) The fused LoRA of `attention.qkv`: with
`A_i` (r x in), `B_i` (out_i x r) and scale `s` for i in q, k, v, `lora_down = cat(A_q, A_k, A_v)` (3r x in),
`lora_up = blockdiag(B_q, B_k, B_v)` ((q + 2 kv) x 3r) and `alpha = s * 3r`; ComfyUI's patch is then
`s * [B_q A_q; B_k A_k; B_v A_v]`, exactly the three diffusers deltas stacked in the fused layout. A projection the
LoRA does not adapt gets zero rows in `lora_up` (and no rows in `lora_down`).

Key mapping, Kandinsky 5 image and video (diffusers `Kandinsky5Transformer3DModel` -> ComfyUI `comfy.ldm.kandinsky5.model.Kandinsky5`):
the same name:

| diffusers module = ComfyUI module (after `diffusion_model.`)                                  |
|-----------------------------------------------------------------------------------------------|
| `visual_transformer_blocks.N.self_attention.{to_query,to_key,to_value,out_layer}`            |
| `visual_transformer_blocks.N.cross_attention.{to_query,to_key,to_value,out_layer}`           |
| `visual_transformer_blocks.N.{feed_forward.in_layer,feed_forward.out_layer,visual_modulation.out_layer}` |
| `text_transformer_blocks.N.self_attention.{to_query,to_key,to_value,out_layer}`              |
| `text_transformer_blocks.N.{feed_forward.in_layer,feed_forward.out_layer,text_modulation.out_layer}` |
| `{time_embeddings.in_layer,time_embeddings.out_layer,text_embeddings.in_layer,pooled_text_embeddings.in_layer,visual_embeddings.in_layer,out_layer.modulation.out_layer,out_layer.out_layer}` |

A module outside these tables raises `ValueError` rather than writing a key ComfyUI would skip.

DoRA (`use_dora`). peft keeps one magnitude per output row, `m` ([out], key `<module>.lora_magnitude_vector`), and
computes `W' = m / |W + s·B·A| · (W + s·B·A)` with row norms. ComfyUI reads `<stem>.dora_scale` beside the LoRA
(`comfy/lora.py` `load_lora`) and, when it is present, `LoRAAdapter.calculate_weight` hands the merged weight to
`weight_decompose` (`comfy/weight_adapter/base.py`, as of 2026). That function picks the axis by shape: a dora_scale
whose first dimension is W's output size is per output row, otherwise per input column (LyCORIS's old layout, [1, in],
normalised over the output axis, which peft's magnitudes cannot be expressed in). On the output axis it computes
`W' = (W + s·B·A) · dora_scale / (|W| + eps)`: the norm of the *base* weight W, not of W + s·B·A as LyCORIS and peft
do (reported as a bug, Comfy-Org/ComfyUI PR #15458, open); eps is `finfo(float32).eps`, since ComfyUI patches fp32
copies of the weights. It also divides a 1-D dora_scale [out] by the [out, 1] norms, which broadcasts to [out, out]
(issue #12938, PR #13011, open). So difftune writes `dora_scale` as [out, 1] fp32 with
`dora_scale = m · (|W| + eps) / |W + s·B·A|`, which makes ComfyUI's output-axis patch equal peft's W' exactly; it
needs the base weights, so the export is made while the model is at hand (`LoraAdapter.save`, `base_weight`), and
`convert_file` refuses a DoRA file. Should ComfyUI adopt PR #15458, `dora_scale` must become `m` itself. For
Lumina2's fused qkv the three projections' rows are stacked like their LoRAs; a projection the LoRA does not adapt gets
`|W| + eps`, which leaves its rows unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune.models.registry import FAMILY_FACTS

COMFY_PREFIX = "diffusion_model."
DIFFUSERS_PREFIX = "transformer."
# diffusers' `LORA_ADAPTER_METADATA_KEY` (diffusers/loaders/lora_base.py); its JSON has keys "transformer.<field>".
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"
# DoRA: peft's magnitude key (after get_peft_model_state_dict), and the epsilon ComfyUI adds to the row norms: it
# patches weights in fp32 (model_patcher: the weight is copied to torch.float32 before calculate_weight).
MAGNITUDE_SUFFIX = ".lora_magnitude_vector"
COMFY_NORM_EPS = torch.finfo(torch.float32).eps
BaseWeight = Callable[[str], torch.Tensor]  # diffusers module name -> the base model's weight [out, in]

# --- Lumina2 -----------------------------------------------------------------------------------------------------
# ComfyUI names from Comfy-Org/ComfyUI comfy/ldm/lumina/model.py (NextDiT, JointTransformerBlock, JointAttention,
# FeedForward, FinalLayer, TimestepEmbedder from comfy/ldm/modules/diffusionmodules/mmdit.py); diffusers names are
# those that diffusers' convert_lumina2_to_diffusers produces from them.
_LUMINA2_BLOCK = re.compile(r"^(layers|noise_refiner|context_refiner)\.(\d+)\.(.+)$")
_LUMINA2_QKV = {"attn.to_q": 0, "attn.to_k": 1, "attn.to_v": 2}
_LUMINA2_IN_BLOCK = {
    "attn.to_out.0": "attention.out",
    "feed_forward.linear_1": "feed_forward.w1",
    "feed_forward.linear_2": "feed_forward.w2",
    "feed_forward.linear_3": "feed_forward.w3",
    "norm1.linear": "adaLN_modulation.1",  # context_refiner blocks have no modulation (norm1 is a plain RMSNorm)
}
_LUMINA2_TOP = {
    "x_embedder": "x_embedder",
    "time_caption_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_caption_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_caption_embed.caption_embedder.1": "cap_embedder.1",
    "norm_out.linear_1": "final_layer.adaLN_modulation.1",
    "norm_out.linear_2": "final_layer.linear",
}

# --- Kandinsky 5 -------------------------------------------------------------------------------------------------
# Linear modules of Comfy-Org/ComfyUI comfy/ldm/kandinsky5/model.py (Kandinsky5, TransformerEncoderBlock,
# TransformerDecoderBlock, SelfAttention/CrossAttention, FeedForward, Modulation, OutLayer, *Embeddings); diffusers'
# Kandinsky5Transformer3DModel uses the same names.
_K5_ATTN = r"(to_query|to_key|to_value|out_layer)"
_KANDINSKY5_MODULE = re.compile(
    "^(?:"
    rf"visual_transformer_blocks\.\d+\.(?:self_attention|cross_attention)\.{_K5_ATTN}"
    r"|visual_transformer_blocks\.\d+\.(?:feed_forward\.in_layer|feed_forward\.out_layer|visual_modulation\.out_layer)"
    rf"|text_transformer_blocks\.\d+\.self_attention\.{_K5_ATTN}"
    r"|text_transformer_blocks\.\d+\.(?:feed_forward\.in_layer|feed_forward\.out_layer|text_modulation\.out_layer)"
    r"|time_embeddings\.in_layer|time_embeddings\.out_layer|text_embeddings\.in_layer"
    r"|pooled_text_embeddings\.in_layer|visual_embeddings\.in_layer|out_layer\.modulation\.out_layer|out_layer\.out_layer"
    ")$"
)


def lumina2_module(name: str) -> tuple[str, int | None]:
    """ComfyUI module of a diffusers Lumina2 module, and its slot in the fused qkv (0, 1, 2) or None."""
    if name in _LUMINA2_TOP:
        return _LUMINA2_TOP[name], None
    m = _LUMINA2_BLOCK.match(name)
    if m:
        group, index, rest = m.groups()
        prefix = f"{group}.{index}."
        if rest in _LUMINA2_QKV:
            return prefix + "attention.qkv", _LUMINA2_QKV[rest]
        if rest in _LUMINA2_IN_BLOCK and not (group == "context_refiner" and rest == "norm1.linear"):
            return prefix + _LUMINA2_IN_BLOCK[rest], None
    raise ValueError(f"no ComfyUI Lumina2 (NextDiT) module for diffusers module {name!r}")


def kandinsky5_module(name: str) -> tuple[str, int | None]:
    """ComfyUI module of a diffusers Kandinsky 5 module (the same name); never fused."""
    if _KANDINSKY5_MODULE.match(name):
        return name, None
    raise ValueError(f"no ComfyUI Kandinsky5 module for diffusers module {name!r}")


def lora_pairs(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{diffusers module: (lora_A, lora_B)} from a peft state dict, with or without the `transformer.` prefix."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        name = key[len(DIFFUSERS_PREFIX):] if key.startswith(DIFFUSERS_PREFIX) else key
        if name.endswith(MAGNITUDE_SUFFIX):
            continue  # DoRA's magnitudes: see `dora_magnitudes`
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                pairs.setdefault(name[: -len(suffix)], {})[part] = value
                break
        else:
            raise ValueError(f"unsupported LoRA key {key!r}: only LoRA (lora_A/lora_B weights) and DoRA "
                             "(lora_magnitude_vector) convert")
    incomplete = sorted(n for n, p in pairs.items() if len(p) != 2)
    if incomplete:
        raise ValueError(f"LoRA modules without both lora_A and lora_B: {incomplete}")
    return {n: (p["lora_A"], p["lora_B"]) for n, p in sorted(pairs.items())}


def dora_magnitudes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{diffusers module: DoRA magnitude (one per output row)} from a peft state dict; empty for a plain LoRA."""
    out = {}
    for key, value in state_dict.items():
        name = key[len(DIFFUSERS_PREFIX):] if key.startswith(DIFFUSERS_PREFIX) else key
        if name.endswith(MAGNITUDE_SUFFIX):
            out[name[: -len(MAGNITUDE_SUFFIX)]] = value
    return out


def dora_scale(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
               magnitude: torch.Tensor | None) -> torch.Tensor:
    """ComfyUI's `dora_scale` ([out, 1], fp32) that makes its output-axis DoRA patch (see the module's docstring)
    give peft's W' = m / |W + s·B·A| · (W + s·B·A); rows without a magnitude (a projection of a fused layer that
    the LoRA does not adapt) get the factor 1."""
    base = base.float()
    divisor = torch.linalg.norm(base, dim=1) + COMFY_NORM_EPS
    if magnitude is None:
        return divisor.unsqueeze(1)
    merged = base + scale * (b.float() @ a.float())
    return (magnitude.float() * divisor / torch.linalg.norm(merged, dim=1)).unsqueeze(1)


def _convert(
    state_dict: Mapping[str, torch.Tensor], alpha: float, rank: int,
    module_of: Callable[[str], tuple[str, int | None]], kv_dim: int | None = None,
    base_weight: BaseWeight | None = None,
) -> dict[str, torch.Tensor]:
    scale = float(alpha) / int(rank)
    magnitudes = dora_magnitudes(state_dict)
    pairs = lora_pairs(state_dict)
    if magnitudes:
        if base_weight is None:
            raise ValueError("a DoRA LoRA (lora_magnitude_vector) converts only with the base model's weights "
                             "(base_weight): ComfyUI's dora_scale depends on them")
        unpaired = sorted(set(pairs) ^ set(magnitudes))
        if unpaired:
            raise ValueError(f"DoRA modules without both a LoRA and a magnitude: {unpaired}")
    singles: dict[str, tuple[str, torch.Tensor, torch.Tensor]] = {}
    fused: dict[str, dict[int, tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for name, (a, b) in pairs.items():
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{name}: LoRA rank {a.shape[0]} differs from rank={rank} (rank_pattern is not supported)")
        target, slot = module_of(name)
        if slot is None:
            singles[target] = (name, a, b)
        else:
            fused.setdefault(target, {})[slot] = (name, a, b)

    out: dict[str, torch.Tensor] = {}

    def write(target: str, down: torch.Tensor, up: torch.Tensor, dora: torch.Tensor | None) -> None:
        stem = COMFY_PREFIX + target
        out[f"{stem}.lora_up.weight"] = up.contiguous()
        out[f"{stem}.lora_down.weight"] = down.contiguous()
        # ComfyUI scales by alpha / lora_down.shape[0]: store the alpha that gives peft's scale for this down matrix.
        out[f"{stem}.alpha"] = torch.tensor(scale * down.shape[0], dtype=torch.float32)
        if dora is not None:
            out[f"{stem}.dora_scale"] = dora.contiguous()

    def dora_of(name: str, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
        assert base_weight is not None
        return dora_scale(base_weight(name), a, b, scale, magnitudes.get(name) if a is not None else None)

    for target, (name, a, b) in singles.items():
        write(target, a, b, dora_of(name, a, b) if magnitudes else None)
    for target, pieces in fused.items():
        down, up = _fuse_qkv(target, {slot: (a, b) for slot, (_, a, b) in pieces.items()}, kv_dim)
        dora = None
        if magnitudes:  # the fused layer's rows are q, k, v in turn: their dora_scale rows are stacked alike
            names = _qkv_names(next(iter(pieces.values()))[0])
            dora = torch.cat([dora_of(names[s], *pieces[s][1:]) if s in pieces else dora_of(names[s])
                              for s in range(3)])
        write(target, down, up, dora)
    return dict(sorted(out.items()))


def _qkv_names(name: str) -> list[str]:
    """The diffusers to_q, to_k, to_v modules of the block that `name` (one of them) belongs to."""
    prefix = name[: name.rindex("attn.")]
    return [prefix + suffix for suffix in sorted(_LUMINA2_QKV, key=_LUMINA2_QKV.__getitem__)]


def _fuse_qkv(
    target: str, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]], kv_dim: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_down, lora_up) of a fused [q | k | v] Linear from the LoRAs of the separate projections."""
    any_a = next(iter(pieces.values()))[0]
    # Lumina2 (diffusers Attention and ComfyUI JointAttention): q has n_heads * head_dim = dim rows, the input width.
    q_dim = any_a.shape[1]
    kv_sizes = {pieces[s][1].shape[0] for s in (1, 2) if s in pieces}
    if len(kv_sizes) > 1:
        raise ValueError(f"{target}: to_k and to_v LoRAs have different output sizes {sorted(kv_sizes)}")
    kv = kv_sizes.pop() if kv_sizes else kv_dim
    if kv is None:
        raise ValueError(f"{target}: the LoRA adapts neither to_k nor to_v; pass kv_dim (n_kv_heads * head_dim)")
    if 0 in pieces and pieces[0][1].shape[0] != q_dim:
        raise ValueError(f"{target}: to_q LoRA has {pieces[0][1].shape[0]} output rows, expected {q_dim}")
    sizes = (q_dim, kv, kv)
    present = sorted(pieces)
    down = torch.cat([pieces[s][0] for s in present], dim=0)
    up = torch.zeros(sum(sizes), down.shape[0], dtype=any_a.dtype, device=any_a.device)
    col = 0
    for s in present:
        b = pieces[s][1]
        row = sum(sizes[:s])
        up[row: row + sizes[s], col: col + b.shape[1]] = b
        col += b.shape[1]
    return down, up


def lumina2_to_comfyui(
    state_dict: Mapping[str, torch.Tensor], alpha: float, rank: int, *, kv_dim: int | None = None,
    base_weight: BaseWeight | None = None,
) -> dict[str, torch.Tensor]:
    """A difftune Lumina2 LoRA (peft/diffusers keys) as ComfyUI NextDiT keys; to_q/to_k/to_v fuse into attention.qkv.
    `kv_dim` (n_kv_heads * head_dim) is only needed when a block adapts to_q alone; `base_weight` only for DoRA."""
    return _convert(state_dict, alpha, rank, lumina2_module, kv_dim, base_weight)


def kandinsky5_to_comfyui(state_dict: Mapping[str, torch.Tensor], alpha: float, rank: int, *,
                          kv_dim: int | None = None, base_weight: BaseWeight | None = None) -> dict[str, torch.Tensor]:
    """A difftune Kandinsky 5 LoRA (peft/diffusers keys) as ComfyUI Kandinsky5 keys (same module names; q, k and v
    stay apart, so `kv_dim` is not needed)."""
    return _convert(state_dict, alpha, rank, kandinsky5_module, base_weight=base_weight)


# By the family fact `comfyui_layout` (models/registry.py): Kandinsky 5 image and video share one.
TO_COMFYUI: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "lumina2": lumina2_to_comfyui,
    "kandinsky5": kandinsky5_to_comfyui,
}


def to_comfyui(family: str, state_dict: Mapping[str, torch.Tensor], alpha: float, rank: int, *,
               kv_dim: int | None = None, base_weight: BaseWeight | None = None) -> dict[str, torch.Tensor]:
    """Convert for a difftune family (`lumina2`, `kandinsky5-image`, `kandinsky5-video`); `base_weight(diffusers
    module name)` gives the base model's weight, needed for a DoRA LoRA only; `kv_dim` (the width of to_k's output)
    for a Lumina2 LoRA that adapts to_q but neither to_k nor to_v."""
    facts = FAMILY_FACTS.get(family)
    if facts is None or facts.comfyui_layout not in TO_COMFYUI:
        known = sorted(name for name, f in FAMILY_FACTS.items() if f.comfyui_layout in TO_COMFYUI)
        raise ValueError(f"no ComfyUI conversion for family {family!r}; known: {known}")
    return TO_COMFYUI[facts.comfyui_layout](state_dict, alpha, rank, kv_dim=kv_dim, base_weight=base_weight)


def read_diffusers_lora(path: str | Path) -> tuple[dict[str, torch.Tensor], float, int]:
    """(state dict, lora_alpha, r) of a LoRA file written by `<Pipeline>.save_lora_weights` with
    `transformer_lora_adapter_metadata` (what difftune's `Family.save_lora` writes)."""
    path = Path(path)
    if path.is_dir():
        path = path / "pytorch_lora_weights.safetensors"
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(DIFFUSERS_METADATA_KEY)
    if not raw:
        raise ValueError(f"{path} has no {DIFFUSERS_METADATA_KEY!r} metadata: its LoRA alpha is unknown; "
                         "call to_comfyui with alpha and rank instead")
    meta = json.loads(raw)
    config = {k[len(DIFFUSERS_PREFIX):]: v for k, v in meta.items() if k.startswith(DIFFUSERS_PREFIX)}
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"{path}: {key} is not supported by the ComfyUI conversion")
    if config.get("use_rslora"):
        raise ValueError(f"{path}: rsLoRA adapters are not supported by the ComfyUI conversion")
    if config.get("use_dora"):
        raise ValueError(f"{path}: a DoRA adapter converts only with the base model's weights (ComfyUI's dora_scale "
                         "depends on them): train with lora_format 'comfyui', or call to_comfyui with base_weight")
    return load_file(str(path)), float(config["lora_alpha"]), int(config["r"])


def save_comfyui(
    path: str | Path, family: str, state_dict: Mapping[str, torch.Tensor], alpha: float, rank: int,
    metadata: Mapping[str, Any] | None = None, base_weight: BaseWeight | None = None, kv_dim: int | None = None,
) -> Path:
    """Convert and write a ComfyUI LoRA file (safetensors); returns its path."""
    tensors = to_comfyui(family, state_dict, alpha, rank, kv_dim=kv_dim, base_weight=base_weight)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "difftune_family": family, "lora_alpha": str(alpha), "lora_rank": str(rank)}
    meta.update({str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()})
    save_file(tensors, str(path), metadata=meta)
    return path


def convert_file(src: str | Path, dst: str | Path, family: str) -> Path:
    """A saved difftune LoRA (file or folder) -> a ComfyUI LoRA file at `dst`."""
    state_dict, alpha, rank = read_diffusers_lora(src)
    return save_comfyui(dst, family, state_dict, alpha, rank)
