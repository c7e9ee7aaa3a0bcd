"""The real architecture a config trains, and its bytes at each precision, without loading a weight.

The transformer, text encoders and VAE are built on the meta device from their architecture configs: the real
ones of `bench_memory.py` for hub flavours, the folder's `transformer/config.json` for a local model (and for the
tiny flavours, which are local folders). Parameter counts and bf16 bytes follow from the meta model exactly.

Quantized bytes are measured, not guessed: every linear layer `models/quantize.py` would quantize is grouped by
(in, out, bias, dtype); one real layer of each group is quantized with the same `QUANTIZERS[precision]` and
measured with `weight_bytes`, and the model's bytes are the sum over groups plus its other tensors unchanged.
Large layers are measured at two row counts and extended linearly in rows (every scheme here stores a fixed
number of bytes per output row, plus a few scalars per layer); tests check the sum byte-exact against the whole
quantized tiny model.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from difftune import bench_memory as real
from difftune.models.registry import FAMILY_FACTS, TINY_FLAVOUR

TRANSFORMER_CLASS = {"lumina2": "Lumina2Transformer2DModel", "kandinsky5-image": "Kandinsky5Transformer3DModel",
                     "kandinsky5-video": "Kandinsky5Transformer3DModel"}
# the block stacks in execution order (models/registry.py `block_stacks`, which train/offload.py streams)
STACKS = {"lumina2": ("context_refiner", "noise_refiner", "layers"),
          "kandinsky5-image": ("text_transformer_blocks", "visual_transformer_blocks"),
          "kandinsky5-video": ("text_transformer_blocks", "visual_transformer_blocks")}
DIRECT_LIMIT = 4_000_000  # elements: a linear layer up to this size is quantized whole to measure it


@dataclass(frozen=True)
class Architecture:
    family: str
    name: str  # 'Lumina2 2.0', 'K5 Video Pro', or the folder it was read from
    config: dict[str, Any]  # the transformer's diffusers config
    known: bool  # one of the real architectures `coefficients.py` was measured on

    def __hash__(self) -> int:  # the config is a dict: hash its JSON (functools caches key on architectures)
        return hash((self.family, self.name, self.key()))

    def key(self) -> str:
        return json.dumps({k: v for k, v in sorted(self.config.items()) if not k.startswith("_")}, default=str)


def real_architecture(family: str, flavour: str) -> tuple[str, dict[str, Any]] | None:
    """(name, config) of a hub flavour's transformer, or None for a flavour without a stored config."""
    if family == "lumina2":
        return "Lumina2 2.0", dict(real.LUMINA2)
    if family == "kandinsky5-image":
        cond = FAMILY_FACTS[family].needs_conditioning(flavour)  # i2i: input latents and a mask channel
        return ("K5 Image Lite (i2i)" if cond else "K5 Image Lite"), dict(real.K5_IMAGE_LITE, visual_cond=cond)
    if family == "kandinsky5-video":
        if "-pro-" in flavour:
            return "K5 Video Pro", dict(real.K5_VIDEO_PRO)
        return "K5 Video Lite", dict(real.K5_VIDEO_LITE)
    return None


