"""Problems of `difftune check` split into file, dataset, key and message, for showing each one at its field (the
web UI, the wizard)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from difftune.config.datasets import DATASET_MODELS
from difftune.config.schema import TrainConfig


@dataclass(frozen=True)
class Problem:
    """One problem as `difftune check` prints it (`text`), split into file, dataset, key and message."""

    text: str
    file: str | None
    dataset: str | int | None  # the entry's id, or its index in the list when it has no id
    key: str | None  # dotted key ("parquet.path") when the problem is about one key
    message: str  # the text after file, dataset and key
    mentions: tuple[str, ...] = ()  # known keys named in the message (cross-field problems)


def _known_keys() -> set[str]:
    keys = set(TrainConfig.model_fields)
    for model in DATASET_MODELS.values():
        keys |= set(model.model_fields)
    return keys


def split_problem(text: str, files: tuple[str, ...] = ()) -> Problem:
    """Split a ConfigError problem; `files` are the paths that may start it (longest match wins)."""
    file, rest = None, text
    for candidate in sorted(files, key=len, reverse=True):
        if text.startswith(f"{candidate}: "):
            file, rest = candidate, text[len(candidate) + 2:]
            break
    else:
        if ": " in text:
            file, rest = text.split(": ", 1)
    dataset: str | int | None = None
    m = re.match(r"dataset ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\d+): ", rest) or re.match(r"entry (\d+) ", rest)
    if m:
        dataset = ast.literal_eval(m.group(1))
        rest = rest[m.end():] if m.group(0).endswith(": ") else rest
    known = _known_keys()
    key, message = None, rest
    if m2 := re.match(r"(\w+) \(difftune's \w+\): (.*)", rest, re.DOTALL):  # an alias as written (validation_steps)
        key, message = m2.group(1), m2.group(2)
    elif m2 := re.match(r"([\w]+(?:\.[\w]+)*): (.*)", rest, re.DOTALL):
        key, message = m2.group(1), m2.group(2)
    elif m2 := re.match(r"(\w+)=", rest):
        key = m2.group(1)
    elif m2 := re.match(r"unknown key '([^']*)'", rest):
        key = m2.group(1)
    elif (word := rest.split(" ", 1)[0]) in known:
        key = word
    # a word joined to another by '-' is part of a name (kandinsky5-video, image-to-video), not a key
    mentions = tuple(k for k in re.findall(r"(?<!\w)(?<!\w-)[a-z][a-z0-9_]*\b(?!-\w)", message)
                     if k in known and k != key)
    return Problem(text=text, file=file, dataset=dataset, key=key, message=message,
                   mentions=tuple(dict.fromkeys(mentions)))
