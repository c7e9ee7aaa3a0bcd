"""LyCORIS adapters (LoKr, LoHa, LoCon, ...) through the `lycoris-lora` package.

The config is the content of a `lycoris_config` JSON file as SimpleTuner users write it, e.g.

    {"algo": "lokr", "multiplier": 1.0, "linear_dim": 10000, "linear_alpha": 1, "factor": 16,
     "apply_preset": {"target_module": ["Attention"], "module_algo_map": {"Attention": {"factor": 16}}}}

- `multiplier`, `linear_dim`, `linear_alpha` are `create_lycoris`'s positional arguments (defaults 1.0, 4, 1);
- every other top-level key is a keyword of `lycoris.create_lycoris` (`algo`, `factor`, `full_matrix`,
  `decompose_both`, `use_tucker`, `use_scalar`, `dora_wd`, `dropout`, `rank_dropout`, `module_dropout`, `conv_dim`,
  `conv_alpha`, `block_size`, `rescaled`, `constraint`, `bypass_mode`, `unbalanced_factorization`, `preset`, ...);
  an unknown key is an error (LyCORIS itself would ignore it silently);
- `apply_preset` is what `LycorisNetwork.apply_preset` takes: `target_module` (module class names whose Linear/Conv
  children are wrapped), `target_name` (module paths, `re.match` patterns or fnmatch ones with `use_fnmatch`),
  `module_algo_map` / `name_algo_map` (per class / per name overrides such as `{"algo": "lora", "factor": 8}`),
  `exclude_name`, `lora_prefix`, `enable_conv`.

Targets. When the preset names no target (no `target_module`, `target_name`, `module_algo_map` or `name_algo_map`),
the family's attention projections are wrapped, the same modules its LoRA adapts (`Family.lora_target_modules`):
Lumina2 `to_q`, `to_k`, `to_v`, `to_out.0` of every `attn`, Kandinsky 5 `to_query`, `to_key`, `to_value`,
`out_layer` of every `self_attention` / `cross_attention`. When it names targets, exactly those are wrapped: a key it
leaves out is empty, not LyCORIS's class default (which targets every Linear, Conv and LayerNorm of the model).

`LycorisNetwork.apply_preset` sets class attributes, i.e. process-wide state. `attach_lycoris` and `load_lycoris`
apply a preset only for the duration of the network's construction, starting from LyCORIS's defaults, and restore the
previous class state afterwards, so one network's preset never leaks into the next.

LyCORIS reports what it could not apply (a preset class or name that matches no module: "No modules matched the
following target module classes: ['FeedForward']") through its own logger, which writes to stdout only, or with
print ("[WARN]..."). `attach_lycoris` keeps those messages on the network (`difftune_warnings`), so the run records
them as warning events (train/setup.py) instead of letting them scroll past on the console.

Saving writes what `LycorisNetwork.save_weights` writes (safetensors; keys `<lora_prefix>_<module path with _>.<param>`,
e.g. `lycoris_layers_0_attn_to_q.lokr_w1`) with SimpleTuner's metadata key `lycoris_config` (the config as JSON).
Loading rebuilds the network from the file with `lycoris.create_lycoris_from_weights` (module types and shapes come
from the weights) and applies it.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import re
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

import torch
from lycoris import LycorisNetwork, create_lycoris, create_lycoris_from_weights
from safetensors import safe_open
from safetensors.torch import load_file

from difftune.config.lycoris_file import POSITIONAL, algo_of
from difftune.config.lycoris_file import problem as file_problem
from difftune.models.hub import ComponentError

METADATA_KEY = "lycoris_config"  # SimpleTuner's metadata key for the config
TARGET_KEYS = ("target_module", "target_name", "module_algo_map", "name_algo_map")
# Class attributes LycorisNetwork.apply_preset writes (lycoris/wrapper.py), and their values as the library defines
# them, captured when this module is first imported.
_PRESET_ATTRS = ("ENABLE_CONV", "TARGET_REPLACE_MODULE", "TARGET_REPLACE_NAME", "LORA_PREFIX", "MODULE_ALGO_MAP",
                 "NAME_ALGO_MAP", "USE_FNMATCH", "TARGET_EXCLUDE_NAME")
_LIBRARY_DEFAULTS = {a: copy.deepcopy(getattr(LycorisNetwork, a)) for a in _PRESET_ATTRS}
LIBRARY_PREFIX = _LIBRARY_DEFAULTS["LORA_PREFIX"]  # the keys' prefix when apply_preset names no lora_prefix
# The transformer class of each family (the attention projections come from the family's lora_target_modules).
FAMILY_OF_CLASS = {"Lumina2Transformer2DModel": "lumina2", "Kandinsky5Transformer3DModel": "kandinsky5-image"}


@contextmanager
def preset_applied(preset: Mapping[str, Any]) -> Iterator[None]:
    """LycorisNetwork's class state = library defaults + `preset`, restored to what it was on exit."""
    saved = {a: getattr(LycorisNetwork, a) for a in _PRESET_ATTRS}
    try:
        for attr, value in _LIBRARY_DEFAULTS.items():
            setattr(LycorisNetwork, attr, copy.deepcopy(value))
        LycorisNetwork.apply_preset(dict(preset))
        yield
    finally:
        for attr, value in saved.items():
            setattr(LycorisNetwork, attr, value)


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def warnings_kept() -> Iterator[list[str]]:
    """LyCORIS's warnings inside the block, in a list, instead of on stdout: its logger's ("LyCORIS", which does not
    propagate) at WARNING and above, and its printed "[WARN]" lines. Its other output still reaches stdout."""
    logger = logging.getLogger("LyCORIS")
    kept, below = _Kept(), (lambda record: record.levelno < logging.WARNING)
    own = list(logger.handlers)
    for handler in own:
        handler.addFilter(below)
    logger.addHandler(kept)
    printed = io.StringIO()
    try:
        with redirect_stdout(printed):
            yield kept.messages
    finally:
        logger.removeHandler(kept)
        for handler in own:
            handler.removeFilter(below)
        for line in printed.getvalue().splitlines():
            if line.startswith("[WARN]"):
                kept.messages.append(line.removeprefix("[WARN]").strip())
            else:
                print(line, file=sys.stdout)


