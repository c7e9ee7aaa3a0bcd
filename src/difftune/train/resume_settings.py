"""What a resume does with settings changed since its checkpoint: `Fresh.of(run)` before loading, `Fresh.apply` after.

A checkpoint's optimizer.pt and lr_scheduler.pt hold the hyper-parameters the saved run had (param groups,
the schedule's base rate). Loaded as they are, a changed learning_rate, lr_scale, adam_beta1/2, adam_weight_decay,
adam_epsilon or optimizer_config setting would be silently ignored, and the first step after a resume would train
at the old schedule's rate (lr 0 when max_train_steps was raised on a decaying schedule). So the freshly built
optimizer's values (the config's) are kept aside before loading and put back after it, and the rate of the
restored step is recomputed from the rebuilt schedule. With an unchanged config every value put back is the one
loaded (the same float computed the same way), so an exact resume stays bit-identical.

training_state.json records the run's `settings` (`recorded`) for the next resume to compare: a changed optimizer
or optimizer_config resumes with a fresh optimizer state (`optimizer_changed`: a setting such as amsgrad changes
what the state holds, so it cannot simply be put into the param groups); a changed batch size, accumulation or process count is
refused for an epoch-based run and warned about otherwise (`check_batches`); a changed lora_alpha or seed is
warned about (`warn_changes`). Checkpoints written before this record are loaded as before.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.config.resume_check import batch_changes, batches_refusal
from difftune.train.optimizers import OPTIMIZER_ALIASES

if TYPE_CHECKING:
    from difftune.train.setup import Run

# param-group keys difftune's own config keys set (a changed optimizer_config gives a fresh optimizer instead)
# param-group key -> config key(s); torch-optimi's optimizers (adamw_bf16, optimi-*) keep beta1 and beta2 apart
_NAMES = {"betas": ("adam_beta1", "adam_beta2"), "beta1": "adam_beta1", "beta2": "adam_beta2",
          "weight_decay": "adam_weight_decay", "eps": "adam_epsilon"}


def recorded(run: Run) -> dict[str, Any]:
    """The settings training_state.json keeps for the next resume to compare with its config."""
    cfg = run.cfg
    return {
        "optimizer": OPTIMIZER_ALIASES.get(cfg.optimizer, cfg.optimizer), "optimizer_config": cfg.optimizer_settings(),
        "train_batch_size": cfg.train_batch_size, "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "processes": run.ranks.count, "lora_rank": cfg.lora_rank, "lora_alpha": cfg.effective_lora_alpha(),
        "seed": cfg.seed, "batches_per_epoch": run.data.sampler.batches_per_epoch(),
        "samples": len(run.data.items), "samples_digest": samples_digest(run),
        # how the frozen base computes: a resume goes on with other numbers when they change
        "base_model_precision": cfg.base_model_precision, "base_model_default_dtype": cfg.weight_dtype_name(),
        "mixed_precision": cfg.mixed_precision,
    }


def samples_digest(run: Run) -> str:
    """What names the trained files (their idents, data/discovery.Sample), hashed: a resume notices files added,
    removed or renamed even when the number of batches per epoch stays."""
    if (digest := getattr(run.data, "samples_digest", None)) is None:  # once per run: every checkpoint records it
        names = sorted(item.sample.ident for item in run.data.items)
        digest = run.data.samples_digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
    return digest


def optimizer_changed(run: Run, saved: dict, path: Path) -> bool:
    """Whether the checkpoint was trained with another optimizer or optimizer_config; if so a warning says the run
    goes on with a fresh optimizer state. One optimizer's state does not fit another's (a raw KeyError, or Lion
    taking AdamW's moments), nor always its own under other constructor settings (amsgrad on needs a state AdamW
    without it never made)."""
    if "optimizer" not in saved:  # written by an earlier difftune, which did not record it
        return _other_groups(run, path)
    now = recorded(run)
    old, new = (saved["optimizer"], saved.get("optimizer_config") or {}), (now["optimizer"], now["optimizer_config"])
    if old == new:
        return False
    what = (f"optimizer {old[0]!r}, this run uses {new[0]!r}" if old[0] != new[0] else
            f"optimizer_config {old[1] or 'unset'}, this run has {new[1] or 'unset'}")
    run.events.emit("warning", message=f"{path} was trained with {what}: the weights, step, learning-rate schedule "
                    "and data position are resumed, the optimizer starts afresh (its moments are rebuilt over the "
                    "next steps). Restore the checkpoint's setting to continue its optimizer state instead")
    return True


def _other_groups(run: Run, path: Path) -> bool:
    """For a checkpoint that does not record its optimizer: whether its param groups lack a setting this run's
    optimizer has (Lion's betas/lr/weight_decay against AdamW's eps, amsgrad, ...), which means another optimizer
    whose state would not load (a raw KeyError); if so warned about as optimizer_changed does. (Groups may gain
    keys as they step, Prodigy's d_hat: only missing ones count. AdamW's state resumed by Lion is not caught.)
    Read by memory map: nothing is loaded."""
    if not (path / "optimizer.pt").is_file():  # an FSDP state: its loader checks it
        return False
    groups = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True, mmap=True)["param_groups"]
    fresh = run.optimizer.param_groups
    # optimizer_config's settings as the checkpoint's groups hold them (their values would replace this run's)
    chosen = {k: v for k, v in run.cfg.optimizer_settings().items() if k in fresh[0]}
    if {k for g in fresh for k in g} <= {k for g in groups for k in g} and \
            all(g.get(k) == v for g in groups for k, v in chosen.items()):
        return False
    run.events.emit("warning", message=f"{path} was trained with another optimizer or optimizer_config than this "
                    f"run's {run.cfg.optimizer!r} (its state holds other settings; the difftune that wrote it did not "
                    "record which): the weights, step, learning-rate schedule and data position are resumed, the "
                    "optimizer starts afresh")
    return True


def _epoch_bound(run: Run) -> bool:
    """Whether num_train_epochs ends this run (rather than max_train_steps)."""
    cfg = run.cfg
    if not cfg.num_train_epochs or cfg.ignore_final_epochs:
        return False
    return not cfg.max_train_steps or run.total_steps < cfg.max_train_steps


def check_batches(run: Run, saved: dict, path: Path) -> None:
    """A checkpoint's step and data position count batches of its own size: with another train_batch_size,
    gradient_accumulation_steps or process count, an epoch-based run would train the wrong number of epochs
    (refused), a step-based one reads its data from a shifted place (warned)."""
    cfg = run.cfg
    settings = recorded(run)
    changed = batch_changes(saved, {k: settings[k] for k in ("train_batch_size", "gradient_accumulation_steps",
                                                              "processes")})
    if not changed:
        return
    if _epoch_bound(run):  # config/load.py refused it already before any model loaded, unless processes changed
        raise ValueError(batches_refusal(path, changed, cfg.num_train_epochs))
    what = ", ".join(f"{k} {old} then, {new} now" for k, (old, new) in changed.items())
    run.events.emit("warning", message=f"{path} was trained with other batches ({what}): its data position counts "
                    "batches of the old size, so this run goes on from a shifted place in the epoch (some images "
                    "come again or are passed over until the next epoch)")


def warn_changes(run: Run, saved: dict, path: Path) -> None:
    """lora_alpha and seed changed since the checkpoint: accepted, with a warning that says what applies."""
    cfg = run.cfg
    if cfg.model_type == "lora" and cfg.lora_type == "standard" and "lora_alpha" in saved \
            and saved["lora_alpha"] != cfg.effective_lora_alpha():
        run.events.emit("warning", message=f"lora_alpha {saved['lora_alpha']:g} then, {cfg.effective_lora_alpha():g} "
                        f"now ({path}): the resumed LoRA's output is scaled by the new alpha / rank from this step on "
                        "(and in the saved LoRA), so the model changes at once; restore lora_alpha to continue "
                        "smoothly")
    then, now = saved.get("batches_per_epoch"), run.data.sampler.batches_per_epoch()
    batches = ("train_batch_size", "gradient_accumulation_steps", "processes")  # check_batches speaks of those
    if then is not None and then != now and not batch_changes(saved, {k: recorded(run)[k] for k in batches}):
        epochs = (f"; num_train_epochs counts epochs of {now} batches, so the run ends at step {run.total_steps}"
                  if _epoch_bound(run) else "")
        run.events.emit("warning", message=f"the datasets changed since {path} (files added or removed): {then} "
                        f"batches per epoch then, {now} now. The data order and position follow the new datasets "
                        f"from here{epochs}")
    elif then == now and saved.get("samples_digest") not in (None, samples_digest(run)):
        run.events.emit("warning", message=f"the datasets' files changed since {path} (added, removed or renamed: "
                        f"{saved.get('samples', '?')} then, {len(run.data.items)} now; the batches per epoch are the "
                        "same). The data order follows the new files from here")
    now_base = recorded(run)
    changed = [f"{k} {saved[k]!r} then, {now_base[k]!r} now" for k in
               ("base_model_precision", "base_model_default_dtype", "mixed_precision") if k in saved and
               saved[k] != now_base[k]]
    if changed:
        run.events.emit("warning", message=f"{'; '.join(changed)} ({path}): the trained weights are resumed as they "
                        "are, and from this step on the base model computes otherwise (the losses move at once); "
                        "restore the setting to continue the checkpoint's run exactly")
    if "seed" in saved and saved["seed"] != cfg.seed:
        run.events.emit("warning", message=f"seed {saved['seed']} then, {cfg.seed} now ({path}): the data order "
                        "(and random crops) follow the new seed from here, while the noise and timesteps continue the "
                        "checkpoint's stream (restored from its rng.pt)")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _show(value: Any) -> str:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:  # torchao's optimizers: a tensor
        value = float(value.item())
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return repr(value)


@dataclass
class Fresh:
    """The config's optimizer hyper-parameters and base rates, as the freshly built optimizer and schedule hold
    them before a checkpoint's state is loaded over them."""

    groups: list[dict[str, Any]]
    base_lrs: list[float]

    @classmethod
    def of(cls, run: Run) -> Fresh:
        groups = [{k: g[k] for k in _NAMES if k in g} for g in run.optimizer.param_groups]
        return cls(groups, list(run.lr_scheduler.base_lrs))

    def apply(self, run: Run, path: Path) -> None:
        """Put the config's values back over the loaded ones, recompute the rate of the restored step from the
        rebuilt schedule, and say in one info event what changed since the checkpoint."""
        changes: list[str] = []
        defaults: dict[str, tuple[Any, Any]] = {}  # changed keys the config does not set: a default that moved
        for group, fresh in zip(run.optimizer.param_groups, self.groups, strict=True):
            for key, value in fresh.items():
                if key in group and not _same(group[key], value):
                    pairs = self._pairs(key, group[key], value)
                    changes.append("; ".join(f"{n} {_show(o)} -> {_show(v)}" for n, o, v in pairs))
                    defaults |= {n: (o, v) for n, o, v in pairs if n not in run.cfg.model_fields_set}
                    group[key] = value
        if defaults:  # after an upgrade: this difftune's default for the optimizer is not the one trained with
            run.events.emit("warning", message=f"resuming {path}: " + ", ".join(
                f"{n} {_show(o)} -> {_show(v)}" for n, (o, v) in defaults.items()) + " although the config does not "
                f"set {'it' if len(defaults) == 1 else 'them'}: this difftune's default for optimizer "
                f"{run.cfg.optimizer!r} differs from the value the checkpoint trained with; to keep training as "
                "before, set " + ", ".join(f"{n} {_show(o)}" for n, (o, v) in defaults.items()))
        sched = run.lr_scheduler
        old_base, old_last = list(sched.base_lrs), list(sched._last_lr)  # the checkpoint's (the groups' may be fresh)
        # LambdaLR.get_lr's own formula at the restored step: the value an uninterrupted run had set there
        rates = [base * rate(sched.last_epoch) for rate, base in zip(sched.lr_lambdas, self.base_lrs, strict=True)]
        for group, base, lr in zip(sched.optimizer.param_groups, self.base_lrs, rates, strict=True):
            group["initial_lr"], group["lr"] = base, lr
        sched.base_lrs, sched._last_lr = list(self.base_lrs), list(rates)
        step = run.state.step + 1
        if not _same(old_base, self.base_lrs):
            changes.append(f"peak learning rate (learning_rate, lr_scale) {_show(old_base[0])} -> "
                           f"{_show(self.base_lrs[0])}")
        if not _same(old_last, [base * rate(sched.last_epoch) for rate, base in zip(sched.lr_lambdas, old_base,
                                                                                    strict=True)]):
            changes.append(f"the learning-rate schedule (max_train_steps, num_train_epochs, lr_scheduler or its "
                           f"settings): step {step} trains at the new curve's {_show(rates[0])}, where the "
                           f"checkpoint's would have {_show(old_last[0])}")
        elif changes and not _same(old_last, rates):
            changes.append(f"step {step} trains at {_show(rates[0])}")
        if changes:
            run.events.emit("info", message=f"resuming {path} with settings changed since it was saved: "
                            + "; ".join(dict.fromkeys(changes)))

    @staticmethod
    def _pairs(key: str, old: Any, new: Any) -> list[tuple[str, Any, Any]]:
        """(config key, then, now) for each config key a changed param-group value holds (betas: two)."""
        names = _NAMES[key]
        if isinstance(names, tuple):
            # Adan's and AdEMAMix's third beta is no config key's (adam_beta1/2 set the first two)
            return [(n, o, v) for n, o, v in zip(names, old[:2], new[:2], strict=True) if not _same(o, v)]
        return [(names, old, new)]
