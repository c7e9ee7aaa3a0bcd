"""The evaluation loss: the flow-matching loss of the model as it is now on held-out data (the dataset list's
`dataset_type: "eval"` entries), measured at fixed noise levels with fixed noise, so that it moves only when the
weights do (SimpleTuner's eval loss, after "Demystifying SD fine-tuning"). Keys: config/eval_keys.py.

What is measured: for every eval image (or clip) and each of `eval_timesteps` noise levels s_k, the midpoints
(k + 0.5) / N of N equal parts of (0, 1) shifted as training shifts its draws (`flow_schedule_shift`, or the
family's resolution-dependent shift with `flow_schedule_auto_shift`), the mean squared error between the model's
prediction at x = (1 - s) x0 + s noise and the velocity noise - x0 (image-to-video: the first latent frame, the
input image, left out, as in training). Plain squared error whatever `loss_type` and `loss_weighting` are, so the
number compares across those settings. Each sample's noise comes from a generator of its own seeded with `EVAL_SEED`
and the sample's name in its dataset (`noise_seed`), the same at every evaluation and every level (as SimpleTuner
reseeds at each timestep): a dataset's loss does not move when another eval dataset is added, removed or reordered,
nor with train_batch_size, and the same files in two datasets measure alike;
each sample takes its caption as training would in its first epoch, never dropped. The model runs in eval mode
(no LoRA dropout) without gradients, so TREAD routes nothing and CREPA captures nothing, on the unwrapped
transformer (no DDP collective), under the training's autocast; schedule-free optimizers lend their averaged
weights (`eval_weights`), as for validation. Nothing the run draws from (its generator, torch's global RNG) is
touched: a run with eval datasets trains bit for bit as one without them, and resumes alike.

Data: eval entries are discovered, bucketed and cached (latents and text) at start-up with the training datasets
(DatasetPlan.discovered); `prepare` gives each its batches: every item once, one bucket per batch, at most
`train_batch_size`, in a fixed order, partial batches kept. They never reach the training sampler.

When (train/triggers.py): with eval_steps_interval / eval_epoch_interval set, on that schedule (SimpleTuner's
triggers); otherwise wherever validation is triggered (validation_step_interval, validation_epoch_interval) and
after the last step. Never before the first step.

Output: one "eval_loss" event per evaluation: `loss` (every eval sample and level together), `by_level` (the mean
at each level, `sigmas`, or null with the auto shift, whose levels depend on each bucket), `datasets` (each eval
dataset's mean; empty with eval_dataset_pooling), `samples`. The trackers chart eval/loss and eval/loss/<id>
(train/trackers.py); the console prints the message; the web UI charts the loss. The live weights are measured,
not the EMA's (use_ema).

Several processes: process 0 measures alone while the others wait at the barrier, as for validation (FSDP2: under
`unsharded`, so process 0 runs the forward passes without collectives).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from difftune.config.eval_keys import EVAL_SEED
from difftune.data.batches import NoUsableItem, TrainingData
from difftune.data.latents import CachedSample
from difftune.data.sampler import SamplerState
from difftune.train import objective
from difftune.train.caching import progress
from difftune.train.fsdp import unsharded
from difftune.train.optimizers import eval_weights
from difftune.train.plan import DataError

if TYPE_CHECKING:
    from difftune.config import RunConfig
    from difftune.data.batches import Batch
    from difftune.models.base import Family
    from difftune.train.caching import Cached
    from difftune.train.events import Events
    from difftune.train.setup import Run


class OnePass:
    """The batches of an evaluation, in the place of TrainingData's sampler: every item once, one bucket per
    batch (at most `batch_size`), in a fixed order, the last batch of a bucket possibly partial."""

    def __init__(self, items: list[CachedSample], batch_size: int):
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for index, item in enumerate(items):
            groups[item.sample.group].append(index)
        self.batches = [members[k : k + batch_size] for _, members in sorted(groups.items())
                        for k in range(0, len(members), batch_size)]
        self.state = SamplerState()

    def __iter__(self):
        self.state = SamplerState()  # each evaluation starts over: the same batches and captions every time
        for batch in self.batches:
            self.state.index += 1
            yield batch

    def batches_per_epoch(self) -> int:
        return len(self.batches)

    def state_dict(self) -> dict:
        return {"epoch": 0, "index": self.state.index, "streams": []}


@dataclass
class EvalSet:
    data: dict[str, TrainingData]  # eval dataset id -> its batches
    levels: int  # eval_timesteps
    pooled: bool  # eval_dataset_pooling

    def samples(self) -> int:
        return sum(len(d.items) for d in self.data.values())


def prepare(run_cfg: RunConfig, family: Family, cached: Cached, encode: Any, events: Events) -> EvalSet | None:
    """The eval datasets' batches from the filled caches (None without eval datasets, or with eval_loss_disable,
    whose eval entries config/eval_keys.py left out)."""
    cfg, plan = run_cfg.train, run_cfg.datasets
    if not plan.evaluation or cfg.eval_loss_disable:
        return None
    data, sizes = {}, []
    for ds in plan.evaluation:
        items = [c for c in cached.samples if c.sample.dataset_id == ds.id]
        if not items:
            raise DataError(f"eval dataset {ds.id!r} has no image that could be decoded; see the warnings above for "
                            "each file, or disable the entry")
        data[ds.id] = TrainingData(
            items, cached.text_caches, OnePass(items, cfg.train_batch_size), family.collate_text, 0.0, cfg.seed,
            encode=encode, on_skip=lambda message: events.emit("warning", message=message),
            first_frame=family.facts.first_frame(cfg.flavour()),
        )
        sizes.append(f"{ds.id!r} ({len(items)} held out, {data[ds.id].sampler.batches_per_epoch()} batches)")
    events.emit("info", message=f"evaluation loss on {', '.join(sizes)} at {cfg.eval_timesteps} noise levels")
    return EvalSet(data, cfg.eval_timesteps, cfg.eval_dataset_pooling)


def noise_levels(count: int, shift: float, device: torch.device) -> torch.Tensor:
    """The `count` evaluation noise levels [count]: midpoints of equal parts of (0, 1), shifted."""
    return objective.shift_sigmas((torch.arange(count, dtype=torch.float32, device=device) + 0.5) / count, shift)


def noise_seed(name: str) -> int:
    """The seed of a sample's evaluation noise: `EVAL_SEED` and its name below its dataset's folder."""
    return int.from_bytes(hashlib.sha256(f"{EVAL_SEED}:{name}".encode()).digest()[:8], "little") >> 1


def batch_losses(run: Run, model: Any, batch: Batch, count: int, generator: torch.Generator,
                 seeds: list[int]) -> torch.Tensor:
    """Squared error of each sample at each level [count, B] (float64), for a batch on the device. `seeds`: each
    sample's noise seed (`noise_seed`), drawn from `generator`."""
    cfg, device, dtype = run.cfg, run.accelerator.device, run.comps.transformer.dtype
    x0 = batch.latents
    shift = run.family.auto_shift(run.comps, tuple(x0.shape[2:])) if cfg.flow_schedule_auto_shift \
        else cfg.flow_schedule_shift  # as loop.micro_step shifts its draws
    levels = noise_levels(count, shift, device)
    noise = torch.stack([torch.randn(x0.shape[1:], generator=generator.manual_seed(seed), device=generator.device)
                         for seed in seeds]).to(device)
    target = objective.velocity_target(x0, noise).float()
    conditioning = None if batch.conditioning is None else batch.conditioning.to(device, dtype)
    first = 1 if run.first_frame else 0  # image-to-video: the input frame is not trained, nor measured
    out = []
    for level in levels:
        sigmas = level.expand(x0.shape[0])
        with run.accelerator.autocast():
            pred = run.family.predict(model, objective.noisy_input(x0, noise, sigmas).to(device, dtype), sigmas,
                                      batch.text, conditioning)
        error = (pred.float() - target)[:, :, first:] ** 2
        out.append(error.reshape(error.shape[0], -1).mean(dim=1).double())
    return torch.stack(out)


