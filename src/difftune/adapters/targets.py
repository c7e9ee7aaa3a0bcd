"""`lora_target_modules` checked against the transformer before peft reads it.

peft takes a list of names, each matching every module whose path is that name or ends with "." + it, and a
single string as a regular expression matching whole paths. A name that matches nothing was dropped without a
word when another name matched (`to_q,to_kk` trained `to_q` alone), and a list matching nothing crashed in peft
after the caches were filled. Here each name must match a layer: checked on the transformer built on the meta
device before any model loads (`difftune check` too), and on the loaded transformer before peft wraps it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from difftune.models.hub import ComponentError


class LoraTargetsError(ComponentError):
    """lora_target_modules that do not name layers of the transformer (exit code 2 with the message)."""


def _matches(target: str, path: str) -> bool:
    return path == target or path.endswith("." + target)


def _leaf(path: str) -> str:
    """The name a target gives for this layer: its last part, with its list's name before an index (to_out.0)."""
    parts = path.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def problem(transformer: torch.nn.Module, targets: Any, family: str) -> str | None:
    """Why `targets` would not train what it names on this transformer, or None."""
    paths = {path: module for path, module in transformer.named_modules() if path}
    layers = sorted({_leaf(path) for path, module in paths.items() if isinstance(module, torch.nn.Linear)})
    where = (f"of the {family} transformer ({type(transformer).__name__}); its linear layers are named "
             f"{', '.join(layers)}")
    if isinstance(targets, str):  # peft: a regular expression over the whole path
        try:
            found = [p for p in paths if re.fullmatch(targets, p)]
        except re.error as e:
            return f"lora_target_modules {targets!r} is not a regular expression ({e}); give a list of layer names"
        return None if found else f"lora_target_modules {targets!r} (a regular expression) matches no module {where}"
    missing = [t for t in targets if not any(_matches(t, p) for p in paths)]
    if missing:
        names = ", ".join(repr(t) for t in missing)
        return (f"lora_target_modules {names} match{'es' if len(missing) == 1 else ''} no module {where} (a name "
                "matches each module whose path ends with it, such as 'to_q' for 'layers.0.attn.to_q')")
    blocks = [t for t in targets if all(len(list(m.children())) for p, m in paths.items() if _matches(t, p))]
    if blocks:
        kinds = sorted({type(m).__name__ for p, m in paths.items() if any(_matches(t, p) for t in blocks)})
        return (f"lora_target_modules {', '.join(repr(t) for t in blocks)} name{'s' if len(blocks) == 1 else ''} "
                f"whole blocks ({', '.join(kinds)}), not layers: name the linear layers inside them {where}")
    return None


def check_targets(cfg: Any, build_tiny: bool = True) -> None:
    """Before any model loads: `lora_target_modules` against the transformer built on the meta device (no weights).
    A transformer whose architecture is not known before it loads is checked when it loads (LoraAdapter), and so is
    a tiny flavour not to be built here (`build_tiny` false: several processes, where one builds it later)."""
    if not (cfg.model_type == "lora" and cfg.lora_type == "standard" and cfg.lora_target_modules):
        return
    from difftune.memory_plan.architecture import transformer_before_load

    if (transformer := transformer_before_load(cfg, build_tiny)) is None:
        return
    if (text := problem(transformer, cfg.lora_target_modules, cfg.model_family)) is not None:
        raise LoraTargetsError(text)
