"""The wizard's memory questions (`difftune configure`): the GPU's size, then the memory planner's cheapest
levers for this configuration (memory_plan/levers.py, as `difftune plan --gpu-memory`), or a fixed suggestion by
size when the planner cannot run. A mixin of `ui.wizard.Wizard`, whose config, questions and staging it uses."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from difftune.config import TrainConfig, load_config
from difftune.ui.terminal import _input, _show


def memory_settings(gigabytes: float, fields: set[str]) -> dict[str, Any]:
    """Fixed memory settings by GPU size (0: no GPU), limited to keys the schema has: the offer without a
    GPU, and the fallback when the memory planner cannot run (`Wizard.planned` decides otherwise).

    LoRA on a ~2B transformer at 1024px: about 26 GB with bf16 weights, about 10 GB with gradient
    checkpointing (activations recomputed); see BENCHMARKS.md (memory planner).
    """
    if gigabytes <= 0:
        out = {"mixed_precision": "no", "gradient_checkpointing": False, "train_batch_size": 1}
    elif gigabytes < 24:
        out = {"mixed_precision": "bf16", "base_model_default_dtype": "bf16", "gradient_checkpointing": True,
               "train_batch_size": 1}
    elif gigabytes < 48:
        out = {"mixed_precision": "bf16", "gradient_checkpointing": False, "train_batch_size": 1}
    else:
        out = {"mixed_precision": "bf16", "gradient_checkpointing": False, "train_batch_size": 4}
    return {k: v for k, v in out.items() if k in fields}


class MemoryQuestions:
    """Needs the Wizard's `config`, `train_specs`, `say`, `ask`, `stage`, `config_path` and `datasets_path`."""

    config: dict[str, Any]
    train_specs: dict[str, dict[str, Any]]
    config_path: Path

    def memory(self) -> None:
        self.say("\n--- memory")
        while True:
            answer = _input("GPU memory available, in GiB (0: no GPU) [24]: ").strip() or "24"
            try:
                gigabytes = float(answer)
            except ValueError:
                gigabytes = math.nan
            if math.isfinite(gigabytes) and gigabytes >= 0:
                break
            self.say(f"  {answer}: give the GPU's memory as a number of GiB, such as 24, or 0 for no GPU")
        memory_fields = [n for n, s in self.train_specs.items() if s["group"] == "memory"] + ["mixed_precision"]
        offer = memory_settings(gigabytes, set(self.train_specs))
        kept = self.levers_set() if gigabytes > 0 else {}
        if kept:  # set for another GPU size, maybe: planned afresh, so a larger GPU does not keep their cost
            self.say("The config has memory levers: " + ", ".join(f"{k} {_show(v)}" for k, v in kept.items())
                     + "; planned without them (those the plan below does not need are removed if you accept)")
        planned = self.planned(gigabytes, offer, drop=set(kept)) if gigabytes > 0 else None
        fits = planned is not None and planned[1]
        if planned is None or not fits:
            kept = {}  # the fixed suggestion, or nothing fits: the config's levers stay
        if planned is not None:  # nothing fits: added to the config's own settings, which stay as they are
            offer = planned[0] if fits else {k: v for k, v in planned[0].items() if k not in self.config}
        if "optimizer" not in offer:
            offer.update(self.lossless_optimizer(offer))
        header = ("Settings that fit:" if fits or planned is None and gigabytes <= 0 else
                  "Suggested settings (not planned):" if planned is None else
                  "Nothing fits, so the most frugal settings, added to those the config has:")
        self.say(header if offer else "No suggestion for this size.")
        for key, value in offer.items():
            self.say(f"  {key}: {_show(value)}  ({self.train_specs[key]['description']})")
        if _input("Use these settings? [Y/n]: ").strip().lower() in ("", "y", "yes"):
            for key in kept.keys() - offer.keys():
                del self.config[key]
            self.config.update(offer)
            return
        for name in memory_fields:
            self.ask(self.train_specs[name], self.config, TrainConfig)

    def lossless_optimizer(self, offer: dict[str, Any]) -> dict[str, Any]:
        """The optimizer a full fine-tune of bf16/fp16 weights needs so that the trainer does not warn that it loses
        small updates (the planner's rule, memory_plan/levers.py); {} when none is needed or the config is not
        valid yet (the review says why)."""
        from difftune.memory_plan.levers import lossless_optimizer

        if self.config.get("model_type") != "full":
            return {}
        try:
            return lossless_optimizer(TrainConfig.model_validate({**self.config, **offer}))
        except ValueError:
            return {}

    def levers_set(self) -> dict[str, Any]:
        """The planner's memory levers (memory_plan/levers.py) the config sets to other than their default: the
        optimizer only as a full fine-tune's 8-bit lever (otherwise it is the user's choice, not a memory setting)."""
        from difftune.memory_plan.levers import SPEED

        lever_optimizer = "adamw8bit" if self.config.get("model_type") == "full" else None
        return {k: v for k, v in self.config.items() if k in SPEED and k in self.train_specs
                and v != self.train_specs[k]["default"] and (k != "optimizer" or v == lever_optimizer)}

    def planned(self, gigabytes: float, base: dict[str, Any],
                drop: set[str] = frozenset()) -> tuple[dict[str, Any], bool] | None:
        """The memory planner's choice for this configuration (`difftune plan --gpu-memory`): `base` (bf16 on a
        GPU) plus the cheapest levers that fit, each said with its saving, and True; when nothing fits, the most
        frugal levers it tried and False. None when it cannot plan (the fixed suggestion `memory_settings` stays).
        `drop`: config keys planned without."""
        from difftune.memory_plan.levers import choose, reserve_for
        from difftune.memory_plan.predict import GIB

        with tempfile.TemporaryDirectory(prefix="difftune-configure-") as tmp:
            settings = {k: v for k, v in base.items() if k in ("mixed_precision",)}
            tmp_cfg, tmp_data = self.stage(Path(tmp), settings, drop)
            try:
                run_cfg = load_config(tmp_cfg)
                from difftune.train.plan import discover_all

                found = discover_all(run_cfg, write_metadata=False)
                choice = choose(run_cfg.train, found, gigabytes, reserve=reserve_for(gigabytes))
            except Exception as e:  # noqa: BLE001 - the wizard falls back to its fixed suggestion
                said = str(e).replace(str(tmp_cfg), str(self.config_path)).replace(str(tmp_data),
                                                                                   str(self.datasets_path()))
                self.say(f"  (the memory planner could not run: {said}; a fixed suggestion follows, and the review "
                         "below says what to fix)")
                return None
        self.say(f"Predicted peak {'without them' if drop else 'as configured'}: {choice.before.peak / GIB:.1f} GiB "
                 f"({choice.before.peak_phase}).")
        if not choice.fits:
            self.say(f"  {choice.message}")
            if drop:
                self.say("  (your memory settings are kept)")
            return {**settings, **choice.frugal}, False
        for step in choice.steps:
            self.say(f"  {step.key} {_show(step.value)}: {step.effect()} ({step.why})")
        if choice.steps and choice.after is not None:
            self.say(f"  with them: {choice.after.peak / GIB:.1f} GiB ({choice.reserve:g} of the {gigabytes:g} GiB "
                     "kept free for the CUDA context and fragmentation)")
        return {**settings, **choice.settings()}, True
