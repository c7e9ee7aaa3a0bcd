"""The no-gradient forward passes beside the training step, in the plan: the regularisation teacher
(train/regularisation.py) and the evaluation loss (train/eval_loss.py).

Both run the transformer without gradients, so autograd saves nothing: what they add above the weights is one
block's working set at a time (bounded, as for validation, by that block's saved activations in a training
forward: coefficients 'lora') and their input and output latents.

- The teacher runs inside the training step, just before the student's forward, on the same micro-batch: beside
  it are what the step always holds (weights, adapter, gradients, optimizer state) but none of the student's
  saved activations yet. A training forward saves every block's activations (or, with gradient checkpointing,
  every block's inputs plus one block recomputed in the backward, which is the full block figure): the teacher's
  one block at the same bucket is never more. So the teacher never sets the peak; the plan says so in a note with
  both figures. Its output (the target, fp32) lives through the student's pass: a line of the training phase.
- The evaluation runs between optimizer steps (gradients freed: zero_grad(set_to_none=True)), at the eval
  datasets' buckets, `train_batch_size` samples at most per batch (eval_loss.OnePass). It can exceed the training
  peak only when an eval bucket is much larger than the largest training bucket; then it is a phase of the plan,
  else a note.
"""

from __future__ import annotations

from typing import Any

from difftune.memory_plan import predict as P


def _latent_bytes(arch: Any, bucket: tuple[int, ...], batch: int) -> int:
    """fp32 latents of `batch` samples at `bucket` (8x spatial, 4x temporal for video: tokens_of's rule)."""
    channels = arch.config.get("in_channels") or arch.config.get("out_visual_dim") or 16
    patch = arch.config.get("patch_size", 2)
    p = patch[-1] if isinstance(patch, list | tuple) else patch
    return P.tokens_of(arch, bucket) * p * p * channels * 4 * batch


def block_working_set(arch: Any, blocks: Any, coefficients: dict, bucket: tuple[int, ...], batch: int,
                      text: int) -> int:
    """Upper bound of one block's no-grad working set for `batch` samples at `bucket` with `text` prompt tokens:
    its saved activations."""
    tokens = P.tokens_of(arch, bucket)
    return int(max(P.block_bytes(coefficients["lora"], s, tokens, text) for s in blocks.count) * batch)


def size_text(size: float) -> str:
    return f"{size / P.GIB:.2f} GiB" if size >= P.GIB / 10 else f"{size / 2**20:.1f} MiB"


def teacher_peak(cfg: Any, arch: Any, blocks: Any, coefficients: dict, bucket: tuple[int, ...],
                 training: P.Phase) -> int:
    """The step's bytes while the teacher runs: the training phase less the student's activations (not there
    yet), plus one block's no-grad working set and the teacher's output."""
    batch = cfg.train_batch_size
    student = sum(line.bytes for line in training.lines if line.label in (
        "saved activations", "recomputed block (backward)", "regularisation target (fp32)")
        or line.label.startswith("DoRA: saved") or line.label.startswith("DoRA: recomputed"))
    return (training.total - student + block_working_set(arch, blocks, coefficients, bucket, batch, P.text_tokens(cfg))
            + _latent_bytes(arch, bucket, batch))


def add(cfg: Any, arch: Any, blocks: Any, coefficients: dict, found: list[Any] | None, bucket: tuple[int, ...],
        training: P.Phase, kept: float, notes: list[str]) -> list[P.Phase]:
    """Lines for the teacher pass (into `training`), notes, and the eval phase when it can exceed training.
    `kept`: what stays on the accelerator between steps (weights, adapter, optimizer state, EMA)."""
    phases: list[P.Phase] = []
    batch = cfg.train_batch_size
    if any(getattr(d, "regularisation", False) for d in found or []):
        training.add("regularisation target (fp32)", _latent_bytes(arch, bucket, batch),
                     "the base model's prediction, held through the step")
        teacher = teacher_peak(cfg, arch, blocks, coefficients, bucket, training)
        notes.append(f"regularisation data: the teacher's no-grad forward peaks at {size_text(teacher)} (one "
                     f"block at a time, before the student's activations exist), below the training step's "
                     f"{size_text(training.total)}: it never sets the peak")
    held = [s.group for d in found or [] if d.held_out for s in d.samples]
    if held:
        worst = max(held, key=lambda g: P.tokens_of(arch, g))
        phase = P.Phase("evaluation loss")
        phase.add("what training keeps (weights, adapter, optimizer, EMA)", kept)
        label = f"eval {'x'.join(map(str, worst))} x batch {batch}"
        phase.add(f"{label}: one block's working set (no grad)", block_working_set(arch, blocks, coefficients,
                                                                                   worst, batch, P.text_tokens(cfg)),
                  "upper bound: a block's saved activations")
        phase.add(f"{label}: latents, noise, prediction (fp32)", 3 * _latent_bytes(arch, worst, batch))
        if phase.total > training.total:
            phases.append(phase)
        else:
            notes.append(f"evaluation loss: no-grad forward at {'x'.join(map(str, worst))}, peak "
                         f"{size_text(phase.total)}, below training's {size_text(training.total)}")
    return phases
