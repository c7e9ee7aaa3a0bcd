"""Resumable checkpoints, written atomically.

A checkpoint is a folder `output_dir/checkpoints/checkpoint-NNNNNNN/` (a rolling one, `checkpointing_rolling_steps`:
`checkpoint-NNNNNNN-rolling/`, its own series, pruned apart) holding the trainable weights,
the optimizer and LR-scheduler states, the sampler position and the RNG states, plus the LoRA in the
pipeline's format for direct use. It is written under a temporary name and renamed into place, so a
folder with the final name is always complete; leftovers of a killed save are ignored and removed.

A checkpoint is "intact" only when every file a resume reads is there and its weights are finite: `latest` passes
over one that is not (with a warning) for the previous intact one; a path named explicitly that is not intact is an
error (CheckpointError, which the command line prints as `error: ...`).

A run that starts at step s (0, or a checkpoint that is not the newest) first moves every checkpoint after s into
`checkpoints/superseded-<UTC time>/` (set_aside_later): otherwise `latest` would later resume the abandoned
history and the run's own pruning would delete its newer checkpoints first. Nothing there is ever deleted.
The results outside checkpoints (`pytorch_lora_weights.safetensors`, a `transformer/` folder, `ema/`)
are written the same way: into a hidden temporary folder beside them, fsynced, then renamed over.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from difftune.config.resume_check import written_by_fsdp
from difftune.files import tree_as_created
from difftune.train import resume_settings
from difftune.train.fsdp import load_optimizer, save_optimizer
from difftune.train.optimizers import train_mode

if TYPE_CHECKING:
    from difftune.train.setup import Run

PREFIX = "checkpoint-"
ROLLING = "-rolling"  # the suffix of the rolling series (checkpointing_rolling_steps)
STATE_FILE = "training_state.json"
SOURCE_FILE = "model_source.json"  # the transformer's source (models/sources.ModelSource.transformer_identity)
SUPERSEDED = "superseded-"  # checkpoints/superseded-<UTC time>/: a later history set aside (set_aside_later)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: the command line prints it as `error: ...` (exit status 2)."""


class WriteError(Exception):
    """A checkpoint or result that could not be written (disk full, no permission): the command line prints it
    as `error: ...` (exit status 2). What the failed save had written is removed; earlier checkpoints stay."""


