"""What the loop does after an optimizer step: validate, evaluate (CLIP), checkpoint. Each fires every N
optimizer steps (`validation_step_interval`, `eval_steps_interval`, `checkpoint_step_interval`) and/or every N
epochs (`validation_epoch_interval`, `eval_epoch_interval`, `checkpoint_epoch_interval`); with both set, a step
that either schedule reaches fires once. Before the first step, `base_samples_due` says whether the base model
is sampled (`disable_benchmark: false`, `validation_on_startup`). Config side: config/validation_triggers.py.

Where epochs end: the loop records, after each step, the sampler position of the last batch it trained on
(`TrainState.position`, the sampler's state just after that batch). The read-ahead thread is further on, so
its own sampler state is not used. Batches trained so far are `epoch * batches_per_epoch + index`, and a step
reaches the point k * interval epochs when it moves that count from below k * interval * batches_per_epoch to
at least it. So:
- with gradient accumulation an epoch can end inside an optimizer step: the trigger fires after that step (the
  first step that trained on the epoch's last batch). SimpleTuner restarts its data loader each epoch, so its
  last step of an epoch may be short; here the batches run on across epochs and every step is whole;
- a batch the sampler drew but no process trained on (every item left out) still counts: positions, not
  batches seen, are compared;
- a resumed run starts from the checkpoint's position, which already includes every epoch its steps reached,
  so an epoch trigger never fires twice across a resume (the checkpoint of a step is written after its
  validation: a kill while sampling resumes before that step and samples it again).
The last step triggers no validation or checkpoint of its own: the end of training writes both.
Rolling checkpoints (`checkpointing_rolling_steps`) fire every N steps into their own series; a step due for a
regular checkpoint too writes only the regular one.
The evaluation loss of eval datasets (train/eval_loss.py) follows eval_steps_interval / eval_epoch_interval when
either is set; otherwise it fires where validation does, and after the last step too (the final weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from difftune.config.validation_triggers import samples_base_model

if TYPE_CHECKING:
    from difftune.train.setup import Run


@dataclass(frozen=True)
class Due:
    validation: bool = False
    evaluation: bool = False
    checkpoint: bool = False
    rolling_checkpoint: bool = False  # checkpointing_rolling_steps (never with `checkpoint`)
    eval_loss: bool = False  # the evaluation loss of eval datasets (train/eval_loss.py)


def batches_done(position: dict | None, per_epoch: int) -> int:
    """Sampler batches consumed up to `position` (a sampler state_dict; None: the start)."""
    if not position:
        return 0
    return int(position["epoch"]) * per_epoch + int(position["index"])


def epoch_reached(before: dict | None, after: dict | None, per_epoch: int, interval: float | None) -> bool:
    """Whether moving from position `before` to `after` reached a multiple of `interval` epochs."""
    if not interval or per_epoch <= 0:
        return False
    span = Fraction(str(interval)) * per_epoch  # batches between two triggers (str: 0.1 is 1/10, not a float's)
    return (math.floor(batches_done(after, per_epoch) / span)
            > math.floor(batches_done(before, per_epoch) / span))


def step_reached(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


def due(run: Run, before: dict | None) -> Due:
    """What step `run.state.step` triggers; `before` is the position before that step's batches."""
    cfg, step, after = run.cfg, run.state.step, run.state.position
    per_epoch = run.data.sampler.batches_per_epoch()

    def reached(step_interval: int, epoch_interval: float | None) -> bool:
        return step_reached(step, step_interval) or epoch_reached(before, after, per_epoch, epoch_interval)

    clip = cfg.evaluation_type == "clip"
    checkpoint = reached(cfg.checkpoint_step_interval, cfg.checkpoint_epoch_interval) and step < run.total_steps
    # the evaluation loss: on SimpleTuner's eval schedule when set, else where validation fires and after the last step
    eval_scheduled = bool(cfg.eval_steps_interval or cfg.eval_epoch_interval)
    return Due(
        validation=reached(cfg.validation_step_interval, cfg.validation_epoch_interval) and step < run.total_steps,
        # eval_steps_interval 0 means "score each validation's samples" (train/evaluation.py), not a schedule
        evaluation=clip and reached(cfg.eval_steps_interval, cfg.eval_epoch_interval),
        checkpoint=checkpoint,
        rolling_checkpoint=(not checkpoint and step_reached(step, cfg.checkpointing_rolling_steps)
                            and step < run.total_steps),
        eval_loss=getattr(run, "eval_set", None) is not None and (
            reached(cfg.eval_steps_interval, cfg.eval_epoch_interval) if eval_scheduled else
            reached(cfg.validation_step_interval, cfg.validation_epoch_interval) or step == run.total_steps),
    )


def base_samples_due(run: Any) -> bool:
    """Sample the base model now: asked for, and no step trained yet (a resumed run has them already). The same
    answer on every process (only process 0 holds `run.validation`; the others wait at `loop.sample`'s barrier);
    the config makes sure there are prompts."""
    return samples_base_model(run.cfg) and run.state.step == 0
