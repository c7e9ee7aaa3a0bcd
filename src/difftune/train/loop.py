"""The training loop. Everything optional was applied to the objects in `setup.build_run`."""

from __future__ import annotations

import math
import os
import time
import traceback
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch

from difftune.data.batches import Batch
from difftune.data.cache import nonfinite
from difftune.train import (
    crepa,
    eval_loss,
    evaluation,
    layersync,
    masked_loss,
    noise_levels,
    objective,
    prefetch,
    regularisation,
    rollout,
    triggers,
)
from difftune.train.checkpoint import (
    PREFIX,
    CheckpointError,
    checkpoints_dir,
    clean_partial,
    is_rolling,
    load_checkpoint,
    resolve_resume,
    rng_states,
    save_adapter,
    save_checkpoint,
    set_aside_later,
    set_aside_result,
)
from difftune.train.commands import poll_commands
from difftune.train.distributed import average_gradients
from difftune.train.fsdp import gathered, unsharded
from difftune.train.memory import record_peak_memory, reset_peak_memory
from difftune.train.optimizers import clip_gradients, eval_weights
from difftune.train.run_lock import Terminated, held, stop_reason, take_held
from difftune.train.setup import Run
from difftune.train.validation import BASE_LABEL, SamplingAbandoned, validate


def micro_step(run: Run, batch: Batch) -> torch.Tensor:
    """Loss of one micro-batch (already on the device: train/prefetch.py). Noise and timesteps come from the
    run's own seeded generator, which lives on the device: no host work, no copy, and a resume continues it."""
    x0 = batch.latents
    shift = run.cfg.flow_schedule_shift
    if run.cfg.flow_schedule_auto_shift:
        shift = run.family.auto_shift(run.comps, tuple(x0.shape[2:]))
    # Noise and noise levels are drawn for the global batch, then this process's slice is taken: the
    # same numbers as a single process training the whole batch.
    size, lo = max(batch.global_size, x0.shape[0]), batch.offset
    g = run.generator
    noise = torch.randn((size, *x0.shape[1:]), generator=g, device=g.device)[lo : lo + x0.shape[0]]
    start = noise_levels.cycle_start(run.state.step, run.cfg.gradient_accumulation_steps, run.state.micro, size)
    sigmas = objective.sample_sigmas(size, shift, g, run.sampling, start)[lo : lo + x0.shape[0]]
    if run.tread is not None:  # TREAD's routes too are drawn for the global batch
        run.tread.window = (size, lo)
    # input_perturbation: the input is built from noise + strength * eps; the target below keeps `noise`
    perturbed = objective.perturbed_noise(noise, objective.perturbation(run.cfg, run.state.step), g, size, lo)
    device, dtype = run.accelerator.device, run.comps.transformer.dtype
    rolled = rollout.noisy_input(run, batch, x0, noise, sigmas, shift, perturbed)  # scheduled sampling, when on
    target = regularisation.target(run, batch, x0, rolled, sigmas)  # regularisation data: the base model's prediction
    with run.accelerator.autocast():
        # image-to-image: the input images' latents; image-to-video: each clip's first frame encoded alone
        conditioning = None if batch.conditioning is None else batch.conditioning.to(device, dtype)
        pred = run.family.predict(run.transformer, rolled.x.to(device, dtype), sigmas.to(device), batch.text,
                                  conditioning)
    first = 1 if run.first_frame else 0  # the sampler never updates the input frame: it is not trained either
    pred, target = pred[:, :, first:], target[:, :, first:]
    weights = None if run.cfg.loss_weighting == "none" else objective.loss_weights(sigmas, run.cfg.loss_weighting)
    element = objective.pointwise(run.cfg, sigmas)  # loss_type: squared error, pseudo-Huber or smooth L1
    element = masked_loss.weighted(run, batch, element)  # loss masks (conditioning_type 'mask'), when the batch has them
    loss = rollout.loss(run.cfg, pred, target, weights, rolled, first, element)  # ReflexFlow on rolled-out samples
    loss = crepa.add_term(run, loss, x0)  # crepa_enabled: + alignment
    return layersync.add_term(run, loss, x0)  # layersync_enabled: + self-alignment


