"""Small helpers shared by the schema modules: a field constructor that records the UI group.

Every field carries a description, a default and a group ("model", "data", "training", "validation",
"memory", "output"). `--help`, the wizard and the web UI read them from the JSON Schema; nothing
re-declares a field by hand.
"""

from __future__ import annotations

import os
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, Field, model_validator

GROUPS = ("model", "data", "training", "validation", "memory", "output")


def field(
    default: Any, description: str, group: str, *, advanced: bool = False, choices: list[str] | None = None,
    **kwargs: Any,
) -> Any:
    """`choices`: allowed values of a str field validated elsewhere (shown as an enum in the schema)."""
    if group not in GROUPS:
        raise ValueError(f"unknown UI group {group!r}")
    extra: dict[str, Any] = {"group": group, "advanced": advanced}
    if choices is not None:
        extra["enum"] = choices
    return Field(default, description=description, json_schema_extra=extra, **kwargs)


def expand_home(value: Any) -> Any:
    """A path written with `~` (`~/data`, `~user/data`) as the shell would expand it; anything else unchanged.
    The path keys' validators call it, so every later reader (checks, loaders, hub calls) gets the real folder,
    never a `~` taken literally (a folder named `~` under the working folder, or a hub id that fails)."""
    if isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    return value


def unset(value: Any) -> bool:
    """Null as SimpleTuner's configs and the web UI spell it: null, "" or "none" (for keys whose null means their
    default: their validators call this rather than comparing with None)."""
    return value is None or isinstance(value, str) and value.strip().lower() in ("", "none")


def default_if_unset(model: type[BaseModel], value: Any, name: str) -> Any:
    """Field `name`'s default where SimpleTuner writes null ("" or "none") for it: the same as leaving the key out."""
    return model.model_fields[name].default if unset(value) else value


def zero_is_off(value: Any) -> Any:
    """A limit whose 0 (or false), null, "" or "none" means "no limit" -> None (`max_grad_norm`)."""
    try:
        return None if unset(value) or float(value) == 0 else value
    except (TypeError, ValueError):
        return value


def text_list(value: Any) -> Any:
    """A list key written as text (the command line's only form): '0.5, 1.0' or '[0.5, 1.0]' -> its items as
    strings (the field's type converts them); empty -> None; anything else unchanged."""
    if isinstance(value, str):
        text = value.strip().removeprefix("[").removesuffix("]")
        return [part.strip() for part in text.split(",") if part.strip()] or None
    return value


def unset_values(fields: dict[str, Any], data: Any, free_text: frozenset[str] = frozenset()) -> Any:
    """A model's input with "not set" spelled as SimpleTuner users spell it turned into None, for every field that
    takes None (`fields`: the model's model_fields): "" (the web UI's and SimpleTuner's empty text box) and, but for
    the free-text fields in `free_text` (a prompt or a name may be the word), "none" in any case. Without it a
    number field ("Empty means ...") would refuse "" as not a number, and a path field would read a file `none`."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for key, value in data.items():
        info = fields.get(key)
        if info is None or not isinstance(value, str) or type(None) not in typing.get_args(info.annotation):
            continue
        if value == "" or key not in free_text and value.strip().lower() in ("", "none"):
            out[key] = None
    return out


class UnsetSpellings(BaseModel):
    """Base of a schema whose optional keys take "" and "none" for null (unset_values). `FREE_TEXT`: its optional
    keys of free text, where "none" is kept as written."""

    FREE_TEXT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _unset_spellings(cls, data: Any) -> Any:
        return unset_values(cls.model_fields, data, cls.FREE_TEXT)