@torch.no_grad()
def measure(run: Run) -> dict[str, tuple[torch.Tensor, int]]:
    """Per eval dataset: (sum over its samples of each level's error [levels], samples measured)."""
    eval_set: EvalSet = run.eval_set
    model = run.accelerator.unwrap_model(run.transformer)  # outside DDP: no collective, no gradient bookkeeping
    device = run.accelerator.device
    generator = torch.Generator(device=device)  # never the run's: training is untouched
    advance = progress(run.events, f"evaluation loss (step {run.state.step})", eval_set.samples())
    was_training = model.training
    model.eval()
    sums: dict[str, tuple[torch.Tensor, int]] = {}
    # torch's global RNG comes back as it was, whatever runs meanwhile (on-the-fly encoding of an eval dataset)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            _measure_each(run, model, eval_set, generator, advance, sums)
        finally:
            model.train(was_training)
    return sums


def _measure_each(run: Run, model: Any, eval_set: EvalSet, generator: torch.Generator, advance: Any,
                  sums: dict[str, tuple[torch.Tensor, int]]) -> None:
    """Fill `sums` dataset by dataset, batch by batch (each sample's noise drawn from `generator` at its seed)."""
    device = run.accelerator.device
    for ident, data in eval_set.data.items():
        total, seen = torch.zeros(eval_set.levels, dtype=torch.float64, device=device), 0
        seeds = {item.sample.path: noise_seed(item.sample.name or item.sample.path.name) for item in data.items}
        try:
            for batch in data:
                batch = batch.to(device)
                total += batch_losses(run, model, batch, eval_set.levels, generator,
                                      [seeds[path] for path in batch.paths]).sum(dim=1)
                seen += batch.latents.shape[0]
                if advance:
                    advance(batch.latents.shape[0])
        except NoUsableItem:  # every item's cache entry was damaged (each reported): measured without it
            run.events.emit("warning", message=f"eval dataset {ident!r}: no usable item left (damaged cache "
                                               "entries, re-encoded at the next start); not measured")
        if seen:
            sums[ident] = (total.cpu(), seen)


