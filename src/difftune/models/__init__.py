"""Model families. `get_family(name)` returns the family object; nothing outside this package
branches on a family name."""

from __future__ import annotations

import importlib
from pathlib import Path

from difftune.models.base import Family
from difftune.models.registry import FAMILY_FACTS, TINY_FLAVOUR


def get_family(name: str) -> Family:
    facts = FAMILY_FACTS[name]
    module = importlib.import_module(facts.module)
    return module.FAMILY


def is_tiny(flavour: str) -> bool:
    return flavour.startswith(TINY_FLAVOUR)


def tiny_model(family_name: str, flavour: str) -> Path:
    """The folder of a tiny random-init flavour, built offline on first use (hub layout)."""
    from difftune.models.tiny import ensure_built

    family = get_family(family_name)
    # The version suffix changes whenever a builder changes, so a stale tiny model is never reused.
    return ensure_built(f"{family_name}-{flavour}-v3", lambda folder: family.build_tiny(folder, flavour))
