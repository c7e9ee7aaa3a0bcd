"""Before any model loads: does the checkpoint a run resumes from fit this run? (`difftune check` too.)

A checkpoint's `trainable.safetensors` header names every trained tensor with its shape, and a standard LoRA's
`lora_A` matrices are [rank, in]: a changed lora_rank (or a checkpoint of another adapter type) is refused from the
header alone, read with safetensors' `safe_open` (no tensor is loaded, no torch needed), instead of failing after the
model has loaded and every cache is filled (adapters/kinds.py `_copy_into` says the same then, for what this misses).
The settings its training_state.json records (train/resume_settings.py) refuse an epoch-based run whose batches
changed (`batches_problem`; the process count is checked when the run starts).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from safetensors import safe_open

_NAME = re.compile(r"checkpoint-(\d+)(-rolling)?")


def newest(output_dir: Path) -> Path | None:
    """The newest complete checkpoint (it holds its state file) under output_dir/checkpoints, which 'latest' takes
    unless its weights turn out damaged (then the run passes to an older one, which this check does not follow)."""
    root = output_dir / "checkpoints"
    found = [(int(m[1]), not m[2], p) for p in (root.iterdir() if root.is_dir() else [])
             if (m := _NAME.fullmatch(p.name)) and (p / "training_state.json").is_file()]
    return max(found)[2] if found else None


# lycoris_config keys that decide which tensors a LyCORIS network has, and their shapes
LYCORIS_SHAPE = ("algo", "linear_dim", "conv_dim", "factor", "full_matrix", "decompose_both", "use_tucker",
                 "dora_wd", "apply_preset")


def lycoris_problem(train: Any, folder: Path) -> str | None:
    """Why this run's lycoris_config cannot resume `folder`'s network (its LyCORIS file keeps the config it trained
    with in its metadata), or None."""
    try:
        with safe_open(str(folder / "pytorch_lora_weights.safetensors"), framework="numpy") as f:
            then = json.loads((f.metadata() or {})["lycoris_config"])
        now = json.loads(Path(train.lycoris_config).read_text(encoding="utf-8-sig"))
    except Exception:  # noqa: BLE001 - an older checkpoint, or an unreadable file: the resume reports what misfits
        return None
    from difftune.config.lycoris_file import algo_of

    same = lambda k: algo_of(then) == algo_of(now) if k == "algo" else then.get(k) == now.get(k)  # noqa: E731
    changed = [f"{k} {then.get(k)!r} then, {now.get(k)!r} now" for k in LYCORIS_SHAPE if not same(k)]
    if not changed:
        return None
    return (f"{folder} was trained with another LyCORIS network ({'; '.join(changed)}): its weights do not fit the "
            f"one {train.lycoris_config} makes. Restore those lycoris_config keys to resume it, or start a new "
            "output_dir")


def lora_problem(train: Any, folder: Path) -> str | None:
    """Why this config cannot resume `folder`'s weights (from their headers), or None: use_ema without the
    checkpoint's EMA state, a full fine-tune from an adapter's checkpoint, a standard LoRA (or LyCORIS network) that
    differs from the checkpoint's."""
    if train.use_ema and not (folder / "ema.pt").is_file():  # training refused it after loading the model
        return (f"{folder} has no EMA state but use_ema is on; resume with use_ema false, or start a new "
                "output_dir")
    if train.model_type == "lora" and train.lora_type == "lycoris" and train.lycoris_config:
        return lycoris_problem(train, folder)
    if train.model_type == "full":  # a LoRA's checkpoint resumed as a full fine-tune failed after loading the model
        try:
            with safe_open(str(folder / "trainable.safetensors"), framework="numpy") as f:
                adapter = any(".lora_A." in k or k.startswith("lycoris_") for k in f.keys())
        except Exception:  # noqa: BLE001 - an unreadable file is the resume's to report
            return None
        return (f"{folder} holds an adapter's weights (a LoRA or LyCORIS run), this run is a full fine-tune; set "
                "model_type 'lora' (and lora_type) as it was trained, or start a new output_dir") if adapter else None
    if train.model_type != "lora" or train.lora_type != "standard":
        return None
    try:
        with safe_open(str(folder / "trainable.safetensors"), framework="numpy") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys() if ".lora_A." in k}
            dora = any("lora_magnitude_vector" in k for k in f.keys())
            empty = not shapes and bool(list(f.keys()))
    except Exception:  # noqa: BLE001 - an unreadable file is the resume's to report (it passes over it, or names it)
        return None
    if shapes and dora != bool(train.use_dora):
        return (f"{folder} was trained with use_dora {str(dora).lower()}, this run has use_dora "
                f"{str(bool(train.use_dora)).lower()}: a DoRA's magnitudes are tensors a plain LoRA does not have. Set "
                f"use_dora {str(dora).lower()} to resume it, or start a new output_dir")
    if empty:
        return (f"{folder} holds no standard LoRA (its weights are another adapter type or a full fine-tune); set "
                "model_type and lora_type as it was trained, or start a new output_dir")
    ranks = {shape[0] for shape in shapes.values()}
    if ranks and train.lora_rank not in ranks:
        name, shape = next(iter(shapes.items()))
        return (f"{folder} was trained with lora_rank {sorted(ranks)[0]} ({name} is {shape}), this run has lora_rank "
                f"{train.lora_rank}: the checkpoint does not match this run's adapter. Set lora_rank "
                f"{sorted(ranks)[0]} to resume it, or start a new output_dir")
    return None


