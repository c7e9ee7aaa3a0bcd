"""What trains: a peft LoRA, a LyCORIS network, or the whole transformer (full fine-tune).

The loop and checkpoints only see an `Adapter`: its trainable parameters, its state for checkpoints,
and `save(folder)` for the result a user loads (diffusers LoRA, ComfyUI LoRA, LyCORIS file, or a
diffusers transformer folder).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from difftune.adapters.casts import skip_casts_under_autocast
from difftune.adapters.dora import dense_weight, start_magnitudes
from difftune.adapters.targets import LoraTargetsError
from difftune.adapters.targets import problem as targets_problem
from difftune.config import TrainConfig
from difftune.config.lora_keys import LORA_INIT_WEIGHTS
from difftune.models.base import Family
from difftune.train.checkpointing import enable_checkpointing


class Adapter(Protocol):
    def parameters(self) -> list[torch.nn.Parameter]: ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that trains, for checkpoints (CPU tensors)."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def save(self, folder: Path) -> Path:
        """Write the result in its loadable format; returns the main file or folder."""


class LoraAdapter:
    """peft LoRA on the family's attention projections (or `lora_target_modules`); DoRA with `use_dora`
    (adapters/dora.py), its init from `lora_init_type` (config/lora_keys.py)."""

    def __init__(self, cfg: TrainConfig, family: Family, transformer: Any):
        self.cfg, self.family, self.transformer = cfg, family, transformer
        transformer.requires_grad_(False)
        targets = cfg.lora_target_modules or family.lora_target_modules
        if cfg.lora_target_modules and (problem := targets_problem(transformer, targets, cfg.model_family)):
            raise LoraTargetsError(problem)  # peft drops a name that matches nothing, or fails on a block
        with warnings.catch_warnings():
            # peft warns on every int8/fp8-torchao layer that merge() would fail; difftune never merges (the base
            # stays as loaded and the adapter is saved apart), so the warning is noise on every such run.
            warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated", category=UserWarning)
            transformer.add_adapter(LoraConfig(
                r=cfg.lora_rank, lora_alpha=cfg.effective_lora_alpha(), lora_dropout=cfg.lora_dropout,
                init_lora_weights=LORA_INIT_WEIGHTS[cfg.lora_init_type], use_dora=cfg.use_dora,
                target_modules=targets if isinstance(targets, str) else list(targets),
            ))
        self.params = [p for p in transformer.parameters() if p.requires_grad]
        for p in self.params:  # adapters train in fp32 even when the base is bf16 (DoRA's magnitudes too)
            p.data = p.data.float()
        magnitudes_loaded = self.load_lora_file(Path(cfg.init_lora)) if cfg.init_lora else False
        if cfg.use_dora and not magnitudes_loaded:
            start_magnitudes(transformer)  # adapters/dora.py: fp32, and from an init_lora's B·A
        # fp32 LoRA under bf16 autocast: peft's bf16 -> fp32 input casts, undone by autocast, are skipped (casts.py)
        self.input_casts = skip_casts_under_autocast(transformer)

    def load_lora_file(self, path: Path) -> bool:
        """Start from an existing LoRA in the diffusers layout (what `save` writes); returns whether it held
        DoRA magnitudes."""
        state = load_file(path if path.is_file() else path / "pytorch_lora_weights.safetensors")
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
        result = set_peft_model_state_dict(self.transformer, state)
        unexpected = getattr(result, "unexpected_keys", []) or []
        if unexpected:
            raise ValueError(f"init_lora {path}: {len(unexpected)} tensors match no LoRA module here "
                             f"(first: {unexpected[0]}); was it trained with other targets or another model?")
        return any("lora_magnitude_vector" in k for k in state)

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.transformer.named_parameters() if p.requires_grad}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        _copy_into(self.transformer, state)

    def save(self, folder: Path) -> Path:
        state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(self.transformer).items()}
        config = self.transformer.peft_config["default"]
        path = self.family.save_lora(folder, state, config.to_dict())
        if self.cfg.lora_format == "comfyui":
            from difftune.adapters.comfyui import save_comfyui

            prefixed = {f"transformer.{k}": v for k, v in state.items()}
            # DoRA: ComfyUI's dora_scale depends on the base weights (adapters/comfyui.py)
            base = (lambda name: dense_weight(self.transformer.get_submodule(name))) if self.cfg.use_dora else None
            # a fused qkv whose LoRA adapts to_q alone gets zero k and v rows: their width is to_k's output
            kv_dim = next((getattr(m, "out_features", None) for n, m in self.transformer.named_modules()
                           if n.endswith(".to_k")), None)
            save_comfyui(folder / "comfyui_lora.safetensors", self.cfg.model_family, prefixed,
                         config.lora_alpha, config.r, base_weight=base, kv_dim=kv_dim)
        return path  # the diffusers file is the result either way; the ComfyUI one lies beside it (cli.result_line)


class LycorisAdapter:
    """A LyCORIS network (lokr, loha, locon, ...) from the `lycoris_config` JSON file."""

    def __init__(self, cfg: TrainConfig, family: Family, transformer: Any):
        from difftune.adapters.lycoris import LycorisConfigError, attach_lycoris, unbuildable

        self.cfg, self.transformer = cfg, transformer
        self.config = json.loads(Path(cfg.lycoris_config).read_text(encoding="utf-8-sig"))
        try:
            self.network, self.params = attach_lycoris(transformer, self.config, family=cfg.model_family,
                                                       bypass=cfg.base_model_precision != "no_change")
        except (ValueError, TypeError, AssertionError, NotImplementedError) as e:
            raise LycorisConfigError(unbuildable(cfg.lycoris_config, cfg.model_family, e)) from e
        self.warnings: list[str] = self.network.difftune_warnings  # LyCORIS's own (setup emits them as events)

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def state_dict(self) -> dict[str, torch.Tensor]:
        # The live tensors by their own names: a `full` module's state_dict() holds `diff` (its weight minus the
        # base's) where its parameter is `weight`, which a resume could not copy back.
        live = dict(self.network.named_parameters())
        state = {k: v for k, v in self.network.state_dict().items() if k in live or not k.endswith((".diff", ".diff_b"))}
        state.update({n: p for n, p in live.items() if p.requires_grad and n not in state})
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        _copy_into(self.network, _full_diffs_as_weights(self.network, state))

    def save(self, folder: Path) -> Path:
        from difftune.adapters.lycoris import save_lycoris

        folder.mkdir(parents=True, exist_ok=True)
        path = save_lycoris(self.network, folder / "pytorch_lora_weights.safetensors", {"lycoris_config": self.config})
        if self.cfg.lora_format == "comfyui":  # adapters/comfyui_lycoris.py: the keys ComfyUI maps
            from difftune.adapters.comfyui_lycoris import lycoris_to_comfyui

            tensors = lycoris_to_comfyui(self.cfg.model_family, self.network, self.transformer)
            save_file(tensors, str(folder / "comfyui_lora.safetensors"),
                      metadata={"format": "pt", "difftune_family": self.cfg.model_family,
                                "lycoris_config": json.dumps(self.config)})
        return path


class FullAdapter:
    """Every transformer weight trains; the result is a diffusers transformer folder."""

    def __init__(self, cfg: TrainConfig, family: Family, transformer: Any):
        self.transformer = transformer
        transformer.requires_grad_(True)
        self.params = list(transformer.parameters())

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.transformer.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        _copy_into(self.transformer, state)

    def save(self, folder: Path) -> Path:
        target = folder / "transformer"
        self.transformer.save_pretrained(target, safe_serialization=True)
        return target


def _full_diffs_as_weights(network: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints written before LycorisAdapter.state_dict kept `full` modules' weights hold their `diff`
    (weight minus the base weight LyCORIS keeps aside): the weights again."""
    modules = dict(network.named_modules())
    out = {}
    for key, value in state.items():
        name, _, leaf = key.rpartition(".")
        base = getattr(modules.get(name), "_org_weight" if leaf == "diff" else "org_bias", None)
        if leaf in ("diff", "diff_b") and base:
            key, value = f"{name}.{'weight' if leaf == 'diff' else 'bias'}", value + base[0].to(value)
        out[key] = value
    return out


