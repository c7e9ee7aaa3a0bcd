"""Model families. `get_family(name)` returns the family object; nothing outside this package
branches on a family name."""

from __future__ import annotations

import importlib

from difftune.models.base import Family
from difftune.models.registry import FAMILY_FACTS


def get_family(name: str) -> Family:
    facts = FAMILY_FACTS[name]
    module = importlib.import_module(facts.module)
    return module.FAMILY