def _matches(targets: tuple[str, ...] | str, name: str) -> bool:
    """peft's target_modules rule: a string is a full-match regex, a sequence holds module-name suffixes."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in targets)


def default_target_names(transformer: torch.nn.Module, family: str | None = None) -> list[str]:
    """Paths of the family's LoRA target modules (attention projections) in `transformer`."""
    from difftune.models import get_family

    name = family or FAMILY_OF_CLASS.get(type(transformer).__name__)
    if name is None:
        raise ValueError(f"no default LyCORIS targets for {type(transformer).__name__}: pass family= or give "
                         "apply_preset a target_module/target_name")
    targets = get_family(name).lora_target_modules
    found = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear) and _matches(targets, n)]
    if not found:
        raise ValueError(f"the {name} targets {targets!r} match no Linear module of {type(transformer).__name__}")
    return found


def resolve_preset(transformer: torch.nn.Module, preset: Mapping[str, Any] | None,
                   family: str | None = None) -> dict[str, Any]:
    """The preset actually applied: the user's, with the family's attention projections when it names no target."""
    preset = dict(preset or {})
    if not any(preset.get(k) for k in TARGET_KEYS):
        # exact module paths: they match whether use_fnmatch is on or off
        preset["target_name"] = default_target_names(transformer, family)
    preset.setdefault("target_module", [])
    preset.setdefault("target_name", [])
    return preset


