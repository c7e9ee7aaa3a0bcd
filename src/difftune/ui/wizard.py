"""`difftune configure [PATH]`: a terminal wizard that writes `config.json` and its dataset list.

It chooses WHICH keys to ask; every label, description, default and list of choices comes from the
schema (ui.describe_model), and every answer is checked by the schema at once, with the messages of
`difftune check`. Nothing is written until the whole configuration passes the same checks as
`difftune check` (config, dataset list, and a scan of the dataset folder).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from difftune.config import ConfigError, TrainConfig, load_config
from difftune.config.datasets import DATASET_MODELS
from difftune.config.load import _validate
from difftune.data.discovery import VIDEO_SUFFIXES
from difftune.models.registry import FAMILY_FACTS
from difftune.ui import describe_model

DEFAULT_CONFIG = "config/config.json"
TRAIN_QUESTIONS = ("model_family", "model_flavour", "model_type", "lora_rank")
DATASET_QUESTIONS = ("instance_data_dir", "caption_strategy", "instance_prompt", "resolution")
RUN_QUESTIONS = ("max_train_steps", "learning_rate", "validation_prompt", "validation_resolution", "output_dir")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class Cancelled(Exception):
    pass


def _input(prompt: str) -> str:
    try:
        return input(prompt)
    except EOFError as e:
        raise Cancelled from e


def _show(value: Any) -> str:
    return "empty" if value is None else json.dumps(value) if isinstance(value, list | dict) else str(value)


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


class Wizard:
    def __init__(self, path: str | None, out=sys.stdout):
        self.out = out
        self.train_specs = {f["name"]: f for f in describe_model(TrainConfig)["fields"]}
        self.image_specs = {f["name"]: f for f in describe_model(DATASET_MODELS["image"])["fields"]}
        self.config_path = Path(path or DEFAULT_CONFIG)
        self.config: dict[str, Any] = {}
        self.datasets: list[Any] = []
        self.editing = self.config_path.exists()
        if self.editing:
            self.config = json.loads(self.config_path.read_text(encoding="utf-8"))
            if not isinstance(self.config, dict):
                raise ConfigError([f"{self.config_path}: the config must be a JSON object of keys and values"])
            data = self.datasets_path()
            if data.exists():
                loaded = json.loads(data.read_text(encoding="utf-8"))
                self.datasets = loaded if isinstance(loaded, list) else []
        elif path is not None:
            self.config["data_backend_config"] = str(self.config_path.parent / "multidatabackend.json")

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def datasets_path(self) -> Path:
        value = self.config.get("data_backend_config") or self.train_specs["data_backend_config"]["default"]
        return Path(value)

    # --- one question, from its schema description
    def ask(self, spec: dict[str, Any], values: dict[str, Any], model: type, where: str = "answer") -> None:
        name = spec["name"]
        current = values.get(name, spec["default"] if spec["has_default"] else None)
        choices = spec.get("choices")
        if name == "model_flavour":
            choices = list(FAMILY_FACTS[values["model_family"]].flavours)
            if current not in choices:
                current = FAMILY_FACTS[values["model_family"]].default_flavour
        self.say(f"\n{spec['title']} ({name})")
        for line in textwrap.wrap(spec["description"], 96):
            self.say(f"  {line}")
        if choices is not None and len(choices) == 1:
            values[name] = choices[0]
            self.say(f"  -> {choices[0]} (the only choice)")
            return
        if choices is not None:
            for i, choice in enumerate(choices, 1):
                self.say(f"  {i}) {choice}")
        while True:
            hint = "" if current is None else f" [{_show(current)}]"
            answer = _input(f"{name}{hint}: ").strip()
            if answer == "" and name not in values and spec["has_default"] and current == spec["default"]:
                return  # the default stays implicit: nothing written for it
            if answer == "":
                value = current
            elif answer == "-" and spec["nullable"]:
                value = None
            elif choices is not None:
                value = choices[int(answer) - 1] if answer.isdigit() and 0 < int(answer) <= len(choices) else answer
                if value not in choices:
                    self.say(f"  choose a number from 1 to {len(choices)}, or one of: {', '.join(map(str, choices))}")
                    continue
            else:
                value = self.parse(spec, answer)
            if value is None and spec["required"]:
                self.say("  this one is required")
                continue
            problem = self.field_problem(model, {**values, name: value}, name, where)
            if problem is None and spec["path"] == "folder" and name == "instance_data_dir":
                problem = self.folder_problem(value)
            if problem:
                self.say(f"  {problem}")
                continue
            if value is None:
                values.pop(name, None)
            else:
                values[name] = value
            return

    @staticmethod
    def parse(spec: dict[str, Any], text: str) -> Any:
        if spec["kind"] == "boolean":
            return {"y": True, "yes": True, "true": True, "n": False, "no": False, "false": False}.get(text.lower(), text)
        if spec["kind"] in ("integer", "number"):
            try:
                return int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text)
            except ValueError:
                return text  # the schema check says what is wrong
        return text

    @staticmethod
    def field_problem(model: type, values: dict[str, Any], name: str, where: str) -> str | None:
        """The schema's message for this key (the same text as `difftune check`), if any."""
        problems: list[str] = []
        _validate(where, model, values, problems)
        for p in problems:
            if p.startswith((f"{where}: {name}: ", f"{where}: {name}.")):
                return p[len(where) + 2:]
        return None

    def folder_problem(self, value: str) -> str | None:
        folder = Path(value).expanduser()
        if not folder.is_dir():
            return f"{value!r} is not a folder; give the folder that holds your images"
        video = self.media() == "video"
        suffixes = VIDEO_SUFFIXES if video else IMAGE_SUFFIXES
        count = sum(1 for p in folder.rglob("*") if p.suffix.lower() in suffixes)
        what = "clips" if video else "images"
        if count == 0:
            return f"no {what} ({', '.join(suffixes)}) in {value!r}"
        self.say(f"  {count} {what} found")
        return None

    def media(self) -> str:
        """The dataset kind the chosen family trains on: 'video' for video families."""
        family = FAMILY_FACTS.get(str(self.config.get("model_family")))
        return "video" if family is not None and family.video else "image"

    # --- the whole conversation
    def image_entry(self) -> dict[str, Any]:
        kind = self.media()
        for entry in self.datasets:  # the trained dataset: regularisation data is not the one the questions are about
            if (isinstance(entry, dict) and entry.get("dataset_type", "image") == kind
                    and not entry.get("is_regularisation_data") and not entry.get("is_regularization_data")):
                return entry
        entry = {"id": "", "type": "local", "dataset_type": kind}
        self.datasets.insert(0, entry)
        return entry

    def questions(self) -> None:
        cfg = self.config
        for name in TRAIN_QUESTIONS:
            if name == "lora_rank" and cfg.get("model_type", "lora") != "lora":
                continue
            self.ask(self.train_specs[name], cfg, TrainConfig)
        self.say("\n--- the dataset")
        entry = self.image_entry()
        for name in DATASET_QUESTIONS:
            if name == "instance_prompt" and entry.get("caption_strategy") != "instanceprompt":
                continue
            if name in self.image_specs:
                self.ask(self.image_specs[name], entry, DATASET_MODELS["image"])
        if not entry.get("id"):
            entry["id"] = re.sub(r"[^\w.-]+", "-", Path(entry["instance_data_dir"]).resolve().name) or "images"
        if not any(isinstance(e, dict) and e.get("dataset_type") == "text_embeds" for e in self.datasets):
            self.datasets.append({"id": "text-embeds", "type": "local", "dataset_type": "text_embeds",
                                  "default": True, "cache_dir": f"cache/text/{cfg['model_family']}"})
        self.say("\n--- training")
        resolution = entry.get("resolution")
        if "validation_resolution" not in cfg and isinstance(resolution, int | float) and int(resolution) % 16 == 0:
            cfg["validation_resolution"] = f"{int(resolution)}x{int(resolution)}"
        if not cfg.get("max_train_steps") and not cfg.get("num_train_epochs"):
            cfg["max_train_steps"] = 1000  # the schema's 0 means "use epochs", which is 0 too
        for name in RUN_QUESTIONS:
            self.ask(self.train_specs[name], cfg, TrainConfig)
        self.memory()

    def memory(self) -> None:
        self.say("\n--- memory")
        while True:
            answer = _input("GPU memory available, in GB (0: no GPU) [24]: ").strip() or "24"
            try:
                gigabytes = float(answer)
                break
            except ValueError:
                self.say("  give a number, such as 24")
        memory_fields = [n for n, s in self.train_specs.items() if s["group"] == "memory"] + ["mixed_precision"]
        offer = memory_settings(gigabytes, set(self.train_specs))
        planned = self.planned(gigabytes, offer) if gigabytes > 0 else None
        if planned is not None:
            offer = planned
        self.say("Settings that fit:" if offer else "No suggestion for this size.")
        for key, value in offer.items():
            self.say(f"  {key}: {_show(value)}  ({self.train_specs[key]['description']})")
        if _input("Use these settings? [Y/n]: ").strip().lower() in ("", "y", "yes"):
            self.config.update(offer)
            return
        for name in memory_fields:
            self.ask(self.train_specs[name], self.config, TrainConfig)

    def planned(self, gigabytes: float, base: dict[str, Any]) -> dict[str, Any] | None:
        """The memory planner's choice for this configuration (`difftune plan --gpu-memory`): `base` (bf16 on a
        GPU) plus the cheapest levers that fit, each said with its saving. None when it cannot plan (the fixed
        suggestion `memory_settings` stays)."""
        from difftune.memory_plan.levers import choose
        from difftune.memory_plan.predict import GIB

        with tempfile.TemporaryDirectory(prefix="difftune-configure-") as tmp:
            tmp_cfg, tmp_data = Path(tmp) / "config.json", Path(tmp) / "datasets.json"
            tmp_data.write_text(json.dumps(self.datasets))
            settings = {k: v for k, v in base.items() if k in ("mixed_precision",)}
            tmp_cfg.write_text(json.dumps({**self.config, **settings, "data_backend_config": str(tmp_data)}))
            try:
                run_cfg = load_config(tmp_cfg)
                from difftune.train.plan import discover_all

                found = discover_all(run_cfg, write_metadata=False)
                choice = choose(run_cfg.train, found, gigabytes)
            except Exception as e:  # noqa: BLE001 - the wizard falls back to its fixed suggestion
                self.say(f"  (the memory planner could not run: {e}; a fixed suggestion follows)")
                return None
        self.say(f"Predicted peak as configured: {choice.before.peak / GIB:.1f} GiB ({choice.before.peak_phase}).")
        if not choice.fits:
            self.say(f"  {choice.message}")
            return {**settings}
        for step in choice.steps:
            self.say(f"  {step.key} {_show(step.value)}: saves {step.saving / GIB:.1f} GiB ({step.why})")
        if choice.steps and choice.after is not None:
            self.say(f"  with them: {choice.after.peak / GIB:.1f} GiB")
        return {**settings, **choice.settings()}

    def problems(self) -> list[str]:
        """What `difftune check` would say about the files about to be written (config, list, scan)."""
        data_path = self.datasets_path()
        with tempfile.TemporaryDirectory(prefix="difftune-configure-") as tmp:
            tmp_cfg, tmp_data = Path(tmp) / "config.json", Path(tmp) / "datasets.json"
            tmp_data.write_text(json.dumps(self.datasets))
            tmp_cfg.write_text(json.dumps({**self.config, "data_backend_config": str(tmp_data)}))
            try:
                run_cfg = load_config(tmp_cfg)
                from difftune.train.plan import DataError, discover_all

                try:
                    discover_all(run_cfg)
                except DataError as e:
                    return [str(e)]
            except ConfigError as e:
                return [p.replace(str(tmp_cfg), str(self.config_path)).replace(str(tmp_data), str(data_path))
                        for p in e.problems]
        return []

    def review(self) -> bool:
        self.say(f"\n=== review\n{self.config_path}:")
        self.say(json.dumps(self.config, indent=2))
        self.say(f"{self.datasets_path()}:")
        self.say(json.dumps(self.datasets, indent=2))
        problems = self.problems()
        if problems:
            self.say("\nThese must be fixed before anything is written:")
            for p in problems:
                self.say(f"  - {p}")
            return False
        self.say("\ndifftune check accepts this configuration.")
        return True

    def write(self) -> None:
        for path, data in ((self.datasets_path(), self.datasets), (self.config_path, self.config)):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
            self.say(f"wrote {path}")

    def run(self) -> int:
        self.say(f"difftune configure: {'editing' if self.editing else 'a new'} {self.config_path}")
        self.say("Enter keeps the value in [brackets]; '-' empties an optional value. Ctrl-C quits without writing.")
        while True:
            self.questions()
            ok = self.review()
            if ok:
                answer = _input("Write these files? [Y/n]: ").strip().lower()
                if answer in ("", "y", "yes"):
                    self.write()
                    self.say(f"next: difftune train --config {self.config_path}")
                    return 0
            answer = _input("Go through the questions again (your answers are kept)? [Y/n]: ").strip().lower()
            if answer not in ("", "y", "yes"):
                self.say("nothing written")
                return 1


def run_wizard(path: str | None) -> int:
    try:
        return Wizard(path).run()
    except (Cancelled, KeyboardInterrupt):
        print("\ncancelled; nothing written", flush=True)
        return 130
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