def batch_changes(saved: dict[str, Any], now: dict[str, int]) -> dict[str, tuple[Any, Any]]:
    """train_batch_size, gradient_accumulation_steps and processes, (the checkpoint's, this run's), when the batches
    differ: each draw of the sampler is train_batch_size x processes images (one global micro-batch) and a step is
    gradient_accumulation_steps draws, so 2 processes of 1 and 1 process of 2 are the same batches (the same data
    position on resume; the same losses too, but for Kandinsky 5, whose attended caption padding depends on the
    longest caption in each process's batch); nothing when they are."""
    keys = ("train_batch_size", "gradient_accumulation_steps", "processes")
    if not all(k in saved for k in keys[:2]):
        return {}
    then = {k: saved.get(k, 1) for k in keys}
    draw = then["train_batch_size"] * then["processes"] == now["train_batch_size"] * now["processes"]
    if draw and then["gradient_accumulation_steps"] == now["gradient_accumulation_steps"]:
        return {}
    return {k: (then[k], now[k]) for k in keys if then[k] != now[k]}


def batches_refusal(path: Path, changed: dict[str, tuple[Any, Any]], epochs: int) -> str:
    """Why an epoch-based run cannot resume `path` with other batches: `changed` maps train_batch_size,
    gradient_accumulation_steps and processes to (the checkpoint's, this run's)."""
    what = ", ".join(f"{k} {old} then, {new} now" for k, (old, new) in changed.items())
    restore = " and ".join(f"{k} {old}" for k, (old, _) in changed.items() if k != "processes")
    processes = f" on {changed['processes'][0]} process(es)" if "processes" in changed else ""
    return (f"{path} was trained with other batches ({what}); this run ends after num_train_epochs {epochs}, and the "
            "checkpoint's step and data position count batches of the old size, so it would train the wrong number "
            f"of epochs. Resume with {restore or 'the same batches'}{processes} (or any train_batch_size x processes "
            "equal to the checkpoint's, with its gradient_accumulation_steps), or set max_train_steps to the total "
            "steps to train instead")


def batches_problem(train: Any, folder: Path) -> str | None:
    """An epoch-based run (num_train_epochs, no max_train_steps) resuming `folder` with another train_batch_size or
    gradient_accumulation_steps than it recorded: why not, or None."""
    if not train.num_train_epochs or train.max_train_steps or train.ignore_final_epochs:
        return None
    try:
        saved = json.loads((folder / "training_state.json").read_text()).get("settings") or {}
    except (OSError, ValueError, AttributeError):  # unreadable: the resume reports it
        return None
    now = {"train_batch_size": train.train_batch_size, "gradient_accumulation_steps": train.gradient_accumulation_steps,
           "processes": world_size()}
    changed = batch_changes(saved, now)
    return batches_refusal(folder, changed, train.num_train_epochs) if changed else None


def world_size() -> int:
    """The processes of a run started here (WORLD_SIZE, set by torchrun and accelerate launch), else 1."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def written_by_fsdp(folder: Path) -> str:
    """Why a run that does not shard cannot resume `folder` (here before any model loads, and at load time)."""
    return (f"{folder} was written by an FSDP run: its optimizer state (optimizer_fsdp, sharded or gathered) loads "
            "into an FSDP run only; resume it with fsdp_enable true on several processes (torchrun "
            "--nproc_per_node N -m difftune.cli train), or start a new output_dir")


def not_written_by_fsdp(folder: Path) -> str:
    """Why an FSDP run cannot resume `folder`, a plain run's checkpoint."""
    return (f"{folder} was written by a run without FSDP (its optimizer.pt): it loads into a run that does not "
            "shard; resume it with fsdp_enable false (DDP, or one process), or start a new output_dir")


def fsdp_problem(train: Any, folder: Path) -> str | None:
    """A checkpoint of an FSDP run (its optimizer state in optimizer_fsdp/ or optimizer_fsdp.pt, no optimizer.pt)
    resumed by a run that will not shard (fsdp_enable off, or one process), or a plain run's (optimizer.pt) by one
    that will: why not, found before any model loads (the second failed after the caches). Another optimizer than
    the checkpoint's starts afresh and needs no saved state."""
    sharding = bool(train.fsdp_enable and world_size() > 1)
    if (folder / "optimizer.pt").is_file():  # the other direction: a plain run's state into a sharded optimizer
        refused, problem = sharding, not_written_by_fsdp(folder)
    elif any((folder / n).exists() for n in ("optimizer_fsdp", "optimizer_fsdp.pt")):
        refused, problem = not sharding, written_by_fsdp(folder)
    else:
        return None
    if not refused:
        return None
    try:
        saved = json.loads((folder / "training_state.json").read_text()).get("settings") or {}
    except (OSError, ValueError, AttributeError):
        return None
    return problem if saved.get("optimizer") in (None, train.optimizer) else None

