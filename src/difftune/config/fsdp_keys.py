"""Cross-key checks of the FSDP keys (`fsdp_*`), called from TrainConfig's validator.

FSDP2 itself is in train/fsdp.py. What is refused here does not run there, so each message names the
key and the way out. Import-light: no torch.
"""

from __future__ import annotations

from typing import Any


def fsdp_checks(cfg: Any) -> None:
    """Raise ValueError for an FSDP setting difftune cannot run."""
    if cfg.fsdp_version != 2:
        raise ValueError(f"fsdp_version {cfg.fsdp_version}: only FSDP2 (torch's fully_shard) is implemented; "
                         "set fsdp_version to 2 (FSDP1 is deprecated in torch)")
    if cfg.fsdp_cpu_ram_efficient_loading and not cfg.fsdp_enable:
        raise ValueError("fsdp_cpu_ram_efficient_loading acts only with FSDP (process 0 reads the transformer's "
                         "weights and sends every other process its shard); set fsdp_enable true and launch "
                         "several processes, or set fsdp_cpu_ram_efficient_loading false")
    if not cfg.fsdp_enable:
        return
    if cfg.use_ema:
        raise ValueError("use_ema with fsdp_enable is not supported: the EMA copy would have to be sharded "
                         "like the weights; turn off use_ema, or fsdp_enable (DDP keeps the EMA)")
    if cfg.model_type == "lora" and cfg.lora_type == "lycoris":
        raise ValueError("lora_type 'lycoris' with fsdp_enable is not supported: the LyCORIS network lives "
                         "outside the transformer's modules, so FSDP would not synchronise its gradients; use "
                         "lora_type 'standard', or fsdp_enable false (DDP)")
    if cfg.base_model_precision != "no_change":
        raise ValueError(f"base_model_precision {cfg.base_model_precision!r} with fsdp_enable is not supported: "
                         "quantized weights cannot be sharded as DTensors; use base_model_precision 'no_change' "
                         "(FSDP already divides the weights' memory by the number of processes), or DDP")
    others = [k for k in ("enable_group_offload", "musubi_blocks_to_swap", "tread_config") if getattr(cfg, k, None)]
    if others:
        raise ValueError(f"{', '.join(others)} with fsdp_enable is not supported: both change how the transformer's "
                         "blocks run; FSDP already divides the weights' memory by the number of processes. Remove "
                         f"{' and '.join(others)}, or set fsdp_enable false")
    if cfg.mixed_precision == "fp16":
        raise ValueError("mixed_precision 'fp16' with fsdp_enable is not supported (loss scaling over sharded "
                         "gradients is not implemented); use mixed_precision 'bf16'")
