"""Small helpers shared by the schema modules: a field constructor that records the UI group.

Every field carries a description, a default and a group ("model", "data", "training", "validation",
"memory", "output"). `--help`, the wizard and the web UI read them from the JSON Schema; nothing
re-declares a field by hand.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field

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
