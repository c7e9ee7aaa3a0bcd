"""What a lycoris_config file may hold, checked when the config loads (before any model): the algorithm, the keys
create_lycoris reads and apply_preset's shape. Import-light (no torch, no lycoris); adapters/lycoris.py builds the
network from the same facts, and tests/test_lycoris.py checks them against the installed lycoris-lora."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

POSITIONAL = {"multiplier": 1.0, "linear_dim": 4, "linear_alpha": 1.0}
# Keywords create_lycoris (lycoris-lora 4.1.3, lycoris/wrapper.py) reads; anything else it would silently drop.
CREATE_KWARGS = frozenset({
    "algo", "conv_dim", "conv_alpha", "dropout", "rank_dropout", "module_dropout", "use_tucker", "use_cp",
    "use_conv_cp", "disable_conv_cp", "use_scalar", "block_size", "train_norm", "constraint", "constrain", "rescaled",
    "dora_wd", "wd_on_output", "full_matrix", "bypass_mode", "unbalanced_factorization", "train_llm_adapter",
    "preset", "decompose_both", "factor",
})
# lycoris/wrapper.py's network_module_dict: the algorithms create_lycoris builds
ALGOS = ("boft", "diag-oft", "dylora", "full", "glora", "ia3", "locon", "loha", "lokr", "lora", "tlora")


# Algorithms lycoris-lora builds and trains but cannot load back from their saved file: the run's result would load
# nowhere (not with create_lycoris_from_weights, the model card's code, nor a resume)
UNLOADABLE = {"ia3": "algo 'ia3' trains, but lycoris-lora (4.1.3) cannot load its saved file back (IA3Module."
                     "make_module_from_state_dict is called with an argument it does not take), so neither diffusers "
                     "nor a resume could use the result; use another algo (lokr, loha, locon)"}


def uses_dora(data: Mapping[str, Any]) -> bool:
    """Whether the network decomposes weights (`dora_wd`, on the file or in apply_preset's module_algo_map)."""
    maps = (data.get("apply_preset") or {}).get("module_algo_map") or {}
    per_module = [v for v in maps.values() if isinstance(v, Mapping)] if isinstance(maps, Mapping) else []
    return any(bool(d.get("dora_wd")) for d in [data, *per_module])


def algo_of(data: Mapping[str, Any]) -> str:
    """The algorithm as create_lycoris reads it: lower-cased, 'lora' when unset or null ("LoKr" trains LoKr)."""
    return str(data.get("algo") or "lora").lower()


def known_keys() -> list[str]:
    return sorted(set(POSITIONAL) | CREATE_KWARGS | {"apply_preset"})


def problem(data: Any) -> str | None:
    """Why a lycoris_config's content cannot build a network (None when it can, as far as the file alone tells)."""
    if not isinstance(data, Mapping) or "algo" not in data:
        return "must be a JSON object with at least 'algo' (lokr, loha, locon, ...)"
    if algo_of(data) not in ALGOS:
        return f"algo {data['algo']!r} is not a LyCORIS algorithm; use one of {', '.join(ALGOS)}"
    if algo_of(data) in UNLOADABLE:
        return UNLOADABLE[algo_of(data)]
    unknown = sorted(set(data) - set(known_keys()))
    if unknown:
        return f"unknown key(s) {unknown}; known: {known_keys()}"
    if not isinstance(data.get("apply_preset") or {}, Mapping):
        return "apply_preset must be an object (target_module, target_name, module_algo_map, ...)"
    return None
