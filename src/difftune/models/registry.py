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
    conditioning_flavours: frozenset[str] = frozenset()  # flavours trained on (condition, target) pairs
    default_resolution: str = "1024x1024"
    pixel_multiple: int = 16  # image sides must be multiples of this (VAE factor x patch size)

    def needs_conditioning(self, flavour: str) -> bool:
        return flavour in self.conditioning_flavours


FAMILY_FACTS: dict[str, FamilyFacts] = {
    "lumina2": FamilyFacts(
        name="lumina2",
        flavours={"2.0": "Alpha-VLLM/Lumina-Image-2.0", TINY_FLAVOUR: ""},
        default_flavour="2.0",
        default_guidance=4.0,
        module="difftune.models.lumina2",
    ),
    "kandinsky5-image": FamilyFacts(
        name="kandinsky5-image",
        flavours={
            "t2i-lite-sft": "kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers",
            "t2i-lite-pretrain": "kandinskylab/Kandinsky-5.0-T2I-Lite-pretrain-Diffusers",
            "i2i-lite-sft": "kandinskylab/Kandinsky-5.0-I2I-Lite-sft-Diffusers",
            "i2i-lite-pretrain": "kandinskylab/Kandinsky-5.0-I2I-Lite-pretrain-Diffusers",
            TINY_FLAVOUR: "",
            TINY_FLAVOUR + "-i2i": "",
        },
        default_flavour="t2i-lite-sft",
        default_guidance=5.0,
        module="difftune.models.kandinsky5_image",
        conditioning_flavours=frozenset({"i2i-lite-sft", "i2i-lite-pretrain", TINY_FLAVOUR + "-i2i"}),
    ),
}


def family_names() -> tuple[str, ...]:
    return tuple(FAMILY_FACTS)