def split_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(positional args, create_lycoris keywords, apply_preset) of a lycoris_config."""
    config = dict(config)
    if (why := file_problem(config)) is not None:
        raise ValueError(f"lycoris_config: {why}")
    positional = {
        "multiplier": float(config.pop("multiplier", POSITIONAL["multiplier"])),
        "linear_dim": int(config.pop("linear_dim", POSITIONAL["linear_dim"])),
        "linear_alpha": float(config.pop("linear_alpha", POSITIONAL["linear_alpha"])),
    }
    return positional, config, dict(config.pop("apply_preset", None) or {})


def _with_class_hint(message: str, transformer: torch.nn.Module) -> str:
    """A preset class that matched nothing ("No modules matched the following target module classes: ['FeedForward']",
    from SimpleTuner's generic lycoris_config) with this transformer's classes of a similar name (LuminaFeedForward)."""
    found = re.search(r"target module classes: \[(.*?)\]", message)
    if found is None:
        return message
    wanted = [name.strip(" '\"") for name in found[1].split(",") if name.strip(" '\"")]
    classes = sorted({type(m).__name__ for m in transformer.modules()})
    near = [c for c in classes if any(w.lower() in c.lower() and w != c for w in wanted)]
    return message + (f" (this transformer's classes of that name: {', '.join(near)})" if near else "")


def attach_lycoris(transformer: torch.nn.Module, config: Mapping[str, Any], *, family: str | None = None,
                   bypass: bool = False) -> tuple[LycorisNetwork, list[torch.nn.Parameter]]:
    """Wrap `transformer`'s target modules with a LyCORIS network built from a lycoris_config; returns the network
    (applied: the transformer's forward now includes it) and its trainable parameters. The transformer is frozen and
    the adapter is fp32 on the transformer's device (as difftune's LoRA). `bypass`: the base weights are quantized,
    so each layer adds the network's output to its own (LyCORIS' bypass mode) instead of merging weights; the
    saved file is the same."""
    positional, kwargs, preset = split_config(config)
    if bypass:
        kwargs["bypass_mode"] = True
    transformer.requires_grad_(False)
    with preset_applied(resolve_preset(transformer, preset, family)), warnings_kept() as warned:
        network = create_lycoris(transformer, positional["multiplier"], positional["linear_dim"],
                                 positional["linear_alpha"], **kwargs)
    network.difftune_warnings = [_with_class_hint(w, transformer) for w in dict.fromkeys(warned)]  # once each: LoHa
    # and LoKr print theirs per module
    if not network.loras:
        raise ValueError("the LyCORIS config matched no module of the transformer; check apply_preset")
    network.apply_to()
    device = next(transformer.parameters()).device
    network.to(device=device, dtype=torch.float32)
    network.requires_grad_(True)
    network.difftune_lycoris_config = copy.deepcopy(dict(config))
    params = [p for p in network.parameters() if p.requires_grad]
    return network, params


def save_lycoris(network: LycorisNetwork, path: str | Path, metadata: Mapping[str, Any] | None = None) -> Path:
    """`network.save_weights` to a .safetensors file, with the config under `lycoris_config` (as SimpleTuner does)
    unless `metadata` has one; non-string metadata values are written as JSON."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: LyCORIS weights are saved as .safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    config = getattr(network, "difftune_lycoris_config", None)
    if config is not None:
        meta.setdefault(METADATA_KEY, json.dumps(config))
    network.save_weights(str(path), None, meta)
    return path


def read_config(path: str | Path) -> dict[str, Any] | None:
    """The lycoris_config stored in a LyCORIS file's metadata, if any."""
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(METADATA_KEY)
    return json.loads(raw) if raw else None


def load_lycoris(transformer: torch.nn.Module, path: str | Path, multiplier: float | None = None) -> LycorisNetwork:
    """Rebuild the LyCORIS network saved at `path` on `transformer` and apply it. The multiplier defaults to the
    stored config's (else 1.0). Raises if the file holds modules the transformer does not have."""
    path = Path(path)
    weights = load_file(str(path))
    config = read_config(path) or {}
    if multiplier is None:
        multiplier = float(config.get("multiplier", 1.0))
    prefix = (config.get("apply_preset") or {}).get("lora_prefix", LIBRARY_PREFIX)
    with preset_applied({"lora_prefix": prefix}):
        network, _ = create_lycoris_from_weights(multiplier, str(path), transformer, weights_sd=weights)
    stored = {k.split(".", 1)[0] for k in weights if "." in k}
    built = {lora.lora_name for lora in network.loras}
    if stored != built:
        raise ValueError(f"{path}: modules not in {type(transformer).__name__} (or not loadable): "
                         f"{sorted(stored - built)[:5]}")
    network.apply_to()
    # in the transformer's dtype, as load_lora_weights puts a LoRA: `full` and `glora` modules multiply their
    # weights with the activations as they are, so fp32 weights in a bf16 pipeline would be an error
    network.to(device=next(transformer.parameters()).device, dtype=base_dtype(transformer))
    network.difftune_lycoris_config = config
    return network