def architecture_of(cfg: Any) -> Architecture:
    """The transformer `cfg` trains: a local folder's config when there is one, else the flavour's real one."""
    family, flavour = cfg.model_family, cfg.flavour()
    folder = _transformer_folder(cfg)
    if folder is not None and (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        return Architecture(family, str(folder), config, known=False)
    found = real_architecture(family, flavour)
    if found is None:
        raise ValueError(f"no architecture config for {family} {flavour!r}; give a local model folder in "
                         "pretrained_model_name_or_path")
    return Architecture(family, found[0], found[1], known=True)


def _on_meta(spec: Any) -> torch.nn.Module:
    """bench_memory.on_meta without diffusers' notice about casting with `to()` (deliberate here: no weights)."""
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        return real.on_meta(spec)
    finally:
        diffusers_logging.set_verbosity(level)


def transformer_on_meta(arch: Architecture, **changes: Any) -> torch.nn.Module:
    """The transformer on the meta device in the dtypes `from_pretrained(torch_dtype=bf16)` gives it."""
    import diffusers

    cls = getattr(diffusers, TRANSFORMER_CLASS[arch.family])
    config = {**arch.config, **changes}
    if arch.family != "lumina2":
        config.setdefault("attention_type", "regular")
    return _on_meta(real.Spec(arch.name, lambda: cls.from_config(config)))


def transformer_before_load(cfg: Any, build_tiny: bool = True) -> torch.nn.Module | None:
    """The config's transformer on the meta device, for checks before any model loads (adapter targets, LyCORIS
    presets); None where its architecture is not known before it loads (a local folder without a config), or for a
    tiny flavour not to be built here (`build_tiny` false: several processes, where one builds it later)."""
    if not build_tiny and cfg.flavour().startswith("tiny") and not cfg.pretrained_model_name_or_path:
        return None
    try:
        return transformer_on_meta(architecture_of(cfg))
    except (ValueError, OSError):
        return None


def _random_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        layer = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=bias))
    return real.materialize(layer.to(dtype))


@functools.cache
def linear_bytes(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, precision: str) -> int:
    """Bytes of one linear layer (weight and bias) after `precision` (models/quantize.py QUANTIZERS)."""
    from difftune.models.quantize import QUANTIZERS, weight_bytes

    if precision == "no_change":
        return (in_features * out_features + (out_features if bias else 0)) * dtype.itemsize

    def measured(rows: int) -> int:
        layer = _random_linear(in_features, rows, bias, dtype)
        QUANTIZERS[precision](layer, ["0"])
        return weight_bytes(layer)

    if in_features * out_features <= DIRECT_LIMIT or out_features <= 512:
        return measured(out_features)
    small, large = measured(256), measured(512)
    per_row, rest = divmod(large - small, 256)
    if rest:  # not linear in rows: measure the layer whole
        return measured(out_features)
    return small + per_row * (out_features - 256)


def module_bytes(module: torch.nn.Module, precision: str) -> int:
    """Bytes of a meta module's tensors once its linear layers are quantized to `precision` (exact)."""
    from difftune.models.quantize import quantized_layers

    linear_names = set(quantized_layers(module))
    total = 0
    groups: dict[tuple, int] = {}
    inside: set[int] = set()
    for name in linear_names:
        layer = module.get_submodule(name)
        groups[(layer.in_features, layer.out_features, layer.bias is not None, layer.weight.dtype)] = \
            groups.get((layer.in_features, layer.out_features, layer.bias is not None, layer.weight.dtype), 0) + 1
        inside.update(id(t) for t in (layer.weight, layer.bias) if t is not None)
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in inside:
            total += t.numel() * t.element_size()
    for (i, o, b, dtype), count in groups.items():
        total += linear_bytes(i, o, b, dtype, precision) * count
    return total


@dataclass
class Blocks:
    """The block stacks of a transformer: per stack, the block count and one block's bytes and parameters."""
    count: dict[str, int]
    bytes_each: dict[str, int]  # at the precision asked for
    params_each: dict[str, int]


def blocks_of(model: torch.nn.Module, family: str, precision: str) -> Blocks:
    count, size, params = {}, {}, {}
    for stack in STACKS[family]:
        blocks = getattr(model, stack, None)
        if blocks is None or len(blocks) == 0:
            continue
        count[stack] = len(blocks)
        size[stack] = module_bytes(blocks[0], precision)
        params[stack] = sum(p.numel() for p in blocks[0].parameters())
    return Blocks(count, size, params)


# --- the other components, on meta -----------------------------------------------------------------------

