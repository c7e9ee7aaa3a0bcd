"""`difftune configure [PATH]`: a terminal wizard that writes `config.json` and its dataset list.

It chooses WHICH keys to ask; every label, description, default and list of choices comes from the
schema (ui.describe_model), and every answer is checked by the schema at once, with the messages of
`difftune check`. Nothing is written until the whole configuration passes the same checks as
`difftune check` (config, dataset list, and a scan of the dataset folder).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from difftune.config import ConfigError, TrainConfig, load_config
from difftune.config.compat import family_name
from difftune.config.dataset_entry_keys import disabled
from difftune.config.datasets import DATASET_MODELS, REMOTE_TYPES
from difftune.config.jsonfile import JsonFileError, read_json
from difftune.config.load import _validate
from difftune.config.problems import split_problem
from difftune.data.discovery import CLIP_SUFFIXES, count_files
from difftune.data.images import IMAGE_EXTENSIONS
from difftune.models.registry import FAMILY_FACTS
from difftune.ui import describe_model
from difftune.ui.terminal import Cancelled, _input, _show, _yes
from difftune.ui.wizard_datasets import DatasetQuestions
from difftune.ui.wizard_memory import MemoryQuestions
from difftune.ui.wizard_probe import DataProbes

DEFAULT_CONFIG = "config/config.json"
TRAIN_QUESTIONS = ("model_family", "model_flavour", "model_type", "lora_type", "lora_rank")
# lora_type 'lycoris': the lycoris_config file the wizard writes beside config.json, by algorithm. lokr: SimpleTuner's
# example (linear_dim 10000 means full size: the factor sets the size); the others a rank-16 network.
LYCORIS_DEFAULTS: dict[str, dict[str, Any]] = {
    "lokr": {"algo": "lokr", "multiplier": 1.0, "linear_dim": 10000, "linear_alpha": 1, "factor": 16},
    "locon": {"algo": "locon", "multiplier": 1.0, "linear_dim": 16, "linear_alpha": 1},
    "loha": {"algo": "loha", "multiplier": 1.0, "linear_dim": 16, "linear_alpha": 1},
}
DATASET_QUESTIONS = ("instance_data_dir", "caption_strategy", "instance_prompt", "resolution")
RUN_QUESTIONS = ("max_train_steps", "learning_rate", "validation_prompt", "validation_resolution", "output_dir")
VIDEO_RUN_QUESTIONS = ("validation_num_video_frames",)  # and the `video` block's bucket_strategy, num_frames
# The wizard writes `type: local` entries: the other strategies need a table or a remote type it never asks for.
LOCAL_CAPTIONS = ("textfile", "filename", "instanceprompt")
FULL_LEARNING_RATE = 1e-5  # offered to a full fine-tune (the specs: 1e-5 to 5e-6; the default 1e-4 suits a LoRA)
COUNT_CAP = 10_000  # files counted in the folder check; a huge folder is not listed in full


class Wizard(MemoryQuestions, DataProbes, DatasetQuestions):
    def __init__(self, path: str | None, out=sys.stdout):
        self.out = out
        self.train_specs = {f["name"]: f for f in describe_model(TrainConfig)["fields"]}
        self.image_specs = {f["name"]: f for f in describe_model(DATASET_MODELS["image"])["fields"]}
        self.config_path = Path(path or DEFAULT_CONFIG)
        if path is not None and (self.config_path.is_dir() or path.endswith(("/", os.sep))):
            self.config_path /= "config.json"  # a folder: its config.json (the name was taken for a file)
        self.config: dict[str, Any] = {}
        self.datasets: list[Any] = []
        self.single_entry: dict[str, Any] | None = None  # a dataset list that is one object: offered a wrap
        self.notes: list[str] = []  # said before the first question
        self.shortest: tuple[int, int, float] | None = None  # video: (frames, clips probed, fps) of the shortest
        self.answered: set[str] = set()  # keys typed in this session: an offer never replaces them on a second pass
        self.sizes: list[tuple[int, int]] = []  # (width, height) of the first files probed in the dataset's folder
        self.problems_seen: list[str] = []  # the last review's problems
        self.lycoris: Any = None  # the lycoris_config file to write beside config.json, when the wizard makes one
        self.editing = self.config_path.exists()
        if self.editing:
            self.config = self.read(self.config_path, "config file")
            if not isinstance(self.config, dict):
                raise ConfigError([f"{self.config_path}: the config must be a JSON object of keys and values, got "
                                   f"{type(self.config).__name__}"])
        elif path is not None:
            self.config["data_backend_config"] = str(self.config_path.parent / "multidatabackend.json")
        data = self.datasets_path()
        if data.exists():  # a new config beside an existing list edits that list: it is never replaced unseen
            loaded = self.read(data, "dataset list")
            if isinstance(loaded, dict):
                self.single_entry = loaded
            elif not isinstance(loaded, list):  # the loader's words (config/load.py)
                raise ConfigError([f"{data}: the dataset list must be a JSON list of entries, got "
                                   f"{type(loaded).__name__}"])
            else:
                self.datasets = loaded
                if not self.editing:
                    self.notes.append(f"{data} exists: its entries are kept, and the questions edit its dataset")

    def read(self, path: Path, what: str) -> Any:
        """`path` parsed by the loader's reader (its messages name the file and the line); a folder or a FIFO is
        refused before anything opens it (reading a FIFO would wait forever)."""
        if not path.is_file():
            kind = "a folder" if path.is_dir() else "not a regular file (a FIFO, socket or device)"
            raise ConfigError([f"{path}: is {kind}; give the path of the {what}, a .json file"])
        duplicates: list[str] = []
        try:
            data = read_json(path, what, "check the path", duplicates)
        except JsonFileError as e:
            raise ConfigError([f"{what} {e}"]) from e
        self.notes += [f"{p} (the wizard keeps the last one)" for p in duplicates]
        return data

    review_notes: list[str] = []  # the notes of the last review's check

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def datasets_path(self) -> Path:
        """The dataset list the loader reads for this config (SimpleTuner's config/<env>/ layout names it relative
        to the configs folder: the wizard wrote a new list in the working folder instead, which then replaced it)."""
        from difftune.config.dataset_list import dataset_list_location

        return dataset_list_location(self.config.get("data_backend_config") or None, self.config_path)[0]

    # --- one question, from its schema description
    def ask(self, spec: dict[str, Any], values: dict[str, Any], model: type, where: str = "answer",
            offer: Any = None, label: str | None = None) -> None:
        """Ask one key of `values` (checked against `model`); `offer` replaces the current value in the brackets,
        `label` is the key as shown (`video.num_frames`)."""
        name = spec["name"]
        label = label or name
        current = values.get(name, spec["default"] if spec["has_default"] else None)
        if offer is not None and label not in self.answered:
            current = offer
        choices = spec.get("choices")
        if name == "model_flavour":
            choices = list(FAMILY_FACTS[values["model_family"]].flavours)
            if current not in choices:
                current = FAMILY_FACTS[values["model_family"]].default_flavour
        if name == "caption_strategy" and choices is not None:  # an existing entry's own strategy stays offered
            choices = [c for c in choices if c in LOCAL_CAPTIONS or c == values.get(name)]
        self.say(f"\n{spec['title']} ({label})")
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
            answer = _input(f"{label}{hint}: ").strip()
            if answer:
                self.answered.add(label)
            if answer == "" and name not in values and spec["has_default"] and current == spec["default"]:
                return  # the default stays implicit: nothing written for it
            if answer == "":
                value = current
            elif answer == "-" and spec["nullable"]:
                value = None
            elif choices is not None:
                value = choices[int(answer) - 1] if answer.isdigit() and 0 < int(answer) <= len(choices) else answer
                if name == "model_family":
                    value = family_name(value)  # SimpleTuner's kandinsky5_image, as the loader accepts it
                if value not in choices:
                    self.say(f"  choose a number from 1 to {len(choices)}, or one of: {', '.join(map(str, choices))}")
                    continue
            else:
                value = self.parse(spec, answer)
                if isinstance(value, float) and not math.isfinite(value):  # the schema takes inf for `> 0`
                    self.say(f"  {label}: {answer}: Input should be a finite number")
                    continue
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
                value = int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text)
            except ValueError:
                return text  # the schema check says what is wrong
            if spec["kind"] == "integer" and isinstance(value, float) and value.is_integer():
                return int(value)  # 1e3 is written 1000, not 1000.0; 2.5 stays a float and the schema refuses it
            return value
        return text

    @staticmethod
    def field_problem(model: type, values: dict[str, Any], name: str, where: str) -> str | None:
        """The schema's message for this key (the same text as `difftune check`), if any."""
        problems: list[str] = []
        _validate(where, model, values, problems)
        for p in problems:  # the key's own problem, or a check between keys that starts with it
            if p.startswith((f"{where}: {name}: ", f"{where}: {name}.", f"{where}: {name} ")):
                return p[len(where) + 2:]
        return None

    def folder_problem(self, value: str) -> str | None:
        folder = Path(value).expanduser()
        if not folder.is_dir():
            return f"{value!r} is not a folder; give the folder that holds your images"
        video = self.media() == "video"
        suffixes = CLIP_SUFFIXES if video else IMAGE_EXTENSIONS  # what discovery reads (data layer)
        files, more = count_files(folder, suffixes, COUNT_CAP)
        what = "clips" if video else "images"
        if not files:
            return f"no {what} ({', '.join(sorted(suffixes))}) in {value!r} or its sub-folders"
        self.say(f"  {'more than ' if more else ''}{len(files)} {what} found")
        self.shortest = self.shortest_clip(files) if video else None
        self.sizes = self.probe_sizes(files, video)
        return None

    def media(self) -> str:
        """The dataset kind the chosen family trains on: 'video' for video families."""
        family = FAMILY_FACTS.get(str(self.config.get("model_family")))
        return "video" if family is not None and family.video else "image"

    # --- the whole conversation
    def image_entry(self) -> dict[str, Any]:
        kind = self.media()
        for entry in self.datasets:  # the trained dataset: regularisation data is not the one the questions are about,
            if (isinstance(entry, dict) and entry.get("dataset_type", "image") == kind  # nor a disabled one (its
                    and not entry.get("is_regularisation_data") and not entry.get("is_regularization_data")
                    and not disabled(entry)):
                return entry  # answers were written into it and never trained)
        entry = {"id": "", "type": "local", "dataset_type": kind}
        self.datasets.insert(0, entry)
        return entry

    def questions(self) -> None:
        cfg = self.config
        for name in TRAIN_QUESTIONS:
            if name in ("lora_type", "lora_rank") and cfg.get("model_type", "lora") != "lora":
                continue
            if name == "lora_rank" and cfg.get("lora_type") == "lycoris":
                self.lycoris_question()  # the network's size is in its lycoris_config, not lora_rank
                continue
            if name == "lora_type":  # answered before its lycoris_config exists: checked as if it did
                values = {**cfg, "lycoris_config": cfg.get("lycoris_config") or self.lycoris_path()}
                self.ask(self.train_specs[name], values, TrainConfig)
                if "lora_type" in values:
                    cfg["lora_type"] = values["lora_type"]
                continue
            self.ask(self.train_specs[name], cfg, TrainConfig)
            if name == "model_flavour" and cfg.get("pretrained_model_name_or_path"):
                self.say(f"  note: the config loads pretrained_model_name_or_path "
                         f"{cfg['pretrained_model_name_or_path']!r}, not the flavour's own; the flavour says what "
                         "that model is (edit the config to change the path)")
        if cfg.get("lora_type") != "lycoris" and cfg.get("lycoris_config") == self.lycoris_path() \
                and not Path(self.lycoris_path()).is_file():
            del cfg["lycoris_config"]  # chosen on an earlier pass, never written: it would name a missing file
        entry = self.image_entry()
        self.say("\n--- the dataset" + (f" {entry['id']!r}" if entry.get("id") else ""))
        remote = entry.get("type") in REMOTE_TYPES
        if remote:  # its folder is where the download goes (optional), not a folder of the user's files
            self.say(f"  type {entry['type']!r}: downloaded from its source; edit the dataset list for the source's "
                     "keys")
        for name in DATASET_QUESTIONS:
            if name == "instance_prompt" and entry.get("caption_strategy") != "instanceprompt":
                continue
            if name == "instance_data_dir" and remote:
                continue
            if name in self.image_specs:
                offer = self.resolution_offer(entry) if name == "resolution" else None
                self.ask(self.image_specs[name], entry, DATASET_MODELS["image"], offer=offer)
        if entry.get("dataset_type") == "video":
            self.video_questions(entry)
        if not entry.get("id"):
            entry["id"] = self.new_id(re.sub(r"[^\w.-]+", "-", Path(entry.get("instance_data_dir") or "images")
                                             .resolve().name) or "images")
        if FAMILY_FACTS[cfg["model_family"]].needs_conditioning(str(cfg.get("model_flavour"))):
            self.conditioning_question(entry)
        self.leftovers(entry)
        if not any(isinstance(e, dict) and e.get("dataset_type") == "text_embeds" for e in self.datasets):
            self.datasets.append({"id": "text-embeds", "type": "local", "dataset_type": "text_embeds",
                                  "default": True, "cache_dir": f"cache/text/{cfg['model_family']}"})
        self.say("\n--- training")
        resolution = entry.get("resolution")
        size = None  # validation_resolution's offer: the dataset's resolution when it is a pixel size
        if "validation_resolution" not in cfg and isinstance(resolution, int | float) and int(resolution) % 16 == 0:
            size = f"{int(resolution)}x{int(resolution)}"
        if not cfg.get("max_train_steps") and not cfg.get("num_train_epochs"):
            cfg["max_train_steps"] = 1000  # the schema's 0 means "use epochs", which is 0 too
        for name in RUN_QUESTIONS + (VIDEO_RUN_QUESTIONS if entry.get("dataset_type") == "video" else ()):
            if name == "validation_resolution":
                if cfg.get("validation_prompt") or "validation_resolution" in cfg:  # without a prompt: unused
                    self.ask(self.train_specs[name], cfg, TrainConfig, offer=size)
            elif name == "learning_rate" and cfg.get("model_type") == "full" and name not in cfg:
                self.ask(self.train_specs[name], cfg, TrainConfig, offer=FULL_LEARNING_RATE)
            elif name == "validation_num_video_frames":  # asked again while image-to-video would refuse it
                offer = self.i2v_frames(entry)
                while True:
                    self.ask(self.train_specs[name], cfg, TrainConfig, offer=offer)
                    if (offer := self.i2v_frames(entry)) is None:
                        break
                    self.answered.discard(name)  # the answer is refused: the offer replaces it
            else:
                self.ask(self.train_specs[name], cfg, TrainConfig)
        self.memory()

    def new_id(self, wanted: str) -> str:
        """`wanted`, or `wanted-2`, ...: an id no other entry has (a folder named text-embeds gave the dataset the
        text cache entry's id, which the review refused with no question to change it)."""
        taken = {e.get("id") for e in self.datasets if isinstance(e, dict)} | {"text-embeds"}
        n, candidate = 1, wanted
        while candidate in taken:
            n += 1
            candidate = f"{wanted}-{n}"
        return candidate

    def lycoris_question(self) -> None:
        """lora_type 'lycoris' needs a lycoris_config file: an existing one is kept, else the algorithm is asked and
        a default file for it is written beside config.json (with the other files, after the review)."""
        cfg = self.config
        current = cfg.get("lycoris_config")
        if isinstance(current, str) and Path(current).is_file() and current != self.lycoris_path():
            self.say(f"\n  lycoris_config: {current} (kept; edit that file to change the network)")
            return
        path = self.lycoris_path()
        if self.lycoris is None and Path(path).is_file():
            self.lycoris = self.read(Path(path), "lycoris_config")
        algo = self.lycoris.get("algo") if isinstance(self.lycoris, dict) else None
        algos = list(LYCORIS_DEFAULTS)
        self.say("\nLyCORIS algorithm (lycoris_config algo)")
        self.say(f"  written to {path}; edit it afterwards for the other LyCORIS keys (factor, linear_dim, presets)")
        for i, name in enumerate(algos, 1):
            self.say(f"  {i}) {name}")
        while True:
            answer = _input(f"lycoris.algo [{algo or 'lokr'}]: ").strip() or str(algo or "lokr")
            chosen = algos[int(answer) - 1] if answer.isdigit() and 0 < int(answer) <= len(algos) else answer
            if chosen == algo or chosen in algos:
                break
            self.say(f"  choose a number from 1 to {len(algos)}, or one of: {', '.join(algos)}")
        if chosen != algo:
            self.lycoris = dict(LYCORIS_DEFAULTS[chosen])
        cfg["lycoris_config"] = path

    def lycoris_path(self) -> str:
        return str(self.config_path.parent / "lycoris_config.json")

    def stage(self, tmp: Path, settings: dict[str, Any], drop: set[str] = frozenset()) -> tuple[Path, Path]:
        """The files about to be written, in `tmp` (config, dataset list, and the lycoris_config the wizard makes),
        with `settings` over the config and without the keys `drop`: what the planner and the review read."""
        tmp_cfg, tmp_data = tmp / "config.json", tmp / "datasets.json"
        tmp_data.write_text(json.dumps(self.datasets))
        config = {k: v for k, v in self.config.items() if k not in drop}
        config.update(settings, data_backend_config=str(tmp_data))
        if self.lycoris is not None and config.get("lycoris_config") == self.lycoris_path():
            (tmp / "lycoris.json").write_text(json.dumps(self.lycoris))
            config["lycoris_config"] = str(tmp / "lycoris.json")
        tmp_cfg.write_text(json.dumps(config))
        return tmp_cfg, tmp_data

    def problems(self) -> list[str]:
        """What `difftune check` would say about the files about to be written (config, list, scan)."""
        data_path = self.datasets_path()
        with tempfile.TemporaryDirectory(prefix="difftune-configure-") as tmp:
            tmp_cfg, tmp_data = self.stage(Path(tmp), {})

            def real(text: str) -> str:  # the staged files' paths as the files about to be written
                return text.replace(str(tmp_cfg), str(self.config_path)).replace(str(tmp_data), str(data_path)) \
                    .replace(str(Path(tmp) / "lycoris.json"), self.lycoris_path())
            try:
                run_cfg = load_config(tmp_cfg)
                from difftune.train.plan import DataError, discover_all
                from difftune.train.run_lock import NotWritable, check_writable

                try:
                    check_writable(Path(run_cfg.train.output_dir))  # as `difftune check` does
                    found = discover_all(run_cfg, write_metadata=False)  # a cancelled wizard writes nothing
                except (DataError, NotWritable) as e:
                    return [str(e)]
                self.review_notes = [real(n) for n in run_cfg.notes()] + data_notes(found)
            except ConfigError as e:
                return [real(p) for p in e.problems]
        return []

    def review(self) -> bool:
        self.say(f"\n=== review\n{self.config_path}:")
        self.say(json.dumps(self.config, indent=2))
        self.say(f"{self.datasets_path()}:")
        self.say(json.dumps(self.datasets, indent=2))
        problems = self.problems_seen = self.problems()
        if problems:
            self.say("\nThese must be fixed before anything is written:")
            for p in problems:
                self.say(f"  - {p}")
            return False
        self.say("\ndifftune check accepts this configuration.")
        for note in self.review_notes:  # what check says beside its OK (a note may be what was not meant)
            self.say(f"note: {note}")
        return True

    def write(self) -> None:
        files = [(self.datasets_path(), self.datasets), (self.config_path, self.config)]
        lycoris = Path(self.lycoris_path())
        if self.lycoris is not None and self.config.get("lycoris_config") == str(lycoris) and not (
                lycoris.is_file() and self.read(lycoris, "lycoris_config") == self.lycoris):
            files.insert(0, (lycoris, self.lycoris))  # only when the wizard made or changed it
        for path, data in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
            self.say(f"wrote {path}")

    def entry_named(self, dataset: str | int | None) -> dict[str, Any] | None:
        """The dataset entry a problem names: by its id, or by its index when it has none."""
        for index, entry in enumerate(self.datasets):
            if isinstance(entry, dict) and (entry.get("id") == dataset or (index == dataset and "id" not in entry)):
                return entry
        return None

    def fix_unknown_keys(self) -> bool:
        """Offer, for each unknown key of the last review, the loader's "did you mean" key or dropping it: the
        questions never touch a key the schema does not know, so the review could not pass otherwise. True when
        something changed (the review runs again)."""
        changed = False
        files = (str(self.config_path), str(self.datasets_path()))
        for text in self.problems_seen:
            found = re.search(r"unknown key '([^']*)'(?:; did you mean '([^']*)'\?)?", text)
            if found is None:
                continue
            problem = split_problem(text, files)
            holder = self.config if problem.dataset is None else self.entry_named(problem.dataset)
            key, better = found.groups()
            raw = next((k for k in holder or {} if k.lstrip("-") == key), None)
            if holder is None or raw is None:
                continue
            self.say(f"\n{text}")
            if better and better not in holder and _yes(f"Rename {raw} to {better} (its value kept)? [Y/n]: "):
                items = list(holder.items())  # in place, keeping the key's position in the file
                holder.clear()
                holder.update((better if k == raw else k, v) for k, v in items)
                changed = True
            elif _yes(f"Drop {raw} (its value {_show(holder[raw])})? [Y/n]: "):
                del holder[raw]
                changed = True
        return changed

    def run(self) -> int:
        self.say(f"difftune configure: {'editing' if self.editing else 'a new'} {self.config_path}")
        self.say("Enter keeps the value in [brackets]; '-' empties an optional value. Ctrl-C quits without writing.")
        for note in self.notes:
            self.say(f"note: {note}")
        if self.single_entry is not None:
            path = self.datasets_path()
            self.say(f"\n{path} holds one dataset entry as a JSON object, not a list of entries (difftune check: "
                     "the dataset list must be a JSON list of entries, got dict).")
            if not _yes("Wrap it in a list, as the only entry (written only after the review)? [Y/n]: "):
                self.say(f"nothing written; put [ and ] around the entry in {path}")
                return 2
            self.datasets = [self.single_entry]
        while True:
            self.questions()
            ok = self.review()
            while not ok and self.fix_unknown_keys():
                ok = self.review()
            if ok:
                answer = _input("Write these files? [Y/n]: ").strip().lower()
                if answer in ("", "y", "yes"):
                    self.write()
                    self.say(f"next: difftune train --config {shlex.quote(str(self.config_path))}")
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
    except ConfigError as e:  # an unreadable file: named, with its line
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def data_notes(found: list[Any], shown: int = 5) -> list[str]:
    """The scan's per-file notes and left-out files, a few per dataset (`difftune check` lists them all)."""
    out = []
    for d in found:
        lines = [f"{path.name}: {why}" for path, why in d.notes] + [f"{path.name}: left out: {why}" for path, why in d.skipped]
        out += [f"dataset {d.dataset_id!r}: {line}" for line in lines[:shown]]
        if len(lines) > shown:
            out.append(f"dataset {d.dataset_id!r}: {len(lines) - shown} more (difftune check --all lists them)")
    return out
