"""The offload keys, mixed into TrainConfig, and their cross-key checks, called from TrainConfig's validator: block
streaming (`enable_group_offload`, `group_offload_*`, `musubi_blocks_to_swap`: train/offload.py), activation offload
(`gradient_checkpointing_backend`: train/activation_offload.py) and optimizer offload
(`optimizer_cpu_offload_method`: train/optimizer_offload.py). Import-light: no torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, field_validator

from difftune.config.fields import field


class OffloadKeys(BaseModel):
    enable_group_offload: bool = field(
        False, "Stream the transformer's blocks: the frozen base weights of every block live in CPU memory and are "
        "copied to the accelerator one group of blocks at a time, in the forward and again (last to first) in the "
        "backward pass; at most 2 groups (the running one and the next) are there at once. Embedders, norms, the "
        "final layer and the adapter stay resident. For 16-24 GB cards; pairs well with gradient_checkpointing "
        "(which bounds the memory of the backward pass too). LoRA and LyCORIS, not a full fine-tune; never with "
        "enable_model_cpu_offload.", "memory",
    )
    group_offload_type: Literal["block_level", "leaf_level"] = field(
        "block_level", "With enable_group_offload: what moves as one piece. 'block_level' (groups of "
        "group_offload_blocks_per_group transformer blocks) is the one implemented.", "memory", advanced=True,
    )
    group_offload_blocks_per_group: int = field(
        1, "With enable_group_offload: transformer blocks per group (more: fewer, larger copies; the accelerator "
        "holds up to twice this many blocks).", "memory", ge=1, advanced=True,
    )
    group_offload_use_stream: bool = field(
        False, "With enable_group_offload: copy the next group while the current one computes (a side CUDA "
        "stream, from pinned memory); off, each group is copied when it is needed. Accepted without CUDA, where "
        "the copies simply run in turn (synchronously).", "memory", advanced=True,
    )
    group_offload_to_disk_path: str | None = field(
        None, "Offloading the streamed weights to disk instead of CPU memory is not implemented yet: leave empty "
        "(the weights stay in CPU memory).", "memory", advanced=True,
    )
    musubi_blocks_to_swap: int | None = field(
        None, "SimpleTuner's block swap: stream only the last N blocks of the main block stack (Lumina2 'layers', "
        "Kandinsky 5 'visual_transformer_blocks') one block at a time with the next one prefetched; the other "
        "blocks stay resident. A larger N saves more memory and costs more copying; N above the stack's size "
        "streams the whole stack. Empty or 0: off. An alternative to enable_group_offload (not both).", "memory",
        ge=0, advanced=True,
    )
    gradient_checkpointing_backend: Literal["torch", "unsloth"] = field(
        "torch", "With gradient_checkpointing: where each checkpointed block's input (the hidden states, what "
        "checkpointing keeps for the backward pass) waits. 'torch': on the accelerator. 'unsloth' (SimpleTuner's "
        "name): in CPU memory, copied out on a side CUDA stream as the forward goes and back one block ahead of the "
        "backward pass, so the accelerator holds about two blocks' inputs instead of one per block: at video sizes "
        "most of a checkpointed run's peak. Costs pinned CPU memory of that size and PCIe traffic that overlaps "
        "the compute. Without CUDA it runs synchronously and saves nothing.", "memory", advanced=True,
    )
    optimizer_cpu_offload_method: Literal["none", "cpu"] = field(
        "none", "'cpu': the optimizer's state and its step live in CPU memory. Each step copies the (reduced and "
        "clipped) gradients there, runs the chosen optimizer on the CPU and copies the weights back, so the "
        "accelerator never holds the state: for a full fine-tune (AdamW's state is 2-3x the weights), at the cost "
        "of a slower step (the CPU's optimizer step and PCIe copies). Costs pinned CPU memory of twice the trained "
        "weights plus the state. Not with fsdp_enable (it shards the state instead), mixed_precision fp16 or "
        "adamw_schedulefree. Without CUDA it runs with plain copies and saves nothing. SimpleTuner's key (it only "
        "has 'none').", "memory", advanced=True,
    )

    optimizer_offload_gradients: bool = field(
        False, "With optimizer_cpu_offload_method 'cpu': each gradient is copied to CPU memory as the backward pass "
        "makes it and freed on the accelerator, which then never holds the gradients either (for a full "
        "fine-tune, the size of the weights again); clipping runs on the CPU copies. One micro-batch per step "
        "(gradient_accumulation_steps 1) on one process only, since the gradients leave before they could be "
        "accumulated or averaged.", "memory", advanced=True,
    )

    @field_validator("optimizer_cpu_offload_method", mode="before")
    @classmethod
    def _no_offload_method(cls, value: Any) -> Any:
        return "none" if value is None else value



def offload_notes(cfg: Any) -> list[str]:
    """group_offload_* set to something else than its default while enable_group_offload is off: it streams nothing
    (SimpleTuner's configure tool writes their defaults into every config, which say nothing)."""
    if cfg.enable_group_offload:
        return []
    keys = ("group_offload_type", "group_offload_blocks_per_group", "group_offload_use_stream",
            "group_offload_to_disk_path")
    fields = type(cfg).model_fields
    unused = [k for k in keys if k in cfg.model_fields_set and getattr(cfg, k) not in (fields[k].default, "")]
    return [f"{k} not used: enable_group_offload is off, so no block is streamed; set enable_group_offload to true "
            "(or remove it)" for k in unused]


def offload_checks(cfg: Any) -> None:
    """Raise ValueError for a block-streaming or activation-offload setting difftune cannot run."""
    if cfg.gradient_checkpointing_backend == "unsloth":
        if not cfg.gradient_checkpointing:
            raise ValueError("gradient_checkpointing_backend 'unsloth' offloads the inputs that gradient checkpointing "
                             "keeps; set gradient_checkpointing to true, or gradient_checkpointing_backend to 'torch'")
    if cfg.optimizer_cpu_offload_method == "cpu":
        optimizer_offload_checks(cfg)
    elif cfg.optimizer_offload_gradients:
        raise ValueError("optimizer_offload_gradients sends the gradients to an optimizer that steps in CPU memory; "
                         "set optimizer_cpu_offload_method to 'cpu' too, or remove optimizer_offload_gradients")
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



def optimizer_offload_checks(cfg: Any) -> None:
    """optimizer_cpu_offload_method 'cpu' with settings it cannot serve."""
    if getattr(cfg, "fsdp_enable", False):
        raise ValueError("optimizer_cpu_offload_method 'cpu' and fsdp_enable: FSDP already divides the optimizer "
                         "state between the processes; keep one (set optimizer_cpu_offload_method to 'none')")
    if cfg.mixed_precision == "fp16":
        raise ValueError("optimizer_cpu_offload_method 'cpu' with mixed_precision 'fp16': the loss scaler unscales "
                         "the gradients through the optimizer's own (CPU) weights; use mixed_precision 'bf16', or "
                         "set optimizer_cpu_offload_method to 'none'")
    if cfg.optimizer_offload_gradients and cfg.gradient_accumulation_steps > 1:
        raise ValueError(f"optimizer_offload_gradients with gradient_accumulation_steps "
                         f"{cfg.gradient_accumulation_steps}: each gradient leaves the accelerator after its "
                         "micro-batch, so nothing would accumulate; set gradient_accumulation_steps to 1 (a larger "
                         "train_batch_size), or optimizer_offload_gradients to false")
    if cfg.optimizer == "adamw_schedulefree":
        raise ValueError("optimizer_cpu_offload_method 'cpu' with optimizer 'adamw_schedulefree': its averaged "
                         "weights would be switched on the CPU copies, not on the model that samples and saves; "
                         "choose another optimizer, or set optimizer_cpu_offload_method to 'none'")
