"""Import-light facts about each model family: names, flavours, defaults.

The config schema validates against these without importing torch or diffusers. The heavy code of a
family lives in its own module (`models/lumina2.py`), looked up by `models.get_family`.
"""

from __future__ import annotations

from dataclasses import dataclass

TINY_FLAVOUR = "tiny-random"


@dataclass(frozen=True)
class FamilyFacts:
    name: str
    flavours: dict[str, str]  # flavour -> hub repository id ("tiny-random" -> "" : built offline)
    default_flavour: str
    default_guidance: float
    module: str  # where the family's implementation lives, imported on demand


FAMILY_FACTS: dict[str, FamilyFacts] = {
    "lumina2": FamilyFacts(
        name="lumina2",
        flavours={"2.0": "Alpha-VLLM/Lumina-Image-2.0", TINY_FLAVOUR: ""},
        default_flavour="2.0",
        default_guidance=4.0,
        module="difftune.models.lumina2",
    ),
}


def family_names() -> tuple[str, ...]:
    return tuple(FAMILY_FACTS)