class NonFiniteError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient."""


class StepLoss(float):
    """A step's mean loss. When it is not finite, `data_problem` says which inputs were bad, if any: then
    the data, not the learning rate, is to blame."""

    data_problem: str | None = None
    terms: dict[str, float] = {}  # noqa: RUF012 - replaced, never changed in place: the regularizers' figures


def input_problem(batch: Batch) -> str | None:
    """Which of a batch's inputs hold NaN or inf, or latents of absurd size, with the files; or None."""
    images = {"latents": batch.latents} | ({} if batch.conditioning is None else {"input-image latents": batch.conditioning})
    tensors = images | {f"text {k}": v for k, v in batch.text.items() if isinstance(v, torch.Tensor)}
    bad = nonfinite(tensors)
    what = f"its {bad} hold NaN or inf" if bad else None
    peak = max(float(t.abs().max()) for t in images.values() if t.numel())
    if what is None and peak > 1e4:  # normalized latents are of order 1; this is damaged data, not training
        what = f"its latents reach {peak:.3g} (normalized latents are of order 1)"
    if what is None:
        return None
    return f"the batch's data is bad: {what} (files: {', '.join(str(p) for p in batch.paths) or 'unknown'})"


def _scalar(norm: object, device: torch.device) -> torch.Tensor:
    """The gradient norm as a 0-d float tensor on `device` (inf when it was not measured)."""
    if not isinstance(norm, torch.Tensor):
        return torch.tensor(math.inf if norm is None else float(norm), device=device)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a replicated DTensor
    return norm.detach().float().reshape(()).to(device)


def optimizer_step(run: Run, batches: Iterator[Batch]) -> float:
    """One optimizer step over `gradient_accumulation_steps` micro-batches. Returns the mean loss; a
    step whose loss or gradient is not finite changes no weight (and returns that non-finite loss).

    The host reads the device once per step, after the backward passes (losses and gradient norm together):
    the micro-batches queue up on the accelerator without waiting for each other's loss."""
    accum = run.cfg.gradient_accumulation_steps
    losses, seen = [], []
    for micro in range(accum):
        sync = micro == accum - 1
        with nullcontext() if sync else run.accelerator.no_sync(run.transformer):
            batch = next(batches)
            run.state.micro = micro  # round-robin noise levels: the place in the cycle (train/noise_levels.py)
            run.throughput.add(batch)
            loss = micro_step(run, batch)
            run.accelerator.backward(loss / accum)
        losses.append(loss.detach().float())
        seen.append(batch)
    # A checkpoint resumes after the batches consumed: only once all of the step's are (a stop that cuts the step
    # leaves the position of the step before, which the checkpoint's step count matches)
    run.state.position = seen[-1].position
    average_gradients(run.averaged, run.ranks)  # several processes: what DDP does not wrap (LyCORIS's network)
    norm = clip_gradients(run.accelerator, run.params, run.cfg.max_grad_norm, run.cfg.grad_clip_method, run.optimizer)
    terms = {name: torch.stack(values).mean().to(losses[0].device) for name, values in run.terms.items()}
    run.terms.clear()
    read = torch.stack([*losses, _scalar(norm, losses[0].device), *terms.values()])
    listed = read.tolist()  # the step's one device sync
    *values, norm_value = listed[: accum + 1]
    figures = dict(zip(terms, listed[accum + 1 :], strict=True))
    # every process logs, and decides on non-finite steps, alike (the terms' means come in the same collective)
    total, *means = run.ranks.means([sum(values) / accum, *figures.values()])
    if not math.isfinite(total) or (norm is not None and not math.isfinite(norm_value)):
        run.optimizer.zero_grad(set_to_none=True)
        result = StepLoss(math.nan if math.isfinite(total) else total)
        result.data_problem = next((p for v, b in zip(values, seen, strict=True) if not math.isfinite(v)
                                    and (p := input_problem(b))), None)
        return result
    run.optimizer.step()
    run.lr_scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    result = StepLoss(total)
    result.terms = {name: float(f"{value:.6g}") for name, value in zip(figures, means, strict=True)}
    return result