def _copy_into(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint tensors into the live parameters and buffers themselves (a module's state_dict()
    may hand out copies: LyCORIS does), checking that the checkpoint fits this adapter."""
    live = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    unknown = [k for k in state if k not in live]
    if unknown:
        raise ValueError(f"the checkpoint does not match this run's adapter ({unknown[0]} is unknown here; "
                         "different rank, targets, adapter type or model?); start a new output_dir or "
                         "restore the settings")
    missing = sorted({n for n, p in module.named_parameters() if p.requires_grad} - set(state))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} trainable tensors (first: {missing[0]}); "
                         "start a new output_dir or restore the settings")
    # DTensor (FSDP2 shard) .shape is the whole tensor's: comparable with the checkpoint's
    wrong = next(((k, tuple(v.shape), tuple(live[k].shape)) for k, v in state.items() if v.shape != live[k].shape), None)
    if wrong:
        name, saved, here = wrong
        raise ValueError(f"the checkpoint does not match this run's adapter: {name} is {list(saved)} in the checkpoint "
                         f"and {list(here)} here: lora_rank (or another setting of the adapter's size) differs from "
                         "the one the checkpoint was trained with; restore it, or start a new output_dir")
    with torch.no_grad():
        for name, value in state.items():
            target = live[name]
            if hasattr(target, "device_mesh"):  # an FSDP2 shard (DTensor): this process's part of the full tensor
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements,
                                          src_data_rank=None)
            target.copy_(value)


def build_adapter(cfg: TrainConfig, family: Family, transformer: Any) -> Adapter:
    if cfg.model_type == "full":
        adapter: Adapter = FullAdapter(cfg, family, transformer)
    elif cfg.lora_type == "lycoris":
        adapter = LycorisAdapter(cfg, family, transformer)
    else:
        adapter = LoraAdapter(cfg, family, transformer)
    if cfg.gradient_checkpointing:
        enable_checkpointing(transformer, cfg.gradient_checkpointing_interval)
    return adapter
