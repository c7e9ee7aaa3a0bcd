"""Cross-key checks of block streaming (`enable_group_offload`, `group_offload_*`, `musubi_blocks_to_swap`),
called from TrainConfig's validator. The streaming itself is train/offload.py. Import-light: no torch.
"""

from __future__ import annotations

from typing import Any


def offload_checks(cfg: Any) -> None:
    """Raise ValueError for a block-streaming setting difftune cannot run."""
    swap = cfg.musubi_blocks_to_swap or 0
    if not cfg.enable_group_offload and not swap:
        return  # the group_offload_* settings act only with the switch: any value while it is off
    if cfg.enable_group_offload and swap:
        raise ValueError(f"enable_group_offload and musubi_blocks_to_swap {swap} are two ways of streaming blocks; "
                         "keep one (enable_group_offload streams every block, musubi_blocks_to_swap the last N)")
    if cfg.enable_group_offload and cfg.group_offload_type == "leaf_level":
        raise ValueError("not implemented yet: group_offload_type 'leaf_level' (moving each layer on its own); "
                         "use group_offload_type 'block_level'")
    if cfg.enable_group_offload and cfg.group_offload_to_disk_path not in (None, ""):
        raise ValueError("not implemented yet: group_offload_to_disk_path (streaming the weights from disk); "
                         "remove it: the streamed weights are kept in CPU memory")
    key = "enable_group_offload" if cfg.enable_group_offload else "musubi_blocks_to_swap"
    if getattr(cfg, "enable_model_cpu_offload", False):  # the specs: never combine them
        raise ValueError(f"{key} and enable_model_cpu_offload cannot be combined (block streaming already keeps the "
                         "transformer's blocks in CPU memory); set enable_model_cpu_offload to false")
    if cfg.model_type == "full":
        raise ValueError(f"{key} with model_type 'full' is not supported: only frozen weights stream, and a full "
                         f"fine-tune trains every weight; use model_type 'lora', or turn {key} off")

