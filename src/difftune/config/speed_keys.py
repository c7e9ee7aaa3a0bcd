"""The GPU speed keys (issue 17): attention backend, torch.compile, batch prefetch and the MFU peak. The fields
are mixed into TrainConfig; `speed_checks` is called from its validator. Import-light: no torch.

The names are SimpleTuner's where it has them (`attention_mechanism`, `sageattention_usage`, `dynamo_*`,
`dataloader_prefetch*`), so a user's config keeps working; `compile: true` is the short spelling of
`dynamo_backend: inductor`. What each value does at run time is in train/attention.py, train/compile.py,
train/prefetch.py and train/throughput.py.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from pydantic import BaseModel, field_validator

from difftune.config.fields import field

# attention_mechanism value -> diffusers' AttentionBackendName (train/attention.py). "auto" picks the fastest
# one installed that trains (train/attention.py: choose).
ATTENTION_BACKENDS = {
    "auto": None,
    "diffusers": "native",  # SimpleTuner's default: torch SDPA, torch picks the kernel
    "native": "native",
    "flash-attn": "flash",  # the flash-attn package (FlashAttention 2)
    "flash-attn-2": "flash",
    "flash-attn-3": "_flash_3",  # flash_attn_interface (FlashAttention 3, Hopper)
    "flex": "flex",
    "sageattention": "sage",  # no backward kernel: validation only (sageattention_usage)
    "cudnn": "_native_cudnn",
    "native-flash": "_native_flash",
    "native-efficient": "_native_efficient",
    "native-math": "_native_math",
}
# Spec values difftune refuses, with what to use instead.
REFUSED_ATTENTION = {
    "xformers": "attention_mechanism 'xformers': xformers is not used by difftune; use 'auto' (torch SDPA or "
                "FlashAttention, as fast or faster)",
    "sla": "not implemented yet: attention_mechanism 'sla' (Sparse-Linear Attention needs per-model tuning); use "
           "'auto'",
    "native-npu": "attention_mechanism 'native-npu' needs an Ascend NPU, which difftune does not support; use 'auto'",
    "native-xla": "attention_mechanism 'native-xla' needs a TPU/XLA device, which difftune does not support; use "
                  "'auto'",
    "flash-attn-3-varlen": "not implemented yet: attention_mechanism 'flash-attn-3-varlen'; use 'flash-attn-3' "
                           "(prompts are padded per batch, not packed)",
}
# attention_mechanism value -> the package it needs (checked before any model loads)
ATTENTION_PACKAGES = {"flash-attn": "flash_attn", "flash-attn-2": "flash_attn",
                      "flash-attn-3": "flash_attn_interface", "sageattention": "sageattention"}
# attention_mechanism values whose kernels run on CUDA only and take bf16/fp16 tensors only (checked from the
# dtypes before any model loads; train/attention.py checks the device).
HALF_ONLY = frozenset({"flash-attn", "flash-attn-2", "flash-attn-3", "cudnn", "sageattention"})
DYNAMO_BACKENDS = ("no", "inductor", "aot_eager", "eager")
DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class SpeedKeys(BaseModel):
    attention_mechanism: str = field(
        "auto", "Attention kernel: 'auto' (the fastest installed one that trains: FlashAttention 3 on Hopper, then "
        "FlashAttention 2, then torch SDPA), 'diffusers'/'native' (torch SDPA), 'flash-attn', 'flash-attn-3', "
        "'flex', 'cudnn', 'native-flash', 'native-efficient', 'native-math', or 'sageattention' (validation only: "
        "it has no backward pass). Kandinsky 5's sparse NABLA attention (the 10s models) always uses flex attention. "
        "A kernel the device cannot run (flash kernels on the CPU, FlashAttention 3 off Hopper, bf16/fp16-only kernels "
        "in fp32) is an error at start.",
        "memory", advanced=True, choices=list(ATTENTION_BACKENDS),
    )
    sageattention_usage: str = field(
        "inference", "With attention_mechanism 'sageattention': where SageAttention is used. Only 'inference' "
        "(validation samples) is supported: it has no backward pass, so training uses the 'auto' kernel.",
        "memory", advanced=True, choices=["inference"],
    )
    compile: bool = field(
        False, "Compile the transformer with torch.compile and its inductor backend (short for dynamo_backend "
        "'inductor'). Each block stack is compiled once and its blocks share the code. The first step and the first "
        "validation are slow while they compile, and so may be a step with a new shape (see dynamo_dynamic). Hooks "
        "(block streaming, TREAD, CREPA, FSDP2) stay outside the compiled code; adapters, checkpoints and resume are "
        "unchanged.", "memory", advanced=True,
    )
    dynamo_backend: str = field(
        "no", "torch.compile backend: 'no' (off), 'inductor' (generated kernels: the speed-up), 'aot_eager' (traced "
        "through AOTAutograd, no code generation: checks that the model compiles) or 'eager' (traced only). A "
        "compiler failure stops the run with a message that names this key.", "memory", advanced=True,
        choices=list(DYNAMO_BACKENDS),
    )
    dynamo_mode: str | None = field(
        None, "With dynamo_backend 'inductor': torch.compile mode: 'default', 'reduce-overhead' (CUDA graphs: less "
        "launch overhead, more memory), 'max-autotune' (benchmarks kernels while compiling; CUDA graphs), "
        "'max-autotune-no-cudagraphs'. Unset: 'default'. CUDA graphs are refused with block streaming and FSDP2, "
        "which move weights between calls.", "memory", advanced=True,
    )
    dynamo_fullgraph: bool = field(
        False, "With compile: each compiled region must trace as one graph. A graph break is then an error naming "
        "it (instead of a split into smaller graphs), and so is reaching dynamo_recompile_limit (instead of running "
        "uncompiled).", "memory", advanced=True,
    )
    dynamo_dynamic: bool | None = field(
        None, "With compile: shapes (torch.compile's dynamic). Unset: torch's automatic dynamic shapes: a region is "
        "first compiled for the shape it sees; when a size changes (another bucket, caption length or batch) it is "
        "compiled once more with the changed sizes symbolic, and that graph serves later sizes. true: symbolic sizes "
        "from the first compilation. false: one graph per shape, up to dynamo_recompile_limit.", "memory",
        advanced=True,
    )
    dynamo_use_regional_compilation: bool = field(
        True, "With compile: one compiled region per block stack (Lumina2's refiners and layers, Kandinsky 5's text "
        "and visual blocks), shared by the stack's blocks, so one compilation serves them all (quick to start). "
        "false: the whole transformer's forward is one region (longer first steps; refused with block streaming).",
        "memory", advanced=True,
    )
    dynamo_recompile_limit: int = field(
        16, "With compile: how many graphs each region may compile (torch.compile's recompile_limit, per region). "
        "Training and validation sampling (no gradients; guidance doubles the batch) compile separately, and so may "
        "new shapes. Past the limit, inputs that no compiled graph accepts run that region uncompiled (the same "
        "results, slower), with one warning in the log; with dynamo_fullgraph it is an error.", "memory", ge=1,
        le=256, advanced=True,
    )
    dataloader_prefetch: bool = field(
        True, "Read the next batches from the cache in a background thread (into pinned memory on CUDA, copied "
        "without blocking), so the accelerator never waits on the disk. Off: read each batch when it is needed.",
        "data", advanced=True,
    )
    dataloader_prefetch_qlen: int = field(
        2, "With dataloader_prefetch: how many batches are read ahead.", "data", ge=1, le=64, advanced=True,
    )
    gpu_peak_tflops: float | None = field(
        None, "One accelerator's peak dense bf16 TFLOP/s (the datasheet figure without 2:4 sparsity), for the model "
        "FLOP utilisation (MFU) in the log. Unset: looked up from the device name (H100, A100, L40S, RTX 4090, ...); "
        "an unknown device shows no MFU.",
        "output", advanced=True, gt=0,
    )

    @field_validator("dynamo_backend", mode="before")
    @classmethod
    def _backend_name(cls, value: Any) -> Any:  # accelerate writes INDUCTOR, NO
        return value.lower() if isinstance(value, str) else value

    @field_validator("dynamo_mode", mode="before")
    @classmethod
    def _mode_unset(cls, value: Any) -> Any:  # SimpleTuner's UI writes "" for "not set"
        return None if value == "" else value

    def compile_backend(self) -> str | None:
        """The torch.compile backend to use, or None when compilation is off."""
        if self.dynamo_backend != "no":
            return self.dynamo_backend
        return "inductor" if self.compile else None


def speed_checks(cfg: Any) -> None:
    """Raise ValueError for a speed setting difftune cannot run, naming the key and the fix."""
    mech = cfg.attention_mechanism
    if mech in REFUSED_ATTENTION:
        raise ValueError(REFUSED_ATTENTION[mech])
    if mech not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_mechanism {mech!r} is not known; choose one of {', '.join(ATTENTION_BACKENDS)}")
    package = ATTENTION_PACKAGES.get(mech)
    if package is not None and importlib.util.find_spec(package) is None:
        pip = {"flash_attn": "flash-attn", "flash_attn_interface": "flash-attn 3 (flash_attn_interface, built from "
               "the hopper/ folder of Dao-AILab/flash-attention)", "sageattention": "sageattention"}[package]
        raise ValueError(f"attention_mechanism {mech!r} needs the {package} package, which is not installed: "
                         f"install {pip}, or use attention_mechanism 'auto'")
    _attention_dtypes(cfg, mech)
    if cfg.sageattention_usage != "inference":
        raise ValueError(f"sageattention_usage {cfg.sageattention_usage!r} is not supported: SageAttention has no "
                         "backward pass, so it would leave the attention projections untrained; use 'inference'")
    if cfg.dynamo_backend not in DYNAMO_BACKENDS:
        raise ValueError(f"dynamo_backend {cfg.dynamo_backend!r} is not supported; use one of "
                         f"{', '.join(DYNAMO_BACKENDS)} ('inductor' to compile)")
    if cfg.compile and cfg.dynamo_backend not in ("no", "inductor"):
        raise ValueError(f"compile: true means dynamo_backend 'inductor', but dynamo_backend is "
                         f"{cfg.dynamo_backend!r}; keep one of them")
    compiling = cfg.compile_backend() is not None
    if cfg.dynamo_mode is not None and cfg.dynamo_mode not in DYNAMO_MODES:
        raise ValueError(f"dynamo_mode {cfg.dynamo_mode!r} is not a torch.compile mode; use one of "
                         f"{', '.join(DYNAMO_MODES)}")
    if compiling:  # the dynamo_* settings of a switched-off compile are accepted, as SimpleTuner's configs carry them
        compile_checks(cfg)


def compile_checks(cfg: Any) -> None:
    """The combinations of torch.compile with other features that difftune refuses (train/compile.py)."""
    backend = cfg.compile_backend()
    if cfg.dynamo_mode is not None and backend != "inductor":
        raise ValueError(f"dynamo_mode {cfg.dynamo_mode!r} is a mode of the inductor backend; dynamo_backend "
                         f"{backend!r} takes none: remove dynamo_mode, or use dynamo_backend 'inductor'")
    streaming = [k for k in ("enable_group_offload", "musubi_blocks_to_swap") if getattr(cfg, k, None)]
    if streaming and not cfg.dynamo_use_regional_compilation:
        raise ValueError(f"dynamo_use_regional_compilation false (the whole transformer as one region) with "
                         f"{streaming[0]}: block streaming's hooks, which move each block's weights, would be traced "
                         "inside the compiled transformer and break it into pieces; use regional compilation "
                         "(dynamo_use_regional_compilation true), where they run between the compiled blocks")
    # Whole-model compilation traces the blocks' hooks inside the compiled transformer. Under gradient checkpointing
    # torch.compile traces each block without them (measured: TREAD then routed no token, silently); CREPA's
    # capture and FSDP2's all-gathers are block hooks too, and are not tested traced.
    hooked = [k for k, on in (("crepa_enabled", getattr(cfg, "crepa_enabled", False)),
                              ("layersync_enabled", getattr(cfg, "layersync_enabled", False)),
                              ("fsdp_enable", getattr(cfg, "fsdp_enable", False)),
                              ("tread_config with gradient_checkpointing",
                               getattr(cfg, "tread_config", None) is not None and cfg.gradient_checkpointing),
                              ("gradient_checkpointing_backend 'unsloth'",
                               getattr(cfg, "gradient_checkpointing_backend", "torch") == "unsloth"))
              if on]
    if hooked and not cfg.dynamo_use_regional_compilation:
        raise ValueError(f"dynamo_use_regional_compilation false (the whole transformer as one region) with "
                         f"{hooked[0]}: its hooks on the blocks would be traced inside the compiled transformer, where "
                         "torch.compile does not run them faithfully; use regional compilation "
                         "(dynamo_use_regional_compilation true), where they run between the compiled blocks")
    if cfg.dynamo_mode in ("reduce-overhead", "max-autotune"):
        moving = streaming + (["fsdp_enable"] if getattr(cfg, "fsdp_enable", False) else [])
        if moving:
            raise ValueError(f"dynamo_mode {cfg.dynamo_mode!r} uses CUDA graphs, which replay the weights' recorded "
                             f"addresses, but {moving[0]} moves the weights between calls; use dynamo_mode 'default' "
                             "or 'max-autotune-no-cudagraphs'")
        if getattr(cfg, "gradient_checkpointing_backend", "torch") == "unsloth":
            # a compiled block's output lives in the CUDA graph's pool, overwritten by the next replay, while the
            # side stream may still be copying it out
            raise ValueError(f"dynamo_mode {cfg.dynamo_mode!r} (CUDA graphs) with gradient_checkpointing_backend "
                             "'unsloth', whose copies of the blocks' inputs run beside the graphs; use dynamo_mode "
                             "'default' or 'max-autotune-no-cudagraphs', or gradient_checkpointing_backend 'torch'")


def _attention_dtypes(cfg: Any, mech: str) -> None:
    """A bf16/fp16-only kernel needs half tensors where it runs: training (autocast, or half weights) and
    validation, which samples in the base weights' dtype. SageAttention runs in validation only."""
    if mech not in HALF_ONLY:
        return
    weights = cfg.weight_dtype_name()
    if weights not in ("bf16", "fp16"):
        how = "set base_model_default_dtype bf16" if cfg.base_model_default_dtype else "set mixed_precision bf16"
        raise ValueError(f"attention_mechanism {mech!r} needs bf16/fp16 tensors, but validation samples in the base "
                         f"weights' dtype, {weights}; {how}, or use attention_mechanism 'auto'")