def checkpoint(run: Run, rolling: bool = False, **extra: object) -> None:
    """Process 0 writes (into the rolling series with `rolling`); every process waits, so none runs ahead of a
    checkpoint. A step already checkpointed (a stop or a save command right after the interval's checkpoint, the end
    of a run resumed at its last step) is not written again."""
    if not rolling and run.state.checkpointed == run.state.step:
        return
    # schedule-free: its averaged weights and eval-mode state are saved (eval_weights); FSDP: every process
    # gathers, process 0 writes
    # each process's torch RNG states, CPU and CUDA (peft's lora_dropout draws from them): a resume restores its own
    process_rng = run.ranks.gather(rng_states())
    with eval_weights(run, for_checkpoint=True), gathered(run, optimizer=True, step=run.state.step):
        if run.ranks.main:
            path, pruned = save_checkpoint(run, rolling, process_rng)  # pruned: those the series' limit removed
            run.events.emit("checkpoint", step=run.state.step, path=str(path), pruned=pruned,
                            **({"rolling": True} if rolling else {}), **extra)
    run.ranks.barrier()
    if not rolling:
        run.state.checkpointed = run.state.step


def sample(run: Run, label: str, base: bool = False) -> list[Path]:
    # schedule-free: sampled with its averaged weights; FSDP: the weights whole, so that process 0 samples alone
    paths: list[Path] = []
    first = run.ranks.main and not run.state.validation_memory
    if first:
        reset_peak_memory(run.accelerator.device)
    with eval_weights(run), unsharded(run):
        try:
            paths = validate(run, label, base) if run.ranks.main else []
        except SamplingAbandoned:
            run.events.emit("warning", message=f"validation {label} abandoned: a stop signal came (the run stops "
                            "after this step, with its checkpoint)")
    if first:  # its own peak, which the planner predicts as a phase (an abandoned one's too: the counter was reset)
        record_peak_memory(run.events, "first validation", run.accelerator.device)
        run.state.validation_memory = True
    run.ranks.barrier()
    return paths


def handle_commands(run: Run) -> bool:
    """Act on queued commands (see train/commands.py); process 0 reads them and tells the others. Each process
    also tells whether it got a SIGTERM (held until here, train/run_lock.py): then every one stops, after the same
    step. Returns True when the run must stop."""
    stale: list[str] = []  # commands sent to an earlier run of this output_dir, which died before reading them
    shared = run.ranks.gather((poll_commands(run.output_dir, stale) if run.ranks.main else [], take_held()))
    for line in stale:
        run.events.emit("warning", message=line)
    if signum := next((signum for _, signum in shared if signum is not None), None):
        raise Terminated(signum)
    commands = shared[0][0]
    stop = False
    for command in commands:
        run.events.emit("command", command=command, step=run.state.step)
        if command == "save":
            checkpoint(run)
        elif command == "sample":
            sample(run, f"manual-step-{run.state.step:06d}")
        elif command == "stop":
            stop = True
    return stop


def train(run: Run) -> Path:
    """Train to `run.total_steps` (or until a stop command); returns the path of the saved adapter."""
    try:
        return _train(run)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM on the command line (train/run_lock.py)
        run.events.emit("stopped", step=run.state.step, reason=stop_reason(e))
        raise
    except BaseException as e:
        # off the console, as failures_reported's: the command line prints the error (a line, or the traceback)
        run.events.emit("error", quiet=True, step=run.state.step, message=f"{type(e).__name__}: {e}",
                        traceback=traceback.format_exc())
        raise
    finally:
        run.events.close()