CLIP_L_TEXT = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   max_position_embeddings=77, vocab_size=49408, projection_dim=768, hidden_act="quick_gelu")
# openai/clip-vit-large-patch14's text tower, which the Kandinsky 5 pipelines load as CLIPTextModel
FLUX_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False)
# the FLUX.1 VAE (Lumina-Image-2.0 and Kandinsky 5 image use it); the HunyuanVideo VAE's diffusers defaults are its
# real configuration (Kandinsky 5 video).


def text_encoders_on_meta(cfg: Any) -> list[tuple[str, torch.nn.Module]]:
    """[(label, meta module)] of the family's text encoders, in pipeline order (text_encoder, text_encoder_2)."""
    family = cfg.model_family
    folder = _local_folder(cfg)
    if folder is not None:
        return [(name, _from_folder(folder / name)) for name in ("text_encoder", "text_encoder_2")
                if (folder / name / "config.json").is_file()]
    if family == "lumina2":
        return [("Gemma2 2B", _on_meta(real.Spec("Gemma2", real.gemma2)))]

    def clip() -> torch.nn.Module:
        from transformers import CLIPTextConfig, CLIPTextModel

        return CLIPTextModel(CLIPTextConfig(**CLIP_L_TEXT))

    return [("Qwen2.5-VL 7B", _on_meta(real.Spec("Qwen", real.qwen25_vl))),
            ("CLIP-L text", _on_meta(real.Spec("CLIP", clip)))]


def _transformer_folder(cfg: Any) -> Path | None:
    """The local folder of the transformer's config.json: pretrained_transformer_model_name_or_path's (with its
    subfolder) when it is a local folder, else the main model's transformer/ (a single .safetensors file takes its
    config from there too). None: a hub model (the flavour's known architecture stands for it)."""
    own = cfg.pretrained_transformer_model_name_or_path
    if own is not None and not own.lower().endswith(".safetensors"):
        local = Path(own).expanduser()
        return (local / cfg.pretrained_transformer_subfolder if cfg.pretrained_transformer_subfolder else local) \
            if local.is_dir() else None
    folder = _local_folder(cfg)
    if folder is None:
        return None
    return folder / (cfg.pretrained_transformer_subfolder if own is None and cfg.pretrained_transformer_subfolder
                     else "transformer")


def vae_on_meta(cfg: Any) -> torch.nn.Module:
    own = cfg.pretrained_vae_model_name_or_path
    if own is not None and Path(own).expanduser().is_dir():  # a VAE from elsewhere: its vae/, else its root
        local = Path(own).expanduser()
        return _from_folder(local / "vae" if (local / "vae" / "config.json").is_file() else local)
    folder = _local_folder(cfg)
    if own is None and folder is not None and (folder / "vae" / "config.json").is_file():
        return _from_folder(folder / "vae")
    import diffusers

    if cfg.model_family == "kandinsky5-video":
        build = diffusers.AutoencoderKLHunyuanVideo
        return _on_meta(real.Spec("VAE", lambda: build()))
    return _on_meta(real.Spec("VAE", lambda: diffusers.AutoencoderKL(**FLUX_VAE)))


def _local_folder(cfg: Any) -> Path | None:
    if cfg.pretrained_model_name_or_path and Path(cfg.pretrained_model_name_or_path).expanduser().is_dir():
        return Path(cfg.pretrained_model_name_or_path).expanduser()
    if cfg.flavour().startswith(TINY_FLAVOUR) and not cfg.pretrained_model_name_or_path:
        from difftune.models import tiny_model

        return tiny_model(cfg.model_family, cfg.flavour())
    return None


def _from_folder(path: Path) -> torch.nn.Module:
    """A component folder (config.json) built on meta by the class its config names."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if "_class_name" in config:  # diffusers
        import diffusers

        cls = getattr(diffusers, config["_class_name"])
        return _on_meta(real.Spec(path.name, lambda: cls.from_config(config)))
    import transformers

    auto = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, (auto.architectures or [type(auto).__name__.replace("Config", "Model")])[0])
    return _on_meta(real.Spec(path.name, lambda: cls(auto)))
