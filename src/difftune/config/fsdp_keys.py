"""The FSDP keys (`fsdp_*`), mixed into TrainConfig, and their cross-key checks, called from TrainConfig's validator.

FSDP2 itself is in train/fsdp.py. What is refused here does not run there, so each message names the
key and the way out. Import-light: no torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from difftune.config.fields import field


class FsdpKeys(BaseModel):
    fsdp_enable: bool = field(
        False, "Shard the transformer's weights, gradients and optimizer state between the processes (FSDP2) "
        "instead of copying the whole model to each (DDP, the default). For models too large for one "
        "accelerator (Kandinsky 5 Video Pro); launch with `accelerate launch --num_processes N`. LoRA or full; "
        "not with use_ema, LyCORIS, a quantized base or fp16.", "memory", advanced=True,
    )
    fsdp_version: int = field(2, "FSDP version: only 2 (torch's fully_shard).", "memory", advanced=True)
    fsdp_reshard_after_forward: bool = field(
        True, "Free each block's gathered weights after its forward pass and gather them again for the backward "
        "pass (less memory, more communication); false keeps them until the backward pass.", "memory",
        advanced=True,
    )
    fsdp_state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"] = field(
        "SHARDED_STATE_DICT", "How checkpoints hold the optimizer state under FSDP: 'SHARDED_STATE_DICT' (each "
        "process writes its own shard; never gathered whole) or 'FULL_STATE_DICT' (gathered by process 0 into one "
        "file). Weights are always gathered into the usual result files.", "memory", advanced=True,
    )
    fsdp_cpu_ram_efficient_loading: bool = field(
        False, "With fsdp_enable and several processes: only process 0 reads the transformer's weights into CPU "
        "memory; the others build it empty (on the meta device) and receive their shards, and the adapter's "
        "initial weights, from process 0. False: every process loads the whole transformer, then keeps its shard.",
        "memory", advanced=True,
    )
    fsdp_transformer_layer_cls_to_wrap: list[str] | None = field(
        None, "Class names of the blocks sharded as one unit each (comma-separated on the command line). Empty: "
        "the family's transformer blocks, found in the loaded model.", "memory", advanced=True,
    )



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