def _train(run: Run) -> Path:
    cfg = run.cfg
    if run.ranks.main:
        clean_partial(run.output_dir)
    run.ranks.barrier()
    _start_point(run)
    run.events.emit("start", total_steps=run.total_steps, step=run.state.step, pid=os.getpid(),
                    processes=run.ranks.count, project=cfg.tracker_project_name, run_name=cfg.tracker_run_name)
    run.transformer.train()
    if triggers.base_samples_due(run):  # disable_benchmark false / validation_on_startup, not after a resume
        sample(run, BASE_LABEL, base=True)
    batches = prefetch.feed(run)  # read ahead in a thread, copied to the device without blocking
    try:
        # A SIGTERM is held until handle_commands, after the step's work: several processes agree there on the step
        # to stop after, and one process no longer loses a validation due at that step without a word (a sampling
        # under way is abandoned with a warning); a checkpoint due at that step is the interrupted one
        with held():
            stopped, evaluation_owed = _steps(run, batches)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM on the command line (train/run_lock.py)
        checkpoint(run, reason=stop_reason(e))
        raise
    finally:
        batches.close()
    checkpoint(run)
    with eval_weights(run), gathered(run):  # schedule-free: the averaged weights are the result
        adapter = save_adapter(run, run.output_dir) if run.ranks.main else run.output_dir
    if run.ema is not None and run.ranks.main:
        if not run.ema.num_updates:  # ema_update_interval above the steps trained: the EMA is the starting weights
            run.events.emit("warning", message=f"the EMA was never updated ({run.state.step} steps, ema_update_interval "
                            f"{run.cfg.ema_update_interval}): the saved EMA weights are the starting ones; lower "
                            "ema_update_interval")
        with run.ema.swap():
            run.events.emit("info", message=f"EMA weights saved to {save_adapter(run, run.output_dir / 'ema')}")
    if stopped:
        run.events.emit("info", message=f"stopped by a stop command at step {run.state.step} of {run.total_steps}; "
                        "resume_from_checkpoint 'latest' goes on from here")
        run.events.emit("stopped", step=run.state.step, adapter=str(adapter), reason="stop command")
        if evaluation_owed:
            evaluation.evaluate(run)
        run.ranks.barrier()
        return adapter
    samples = sample(run, f"final-step-{run.state.step:06d}")
    if evaluation_owed:  # the last step's CLIP evaluation, of the final validation's samples
        evaluation.evaluate(run)
    run.events.emit("done", step=run.state.step, adapter=str(adapter), samples=[str(p) for p in samples])
    return adapter


def _start_point(run: Run) -> None:
    """Resume (resume_from_checkpoint), then move every checkpoint after the step this run starts from aside
    (checkpoint.set_aside_later): they belong to an earlier run or an abandoned branch, and left in place 'latest'
    would later resume them and checkpoints_total_limit would prune this run's newer work first."""
    cfg = run.cfg
    warn = lambda message: run.events.emit("warning", message=message)  # noqa: E731
    if cfg.resume_from_checkpoint == "latest" and run.ranks.main:
        # SimpleTuner keeps its checkpoints directly in output_dir: a user reusing that folder would start afresh
        theirs = sorted(p.name for p in run.output_dir.glob(f"{PREFIX}*") if p.is_dir())
        if theirs:
            warn(f"{run.output_dir} holds {_names(theirs)} directly (SimpleTuner's layout): difftune cannot resume "
                 f"those, and 'latest' looks only in {checkpoints_dir(run.output_dir)}. To start from one's LoRA, set "
                 "init_lora: <that folder>/pytorch_lora_weights.safetensors")
    ckpt = resolve_resume(run.output_dir, cfg.resume_from_checkpoint, warn) if cfg.resume_from_checkpoint else None
    if ckpt is not None:
        try:
            load_checkpoint(run, ckpt)
        except CheckpointError:
            raise
        except ValueError as e:  # the checkpoint does not fit this run: said as an `error:`, not a traceback
            raise CheckpointError(str(e) if str(ckpt) in str(e) else f"{ckpt}: {e}") from e
        run.events.emit("info", message=f"resumed from {ckpt} at step {run.state.step}")
        if ckpt.parent == checkpoints_dir(run.output_dir) and not is_rolling(ckpt):  # this run's regular series
            run.state.checkpointed = run.state.step
        if run.state.step >= run.total_steps:
            warn(f"{ckpt.name} is at step {run.state.step}, already at or past this run's {run.total_steps} steps: "
                 f"nothing is trained, and the result saved is step {run.state.step}'s. For an earlier step, set "
                 f"resume_from_checkpoint to an earlier checkpoint (checkpoint-NNNNNNN, under "
                 f"{checkpoints_dir(run.output_dir)}), or load that checkpoint's pytorch_lora_weights.safetensors as it is")
    start = run.state.step
    run.ranks.barrier()  # every process has read its checkpoint before any is moved
    if run.ranks.main:
        aside, moved = set_aside_later(run.output_dir, start)
        if moved:
            how = (f"this run continues from {ckpt.name}" if ckpt is not None else
                   "this run starts from step 0" + ("" if cfg.resume_from_checkpoint else
                                                    " (resume_from_checkpoint is not set; 'latest' resumes the newest)"))
            warn(f"{len(moved)} checkpoint(s) after step {start} ({_names(moved)}) are from an earlier run or branch "
                 f"and {how}: moved them into {aside}, so that 'latest' and checkpoints_total_limit never take them "
                 f"for this run's. Nothing was deleted; to resume one, move it back into {checkpoints_dir(run.output_dir)}")
        aside, moved = set_aside_result(run.output_dir) if ckpt is None else (None, [])
        if moved:
            warn(f"{run.output_dir} holds an earlier run's result ({_names(moved)}) and this run starts from step 0: "
                 f"moved it into {aside}, so that this run does not overwrite it. Nothing was deleted")
    run.ranks.barrier()


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:3])}, ..., {names[-1]}"