def write_failure(e: BaseException) -> str | None:
    """Why a write failed, when `e` is the OS's, torch.save's or safetensors' form of a failed write; else None."""
    text = str(e)
    if isinstance(e, OSError):
        return e.strerror or text
    if isinstance(e, RuntimeError) and ("PytorchStreamWriter" in text or "inline_container" in text):
        return f"torch.save: {text.splitlines()[0][:160]}"
    if type(e).__name__ == "SafetensorError" and "I/O error" in text:
        return text.split("I/O error: ", 1)[-1]
    if type(e).__name__ == "CheckpointException":  # torch.distributed.checkpoint: each process's own exception
        for failure in (getattr(e, "failures", None) or {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException) and (reason := write_failure(inner)) is not None:
                return reason
    return None


@contextmanager
def written(what: str, folder: Path, output_dir: Path, partial: Path | None = None) -> Iterator[None]:
    """Turn a failed write inside into a WriteError naming `folder` and the checkpoint a resume takes; `partial`
    (a temporary folder) is removed on any failure, which gives back the space it took."""
    try:
        yield
    except BaseException as e:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        if (reason := write_failure(e)) is None:
            raise
        last = find_latest(output_dir)
        resumes = f"it resumes from {last.name}" if last else "there is no checkpoint yet, so it starts afresh"
        raise WriteError(f"cannot write {what} in {folder} ({reason}); free disk space (or make the folder "
                         f"writable) and run again with resume_from_checkpoint 'latest': {resumes}") from e


def step_of(path: Path) -> int | None:
    """The step of a checkpoint folder's name (regular or rolling), or None for any other name."""
    digits = path.name[len(PREFIX):].removesuffix(ROLLING) if path.name.startswith(PREFIX) else ""
    return int(digits) if digits.isdigit() else None


def is_rolling(path: Path) -> bool:
    return path.name.endswith(ROLLING)


def order(path: Path) -> tuple[int, bool]:
    """Sort key of a checkpoint folder: its step, and of the same step the regular one after the rolling one
    (so that 'latest' takes the regular, which is kept longer)."""
    return int(path.name[len(PREFIX):].removesuffix(ROLLING)), not is_rolling(path)


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def save_adapter(run: Run, folder: Path) -> Path:
    """The adapter in its loadable format, written atomically: every file or folder it produces is
    whole under its final name (a reader or a kill never sees a half-written one). A failed write is a
    WriteError; the result it would have replaced stays whole."""
    with written("the trained weights", folder, getattr(run, "output_dir", folder)):
        return _write_adapter(run, folder)


def _write_adapter(run: Run, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-result-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        produced = run.adapter.save(tmp)
        tree_as_created(tmp)  # safetensors writes 0600: readable by others as any file (files.py)
        _fsync_tree(tmp)
        for item in sorted(tmp.iterdir()):
            final = folder / item.name
            if item.is_dir() and final.exists():
                swap_in(item, final, folder / f".old-result-{item.name}-{os.getpid()}")
            else:
                os.replace(item, final)
        _fsync_dir(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder / produced.relative_to(tmp)


def swap_in(new: Path, final: Path, aside: Path) -> None:
    """Put folder `new` where folder `final` is. A folder cannot be renamed over a folder, so the old one
    is renamed to `aside` first, then deleted; a kill in between leaves both complete."""
    os.replace(final, aside)
    os.replace(new, final)
    shutil.rmtree(aside, ignore_errors=True)


def save_checkpoint(run: Run, rolling: bool = False,
                    process_rng: list[dict[str, Any]] | None = None) -> tuple[Path, list[str]]:
    """Write the run's state as a checkpoint of the regular series, or of the rolling one, then prune that series.
    Returns the checkpoint and the names of the ones pruning removed (the hub upload removes them there too).
    `process_rng`: each process's `rng_states()`, by rank."""
    root = checkpoints_dir(run.output_dir)
    final = root / f"{PREFIX}{run.state.step:07d}{ROLLING if rolling else ''}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    with written(f"checkpoint {final.name}", root, run.output_dir, partial=tmp):
        _write_checkpoint(run, root, tmp, process_rng)
        if final.exists():  # the same step saved again (for example at the end): replace it whole
            # Its own prefix: a kill between the two renames leaves it complete, and clean_partial puts it
            # back under its name instead of deleting the only copy of that step.
            swap_in(tmp, final, root / f".replaced-{final.name}-{os.getpid()}")
        else:
            os.replace(tmp, final)
        _fsync_dir(root)  # the rename itself on disk: after a power loss the checkpoint is under its own name
    keep = run.cfg.checkpoints_rolling_total_limit if rolling else run.cfg.checkpoints_total_limit
    return final, prune_checkpoints(run.output_dir, keep, rolling, written=final)


def rng_states() -> dict[str, Any]:
    """This process's torch RNG states: the CPU's, and the current CUDA device's where there is one."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _write_checkpoint(run: Run, root: Path, tmp: Path, process_rng: list[dict[str, Any]] | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(run.adapter.state_dict(), tmp / "trainable.safetensors")
    if getattr(run, "fsdp", None) is not None:  # sharded state: inside fsdp.gathered, every process took part
        save_optimizer(run, tmp)
    else:
        torch.save(run.optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(run.lr_scheduler.state_dict(), tmp / "lr_scheduler.pt")
    if getattr(run, "crepa", None) is not None:  # the CREPA projector: trained, resumed, never in the adapter
        run.crepa.save(tmp)
    torch.save({"generator": run.generator.get_state(), "generator_device": run.generator.device.type,
                "torch": torch.get_rng_state(), "by_process": process_rng or [rng_states()]}, tmp / "rng.pt")
    _write_adapter(run, tmp)
    if run.ema is not None:
        torch.save(run.ema.state_dict(), tmp / "ema.pt")
        with run.ema.swap():
            _write_adapter(run, tmp / "ema")
    # The position after the last batch consumed: the sampler itself is ahead by the batches read ahead
    state = {"step": run.state.step, "sampler": run.state.position or run.data.sampler.state_dict(),
             "settings": resume_settings.recorded(run)}  # what the next resume compares its config with
    (tmp / STATE_FILE).write_text(json.dumps(state))
    # the transformer these weights train on (a resume from another one is warned about: check_transformer_source)
    if getattr(run, "comps", None) is not None:
        (tmp / SOURCE_FILE).write_text(json.dumps(run.comps.origin().transformer_identity()))
    tree_as_created(tmp)
    _fsync_tree(tmp)


def prune_checkpoints(output_dir: Path, keep: int | None, rolling: bool = False,
                      written: Path | None = None) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints of one series, regular or rolling (called after a new
    one is in place); the other series is never touched. With `written` (the one just saved), only checkpoints
    older than it are deleted and it always stays: were a later one there (set_aside_later moves them at the
    start), the run's own newest work must not be what goes. Returns the names of the deleted ones."""
    if keep is None:
        return []
    root = checkpoints_dir(output_dir)
    done = [p for p in complete(output_dir) if is_rolling(p) == rolling]
    if written is not None:
        done = [p for p in done if order(p) < order(written)] + [written]
    gone = done[:-keep]
    for old in gone:
        trash = root / f".old-{old.name}-{os.getpid()}"
        os.replace(old, trash)  # renamed first: a kill mid-delete never leaves a half checkpoint named as whole
        shutil.rmtree(trash, ignore_errors=True)
    return [old.name for old in gone]


def set_aside_later(output_dir: Path, step: int) -> tuple[Path | None, list[str]]:
    """Move every checkpoint folder (regular, rolling, or incomplete) of a step after `step` into a new
    `checkpoints/superseded-<UTC time>/`, by renames (nothing is deleted). Returns that folder and the names
    moved (None and [] when there were none). Process 0 only."""
    root = checkpoints_dir(output_dir)
    later = sorted((p for p in root.iterdir() if p.is_dir() and (s := step_of(p)) is not None and s > step),
                   key=order) if root.is_dir() else []
    if not later:
        return None, []
    return _move_aside(root, later, "the later checkpoints", output_dir), [p.name for p in later]


# What a finished run leaves in output_dir (the adapter's files or the full model, the EMA, the samples)
# README.md: the model card of a pushed run, which describes that result (its steps, samples, settings)
RESULT_NAMES = ("pytorch_lora_weights.safetensors", "comfyui_lora.safetensors", "transformer", "ema", "validation",
                "README.md")


def set_aside_result(output_dir: Path) -> tuple[Path | None, list[str]]:
    """Move an earlier run's result in output_dir (RESULT_NAMES) into a new `superseded-<UTC time>/` beside it, by
    renames: a run that starts from step 0 in that folder would otherwise overwrite it file by file (a SimpleTuner
    LoRA too). Returns that folder and the names moved (None and [] when there were none). Process 0 only."""
    found = [output_dir / name for name in RESULT_NAMES if (output_dir / name).exists()]
    if not [p for p in found if p.name != "README.md"]:  # a README alone is the user's, not a result's card
        return None, []
    return _move_aside(output_dir, found, "the earlier result", output_dir), [p.name for p in found]


def _move_aside(root: Path, paths: list[Path], what: str, output_dir: Path) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside, n = root / f"{SUPERSEDED}{stamp}", 1
    while aside.exists():  # two starts within one second
        n += 1
        aside = root / f"{SUPERSEDED}{stamp}-{n}"
    with written(f"{what} into {aside.name}", root, output_dir):  # renames only: nothing is lost
        aside.mkdir()
        for p in paths:
            os.replace(p, aside / p.name)
        _fsync_dir(aside)
        _fsync_dir(root)
    return aside


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_dir():
            _fsync_tree(path)
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete(output_dir: Path) -> list[Path]:
    """Checkpoints whose save finished (they hold the state file), oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if step_of(p) is not None and (p / STATE_FILE).is_file()]
    return sorted(done, key=order)


def find_latest(output_dir: Path) -> Path | None:
    done = complete(output_dir)
    return done[-1] if done else None


def missing_file(path: Path) -> str | None:
    """The first file a resume reads (load_checkpoint) that the checkpoint lacks, described, or None. The EMA and
    CREPA files depend on this run's settings: load_checkpoint names them."""
    from difftune.train.fsdp import FULL_OPTIMIZER, SHARDED_OPTIMIZER

    for name in (STATE_FILE, "trainable.safetensors"):
        if not (path / name).is_file():
            return f"its {name} is missing"
    if not ((path / "optimizer.pt").is_file() or (path / SHARDED_OPTIMIZER).is_dir()
            or (path / FULL_OPTIMIZER).is_file()):
        return "its optimizer.pt is missing"  # FSDP forms are not named: they are not there either
    if not (path / "optimizer.pt").is_file() and (path / SHARDED_OPTIMIZER).is_dir():
        if (problem := _shard_missing(path / SHARDED_OPTIMIZER)) is not None:
            return problem
    for name in ("lr_scheduler.pt", "rng.pt"):
        if not (path / name).is_file():
            return f"its {name} is missing"
    return None


def _shard_missing(folder: Path) -> str | None:
    """A sharded optimizer state (torch.distributed.checkpoint, one file per process) whose `.metadata` names a file
    that is not there or shorter than its items reach (a truncated shard), described; None when every one is whole.
    Only the metadata and the files' sizes are read, not the shards."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # noqa: BLE001 - missing or damaged: the same verdict
        return f"its {folder.name}/.metadata cannot be read ({type(e).__name__})"
    ends: dict[str, int] = {}  # each shard file's size, as far as its items reach
    for info in (meta.storage_data or {}).values():
        if name := getattr(info, "relative_path", None):
            ends[name] = max(ends.get(name, 0), (getattr(info, "offset", 0) or 0) + (getattr(info, "length", 0) or 0))
    missing = sorted(name for name in ends if not (folder / name).is_file())
    if missing:
        return f"its {folder.name}/{missing[0]} is missing"
    short = sorted(name for name, end in ends.items() if (folder / name).stat().st_size < end)
    return f"its {folder.name}/{short[0]} is cut short" if short else None


def weights_problem(path: Path) -> str | None:
    """Why a checkpoint cannot be resumed from, or None: a file it needs is missing (missing_file), or its trainable
    weights (and EMA weights) are not whole and finite. Reads them whole: a checkpoint saved after weights went
    NaN or inf, or damaged since, is not intact."""
    from difftune.data.cache import nonfinite

    if (missing := missing_file(path)) is not None:
        return missing
    if (unreadable := _unreadable(path)) is not None:
        return unreadable
    try:
        bad = nonfinite(load_file(path / "trainable.safetensors"))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for any damage
        return f"its trainable.safetensors cannot be read ({type(e).__name__}: {e})"
    if bad is not None:
        return f"its weights are not finite (NaN or inf in {bad})"
    if (path / "ema.pt").is_file():
        try:
            ema = torch.load(path / "ema.pt", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged pickle raises many types
            return f"its ema.pt cannot be read ({type(e).__name__}: {e})"
        tensors = {f"ema[{i}]": t for i, t in enumerate(_tensors(ema))}
        if (bad := nonfinite(tensors)) is not None:
            return f"its EMA weights are not finite (NaN or inf in {bad})"
    return None


def _unreadable(path: Path) -> str | None:
    """The first of the state files a resume reads that cannot be read (truncated, zeroed, not JSON), described.
    The small ones are read whole; an optimizer state (gigabytes for a full fine-tune) only to its zip directory,
    which is at the end of the file: what a truncated or zeroed file lacks."""
    from difftune.train.fsdp import FULL_OPTIMIZER

    try:
        state = json.loads((path / STATE_FILE).read_text())
        if not isinstance(state, dict):
            return f"its {STATE_FILE} is not a JSON object"
        if not {"step", "sampler"} <= state.keys():  # the first difftune versions wrote no data position
            return f"its {STATE_FILE} has no data position (written by an early difftune that this one cannot resume)"
    except (OSError, ValueError) as e:
        return f"its {STATE_FILE} cannot be read ({type(e).__name__}: {e})"
    for name in ("lr_scheduler.pt", "rng.pt"):
        try:
            torch.load(path / name, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged pickle raises many types
            return f"its {name} cannot be read ({type(e).__name__})"
    for name in ("optimizer.pt", FULL_OPTIMIZER):
        if (path / name).is_file():
            try:
                zipfile.ZipFile(path / name).close()
            except (OSError, zipfile.BadZipFile) as e:
                return f"its {name} cannot be read ({type(e).__name__}: {e})"
    return None


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def resolve_resume(output_dir: Path, value: str, warn=None) -> Path | None:
    """'latest' -> newest intact checkpoint of either series (None if there is none yet), passing over any that is
    not (a file missing, weights not finite) with a `warn`ing; a path -> that checkpoint, which must be intact
    (CheckpointError)."""
    if value == "latest":
        root = checkpoints_dir(output_dir)
        # every checkpoint-* folder, the state file or not: one without it lost a file, and is said to be passed over
        found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None] if root.is_dir() else []
        for path in sorted(found, key=order, reverse=True):
            problem = weights_problem(path)
            if problem is None:
                return path
            if warn is not None:
                warn(f"resume_from_checkpoint latest: passing over {path.name}: {problem}; trying the one before")
        return None
    path = Path(value)
    problem = weights_problem(path)
    if problem is not None:
        raise CheckpointError(f"resume_from_checkpoint: {path} is not intact: {problem}. Name an earlier checkpoint "
                              f"under {checkpoints_dir(output_dir)}, or use 'latest' to take the newest intact one")
    return path


def restore_generator(run: Run, rng: dict, path: Path) -> None:
    """The noise generator's state. Saved on another kind of device (a CPU run resumed on a GPU), it cannot be
    restored: the generator is seeded from (seed, step) instead, and the run says that its noise differs
    from an uninterrupted run's."""
    saved = rng.get("generator_device", "cpu")
    if saved == run.generator.device.type:
        run.generator.set_state(rng["generator"])
        return
    run.generator.manual_seed(run.cfg.seed * 1_000_003 + run.state.step)
    run.events.emit("warning", message=f"{path} was saved by a run on {saved}, this one draws its noise on "
                    f"{run.generator.device.type}: the noise sequence restarts from (seed, step), so the losses "
                    "will not match an uninterrupted run's exactly")


def check_transformer_source(run: Run, path: Path) -> None:
    """A checkpoint's adapter was trained on one transformer; resumed on another (pretrained_model_name_or_path,
    pretrained_transformer_model_name_or_path and its subfolder, revision or variant changed) it continues from
    weights that no longer fit its base: warn, naming both. A moved folder also reads as a change, hence no refusal."""
    saved_file = path / SOURCE_FILE
    if not saved_file.is_file() or getattr(run, "comps", None) is None:  # written by an earlier difftune
        return
    try:
        saved = json.loads(saved_file.read_text())
    except (OSError, ValueError) as e:  # it only feeds this warning: damaged, the resume goes on without it
        run.events.emit("warning", message=f"cannot read {saved_file} ({e}): the transformer this checkpoint "
                        "trained on is not compared with this run's")
        return
    now = run.comps.origin().transformer_identity()
    changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if changed:
        what = "; ".join(f"{k}: {old!r} then, {new!r} now" for k, (old, new) in changed.items())
        run.events.emit("warning", message=f"{path} was trained on another transformer ({what}); the resumed "
                        "weights continue on this one. Resume with the settings it was trained with, or start a new "
                        "output_dir")


def crepa_switched(run: Run, path: Path) -> bool:
    """CREPA's projector trains with the adapter, so the optimizer's saved state holds its weights' moments when
    the checkpoint had it. Switched on now without one: refused, before torch's unreadable optimizer error. Switched
    off, or aligning something else now (DINOv2 and backbone mode, another encoder or block): the run goes on with a
    fresh optimizer state (True), and a fresh projector in the second case, said in a warning."""
    from difftune.train.crepa import PROJECTOR_FILE

    had = (path / PROJECTOR_FILE).is_file()
    if getattr(run, "crepa", None) is not None and not had:
        raise ValueError(f"{path} was trained without CREPA (no {PROJECTOR_FILE}) but crepa_enabled is on; resume "
                         "with crepa_enabled false, or start a new output_dir to train with CREPA from the start")
    if getattr(run, "crepa", None) is None and had:
        run.events.emit("warning", message=f"{path} was trained with CREPA, and crepa_enabled is off now: its "
                        "projector is left out, and the optimizer starts afresh (its saved state holds the "
                        "projector's moments); the weights, step, schedule and data position are resumed")
        return True
    if getattr(run, "crepa", None) is not None and (why := run.crepa.mismatch(path)) is not None:
        run.events.emit("warning", message=f"{path}: {why}: the projector starts afresh, and so does the optimizer "
                        "(its saved state holds the old projector's moments); the weights, step, schedule and data "
                        "position are resumed")
        return True
    return False


def _read(path: Path, name: str, **kwargs: Any) -> Any:
    """torch.load of one of a checkpoint's files; damage that the checks before loading could not see (inside a
    large optimizer state, whose zip directory alone is checked) is a ValueError naming the file and the way on."""
    try:
        return torch.load(path / name, weights_only=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - a damaged pickle or zip raises many types
        earlier = [p.name for p in complete(path.parent.parent) if order(p) < order(path)]
        instead = f"resume_from_checkpoint {earlier[-1]}" if earlier else "resume_from_checkpoint none (start afresh)"
        raise ValueError(f"{path}: its {name} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                         f"resume from the checkpoint before it ({instead})") from e


def load_checkpoint(run: Run, path: Path) -> None:
    check_transformer_source(run, path)  # first: an adapter that then does not fit comes after its explanation
    state = json.loads((path / STATE_FILE).read_text())
    saved = state.get("settings", {})  # absent in checkpoints of an earlier difftune: loaded as they were
    resume_settings.check_batches(run, saved, path)  # refuses an epoch-based run whose batches changed
    fresh = resume_settings.Fresh.of(run)  # the config's hyper-parameters, before the saved ones replace them
    # another optimizer(_config), or CREPA switched off: the saved state does not fit; it is not loaded
    afresh = resume_settings.optimizer_changed(run, saved, path) | crepa_switched(run, path)
    sharded = getattr(run, "fsdp", None) is not None
    if sharded and not afresh:
        # Before the weights: the layout the saved state is read into comes from a first (zero) step on the weights
        # as they are, and Prodigy's state depends on them (an all-zero tensor, a LoRA's B at the start, gets a
        # scalar p0): on the fresh weights it is the layout the saved run made. The weights then overwrite whatever
        # that step did to them.
        load_optimizer(run, path)
    try:
        run.adapter.load_state_dict(load_file(path / "trainable.safetensors"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    if not sharded and not afresh:
        if not (path / "optimizer.pt").is_file():
            raise ValueError(written_by_fsdp(path))
        run.optimizer.load_state_dict(_read(path, "optimizer.pt"))
    run.lr_scheduler.load_state_dict(_read(path, "lr_scheduler.pt"))
    run.state.step = state["step"]
    fresh.apply(run, path)  # changed hyper-parameters take effect; the restored step's rate from this run's schedule
    resume_settings.warn_changes(run, saved, path)  # lora_alpha, seed
    if getattr(run, "crepa", None) is not None:
        run.crepa.load(path)
    train_mode(run.optimizer)  # schedule-free: saved in eval mode; recompute the training weights (all loaded now)
    rng = _read(path, "rng.pt")
    # each process its own states (before: process 0's CPU state for all, no CUDA state); another process count:
    # process 0's
    by_process = rng.get("by_process") or [{"torch": rng["torch"], "cuda": None}]
    own = by_process[run.ranks.index] if len(by_process) == run.ranks.count else by_process[0]
    torch.set_rng_state(own["torch"])
    if own.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(own["cuda"])
    if run.ema is None and (path / "ema.pt").is_file():  # ema/ beside the result would stay an older step's EMA
        run.events.emit("warning", message=f"{path}: its EMA state is not used (use_ema is off): the EMA weights in "
                                           f"{run.output_dir / 'ema'} stay as an earlier run left them, not this run's")
    if run.ema is not None:
        if not (path / "ema.pt").is_file():
            raise ValueError(f"{path} has no EMA state but use_ema is on; resume with use_ema false, "
                             "or start a new output_dir")
        run.ema.load_state_dict(_read(path, "ema.pt", map_location="cpu"))
        if run.ema.changed:  # ema_decay or ema_update_interval changed: accepted, and said in the event log
            run.events.emit("warning", message=f"{path}: {run.ema.changed}")
    restore_generator(run, rng, path)
    if note := run.data.sampler.load_state_dict(state["sampler"]):
        run.events.emit("info", message=f"{path}: {note}")
    run.state.position = run.data.sampler.state_dict()  # by dataset id, of this run's datasets
    run.data.sampler.start_at(run.state.step)  # dataset windows count steps from here
    from difftune.train.windows import WindowError, check_windows

    try:  # over the steps left, with this run's datasets and accumulation
        check_windows(run.data.sampler, run.total_steps, run.events.emit)
    except WindowError as e:
        raise ValueError(f"{path}: resumed at step {run.state.step}: {e}") from e


def clean_partial(output_dir: Path) -> None:
    """Remove leftovers of saves killed before their rename. A complete checkpoint set aside while its
    step was saved again (`.replaced-`) goes back under its name if the new copy never arrived."""
    root = checkpoints_dir(output_dir)
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if p.name.startswith(".replaced-"):
            name = p.name.removeprefix(".replaced-").rsplit("-", 1)[0]
            if not (root / name).exists() and (p / STATE_FILE).is_file():
                os.replace(p, root / name)
            else:
                shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith((".tmp-", ".old-")):
            shutil.rmtree(p, ignore_errors=True)
    for folder in (output_dir, output_dir / "ema"):  # leftovers of save_adapter
        for p in sorted(folder.iterdir()) if folder.is_dir() else []:
            if p.name.startswith(".old-result-"):  # killed between its two renames: put the old result back
                name = p.name.removeprefix(".old-result-").rsplit("-", 1)[0]
                if not (folder / name).exists():
                    os.replace(p, folder / name)
                else:
                    shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith(".tmp-result-"):
                shutil.rmtree(p, ignore_errors=True)
    # a sample killed mid-write (a PNG's `.<name>.tmp`, write_mp4's `.<name>.<pid>.tmp`): the resumed run writes a PNG
    # again under its name, never an MP4's, whose temporary name holds the dead writer's pid. The run lock makes
    # this run the folder's only writer.
    validation = output_dir / "validation"
    for p in sorted(validation.glob(".*.tmp")) if validation.is_dir() else []:
        p.unlink(missing_ok=True)