def base_dtype(transformer: torch.nn.Module) -> torch.dtype:
    """The dtype of most of the transformer's floating-point weights, by size (its bf16 or fp32, not a small fp32
    adapter's; a quantized weight reports the dtype it computes in; a packed 4-bit one is not counted). The modules
    the model keeps in fp32 (`_keep_in_fp32_modules`: Kandinsky 5's modulations) are not counted: once a `full`
    network has taken the adapted layers' weights they would outweigh the rest."""
    kept = tuple(getattr(transformer, "_keep_in_fp32_modules", None) or ())
    counts: Counter[torch.dtype] = Counter()
    for name, p in transformer.named_parameters():
        if p.is_floating_point() and not any(part in kept for part in name.split(".")):
            counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else torch.float32


class LycorisConfigError(ComponentError):
    """A lycoris_config whose network does not fit the model (exit code 2 with the message)."""


def unbuildable(path: Any, family: str, e: Exception) -> str:
    """lycoris-lora's refusal to build a file's network on this transformer (BOFT's factor against a layer width,
    say), said with the file: it was a traceback after the caches had filled."""
    return (f"{path}: lycoris-lora cannot build this network on the {family} transformer ({type(e).__name__}: "
            f"{e}); change the file's algo or its keys (linear_dim, factor, ...)")


def check_preset(cfg: Any, build_tiny: bool = True) -> None:
    """Before any model loads (`difftune check` too): the network is built on the transformer on the meta device (no
    weights), so an apply_preset that matches no module (SimpleTuner's generic 'Attention', 'FeedForward' classes)
    fails now, naming the file and this transformer's classes, instead of after the caches fill. A transformer whose
    architecture is not known before it loads is checked when it loads (attach_lycoris), and so is a tiny flavour not
    to be built here (`build_tiny` false: several processes, where one builds it later)."""
    if not (cfg.model_type == "lora" and cfg.lora_type == "lycoris"):
        return
    from difftune.memory_plan.architecture import transformer_before_load

    if (transformer := transformer_before_load(cfg, build_tiny)) is None:
        return
    positional, kwargs, preset = split_config(json.loads(Path(cfg.lycoris_config).read_text(encoding="utf-8-sig")))
    applied = resolve_preset(transformer, preset, cfg.model_family)
    logger = logging.getLogger("LyCORIS")
    level, _ = logger.level, logger.setLevel(logging.WARNING)  # its INFO lines belong to training, not a check
    try:
        with torch.device("meta"), preset_applied(applied), warnings_kept() as warned:
            network = create_lycoris(transformer, positional["multiplier"], positional["linear_dim"],
                                     positional["linear_alpha"], **kwargs)
    except NotImplementedError:  # an algo that reads the weights it wraps (full, dora_wd) cannot build on meta:
        return  # checked when it loads
    except (ValueError, TypeError, AssertionError, RuntimeError) as e:  # what the file asks cannot be built here
        if "meta" in str(e):
            return  # an operation without data (item() of a meta tensor): checked when it loads
        raise LycorisConfigError(unbuildable(cfg.lycoris_config, cfg.model_family, e)) from e
    finally:
        logger.setLevel(level)
    if network.loras:
        return
    hints = [_with_class_hint(w, transformer) for w in dict.fromkeys(warned) if "target module classes" in w]
    classes = sorted({type(m).__name__ for m in transformer.modules()} - {"ModuleList", "Sequential", "ModuleDict"})
    raise LycorisConfigError(
        f"{cfg.lycoris_config}: its apply_preset matches no module of the {cfg.model_family} transformer "
        f"({type(transformer).__name__})" + (f": {'; '.join(hints)}" if hints else "") + ". Name its classes in "
        f"target_module (they are {', '.join(classes)}), module paths in target_name, or leave apply_preset out to "
        "train the attention projections")


def check_device(cfg: Any, device: torch.device) -> None:
    """Before any model loads: LyCORIS `full` and `glora` multiply their own fp32 weights with the activations, and
    with mixed_precision 'fp16' on the CPU there is no autocast to cast them (accelerate's CPU autocast is bf16)."""
    if not (cfg.model_type == "lora" and cfg.lora_type == "lycoris" and cfg.mixed_precision == "fp16"
            and device.type == "cpu"):
        return
    algo = algo_of(json.loads(Path(cfg.lycoris_config).read_text(encoding="utf-8-sig")))
    if algo in ("full", "glora"):
        raise ValueError(f"LyCORIS algo {algo!r} with mixed_precision 'fp16' on the CPU: there is no fp16 autocast "
                         "there to cast its fp32 weights to the fp16 activations; use mixed_precision 'bf16' (or 'no') "
                         "on the CPU")