def report(run: Run, sums: dict[str, tuple[torch.Tensor, int]]) -> dict[str, Any] | None:
    """The "eval_loss" event of these sums (None when nothing was measured)."""
    if not sums:
        return None
    eval_set: EvalSet = run.eval_set
    total = sum(s for s, _ in sums.values())
    count = sum(n for _, n in sums.values())
    by_level = (total / count).tolist()
    loss = sum(by_level) / len(by_level)
    datasets = {} if eval_set.pooled else {ident: float(s.mean()) / n for ident, (s, n) in sums.items()}
    step = run.state.step
    shift = "auto" if run.cfg.flow_schedule_auto_shift else run.cfg.flow_schedule_shift
    parts = f" ({', '.join(f'{k} {v:.4f}' for k, v in datasets.items())})" if len(datasets) > 1 else ""
    # the levels themselves, unless the auto shift makes them depend on each bucket's size
    sigmas = None if shift == "auto" else noise_levels(eval_set.levels, shift, torch.device("cpu")).tolist()
    record = dict(step=step, loss=loss, by_level=by_level, sigmas=sigmas, shift=shift, datasets=datasets,
                  pooled=eval_set.pooled, samples=count,
                  message=f"evaluation loss at step {step}: {loss:.4f}{parts} ({count} held-out samples)")
    run.events.emit("eval_loss", **record)
    return record


def evaluate(run: Run) -> None:
    """Measure the evaluation loss and write its event: process 0 alone, the others wait (module docstring)."""
    if getattr(run, "eval_set", None) is None:
        return
    with eval_weights(run), unsharded(run):  # schedule-free: its averaged weights; FSDP: the weights whole
        if run.ranks.main:
            report(run, measure(run))
    run.ranks.barrier()