def _steps(run: Run, batches: Iterator[Batch]) -> tuple[bool, bool]:
    """Optimizer steps, each followed by what falls due after it, to `run.total_steps`. Returns whether a stop
    command ended them early, and whether a CLIP evaluation is due after the last one."""
    cfg = run.cfg
    started = time.perf_counter()
    stopped = evaluation_owed = False
    bad_steps = 0
    first = run.state.step + 1  # this process's first optimizer step (later than 1 after a resume)
    before = run.state.position  # where the epoch triggers count from (the checkpoint's position after a resume)
    while run.state.step < run.total_steps and not stopped:
        with held():  # a SIGTERM waits for the step to end: a checkpoint mid-step would not resume exactly
            began = time.perf_counter()
            # the rate this step trains with (the step advances it); torchao's optimizers keep it as a tensor,
            # which the scheduler then changes in place: read as a number now
            lr = float(run.lr_scheduler.get_last_lr()[0])
            loss = optimizer_step(run, batches)
            # before the first step's memory event resets CUDA's peak counter (train/throughput.py)
            speed = run.throughput.step_fields(time.perf_counter() - began)
            run.state.step += 1
            step = run.state.step
            if step == first:
                record_peak_memory(run.events, "first optimizer step", run.accelerator.device)
            bad_steps = bad_steps + 1 if not math.isfinite(loss) else 0
            if bad_steps:
                cause = getattr(loss, "data_problem", None)  # bad inputs: the data is to blame, not the lr
                run.events.emit("warning", message=f"step {step}: loss or gradient not finite ({loss})"
                                + (f" because {cause}" if cause else "") + "; step skipped, weights unchanged")
                if bad_steps >= cfg.max_nonfinite_steps:
                    advice = (f"the last one because {cause}. Remove or replace those files (their cache "
                              "entries are re-encoded when the files change)" if cause else
                              "lower learning_rate, set max_grad_norm, or check the data")
                    raise NonFiniteError(f"{bad_steps} steps in a row had a non-finite loss or gradient; training "
                                         f"stopped. The last checkpoint is intact: {advice}")
                continue  # a skipped step triggers nothing; an epoch it ended triggers at the next step
            if run.ema is not None:
                run.ema.step(step)
            run.events.emit("step", step=step, loss=float(loss), lr=lr, elapsed=time.perf_counter() - started,
                            **speed, **loss.terms)
        # Validation before the checkpoint of the same step: a kill while sampling then resumes
        # from the previous checkpoint and samples again, instead of losing these images.
        due, before = triggers.due(run, before), run.state.position  # step and epoch intervals
        if due.validation:
            sample(run, f"step-{step:06d}")
        if due.evaluation and step == run.total_steps:  # evaluation_type clip: the last step's scores the final
            evaluation_owed = True                         # validation's samples, after it (train/evaluation.py)
        elif due.evaluation:
            evaluation.evaluate(run)
        run.validated = None  # a validation's samples wait for an evaluation of their own step only
        if due.eval_loss:  # dataset_type 'eval': the loss on held-out data
            eval_loss.evaluate(run)
        if due.checkpoint or due.rolling_checkpoint:
            checkpoint(run, rolling=due.rolling_checkpoint)  # checkpointing_rolling_steps: its own series
        stopped = handle_commands(run)
    return stopped, evaluation_owed
