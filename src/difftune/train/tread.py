"""TREAD token routing (`tread_config`): during training, a random part of the image/video tokens skips
a span of transformer blocks and rejoins the sequence, at its own positions, after the span.

TREAD (Krause et al., 2025, "TREAD: Token Routing for Efficient Architecture-agnostic Diffusion
Training") routes tokens chosen uniformly at random; the paper found random routing works as well as
learned or importance-based choices, and the specs describe no importance weighting, so the choice
here is uniform random, per sample, drawn from the run's seeded generator (a resumed run draws the
same tokens). Tokens that carry conditioning are never routed: the caption tokens of Lumina2's joint
sequence and the first latent frame of image-to-video (the input image).

Hooked from outside diffusers' classes, never by copying their code:
- a forward pre-hook on the transformer draws a plan per route (which tokens stay) for this call,
  only while training with gradients on (validation, sampling and the rollouts run without TREAD);
- a forward pre-hook on the first block of a route gathers the kept tokens, and on every block of the
  route substitutes the matching rotary embeddings and attention mask (the model computed them for
  the whole sequence);
- a forward hook on the last block of the route puts the kept tokens back among the routed ones.
Each block is still called by the model's own loop, so gradient checkpointing (which recomputes a
block with the same plan before the next call draws another) and the adapters work unchanged.

Each family names its layout (`Family.tread_layout`): 'joint' (Lumina2: caption and image tokens in
one sequence after the refiners, a rotary embedding per token, an attention mask when captions differ
in length) or 'visual' (Kandinsky 5: the visual stream alone, 3D rotary embeddings per token; the text
stream is separate and passes through untouched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from difftune.models.hub import ComponentError


class TreadError(ComponentError):
    """A route that does not fit the loaded model (exit code 2 with the message, like a component error)."""


@dataclass(frozen=True)
class Route:
    start: int  # first routed block (non-negative)
    end: int  # last routed block, inclusive
    ratio: float  # share of the routable tokens that skip the blocks


def resolve_routes(routes: list[Any], blocks: int) -> list[Route]:
    """The routes of `tread_config` with negative indices counted from the end (-1: the last block),
    checked against the model's `blocks`; TreadError names the key and the block count."""
    out = []
    for i, r in enumerate(routes):
        key = f"tread_config.routes[{i}]"
        idx = {}
        for name in ("start_layer_idx", "end_layer_idx"):
            value = getattr(r, name)
            resolved = value + blocks if value < 0 else value
            if not 0 <= resolved < blocks:
                raise TreadError(f"{key}.{name} {value} is out of range: the model has {blocks} blocks "
                                 f"(indices 0 to {blocks - 1}, or -{blocks} to -1 from the end)")
            idx[name] = resolved
        if idx["start_layer_idx"] > idx["end_layer_idx"]:
            raise TreadError(f"{key}: start_layer_idx {r.start_layer_idx} comes after end_layer_idx "
                             f"{r.end_layer_idx} (block {idx['start_layer_idx']} > block {idx['end_layer_idx']} "
                             f"of {blocks})")
        out.append(Route(idx["start_layer_idx"], idx["end_layer_idx"], float(r.selection_ratio)))
    ordered = sorted(enumerate(out), key=lambda item: item[1].start)
    for (i, a), (j, b) in zip(ordered, ordered[1:], strict=False):
        if b.start <= a.end:
            raise TreadError(f"tread_config.routes[{i}] (blocks {a.start}-{a.end}) and routes[{j}] (blocks "
                             f"{b.start}-{b.end}) overlap; routes must not share a block")
    return out


@dataclass
class Plan:
    """Which tokens of one call stay in a route: `keep` [B, L'] positions in the full sequence."""

    keep: torch.Tensor
    full: torch.Tensor | None = None  # the sequence entering the route
    extras: dict[int, torch.Tensor | None] | None = None  # block arguments gathered to the kept tokens

    def take(self, x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        return x[rows, self.keep.to(x.device)]

    def put(self, full: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(full.shape[0], device=full.device)[:, None].expand_as(self.keep)
        return full.index_put((rows, self.keep.to(full.device)), kept.to(full.dtype))


def _choose(routable: int, ratio: float, batch: int, generator: torch.Generator,
            window: tuple[int, int] | None = None) -> torch.Tensor | None:
    """Sorted positions [B, kept] among `routable` tokens that stay; None when none would be dropped. `window`: (the
    global batch, this process's first sample in it): the scores are drawn for the global batch and this process's
    rows taken, as the noise is, so several processes route as one process with the whole batch would."""
    dropped = int(ratio * routable)
    if dropped <= 0:
        return None
    rows, offset = window if window is not None and window[0] >= batch else (batch, 0)
    scores = torch.rand((rows, routable), generator=generator, device=generator.device)[offset : offset + batch]
    return scores.argsort(dim=1)[:, : routable - dropped].sort(dim=1).values


class JointLayout:
    """Lumina2: the joint sequence of sample i is [caption_i | image tokens | padding] (the model's own
    layout). Block arguments: (hidden, mask or None, rotary embedding, temb)."""

    token_args = (1, 2)

    @staticmethod
    def blocks(transformer: Any) -> torch.nn.ModuleList:
        return transformer.layers

    @staticmethod
    def plan(transformer: Any, kwargs: dict[str, Any], ratio: float, generator: torch.Generator,
             protect_first_frame: bool, window: tuple[int, int] | None = None) -> Plan | None:
        hidden, mask = kwargs["hidden_states"], kwargs["encoder_attention_mask"]
        p = transformer.config.patch_size
        image = (hidden.shape[-2] // p) * (hidden.shape[-1] // p)
        captions = mask.sum(dim=1).tolist()
        total = max(captions) + image
        kept = _choose(image, ratio, len(captions), generator, window)
        if kept is None:
            return None
        rows = [torch.cat([torch.arange(c, device=kept.device), c + kept[i],
                           torch.arange(c + image, total, device=kept.device)])
                for i, c in enumerate(captions)]
        return Plan(torch.stack(rows))


class VisualLayout:
    """Kandinsky 5: the flattened visual tokens [B, T*h*w, D] (frame-major). Block arguments:
    (visual, text, time, rotary embedding, sparse_params)."""

    token_args = (3,)

    @staticmethod
    def blocks(transformer: Any) -> torch.nn.ModuleList:
        return transformer.visual_transformer_blocks

    @staticmethod
    def plan(transformer: Any, kwargs: dict[str, Any], ratio: float, generator: torch.Generator,
             protect_first_frame: bool, window: tuple[int, int] | None = None) -> Plan | None:
        hidden = kwargs["hidden_states"]  # [B, T, H, W, C]
        pt, ph, pw = transformer.config.patch_size
        frame = (hidden.shape[2] // ph) * (hidden.shape[3] // pw)
        tokens = (hidden.shape[1] // pt) * frame
        fixed = frame if protect_first_frame else 0  # image-to-video: the input frame always stays
        kept = _choose(tokens - fixed, ratio, hidden.shape[0], generator, window)
        if kept is None:
            return None
        head = torch.arange(fixed, device=kept.device).expand(hidden.shape[0], fixed)
        return Plan(torch.cat([head, fixed + kept], dim=1))


LAYOUTS = {"joint": JointLayout, "visual": VisualLayout}


def block_count(family: Any, transformer: Any) -> int:
    return len(LAYOUTS[family.tread_layout].blocks(transformer))


def check(tread_config: Any, family: Any, transformer: Any) -> list[Route]:
    """The resolved routes for this model (TreadError when one does not fit); [] without tread_config."""
    if tread_config is None:
        return []
    config = getattr(transformer, "config", None)
    if getattr(config, "attention_type", None) == "nabla":
        raise TreadError("tread_config: this model uses NABLA sparse attention, whose block mask needs every "
                         "token of its 8x8 tiles; remove tread_config for this model")
    return resolve_routes(tread_config.routes, block_count(family, transformer))


# the transformer config's count of the blocks the routes index (the ModuleList a layout's `blocks` returns)
BLOCK_COUNT_KEY = {"lumina2": "num_layers", "kandinsky5-image": "num_visual_blocks",
                   "kandinsky5-video": "num_visual_blocks"}


def blocks_before_load(cfg: Any, build_tiny: bool = True) -> int | None:
    """The count of the blocks the routes (and CREPA's block indexes) index, from the transformer's config.json (a
    local folder's, the flavour's real architecture, or a tiny flavour's, built here if need be: `difftune check` on
    the tiny stand-in said OK to a route its 2 blocks do not have, and training refused it after loading), before any
    model loads; None when it is known only once the model loads (another hub model than the flavour's; an unknown
    architecture; a tiny flavour not to be built here: `build_tiny` false, several processes, where one builds it)."""
    if not build_tiny and cfg.flavour().startswith("tiny") and not cfg.pretrained_model_name_or_path:
        return None
    from difftune.memory_plan.architecture import architecture_of
    from difftune.models.registry import FAMILY_FACTS

    try:
        arch = architecture_of(cfg)
    except (ValueError, OSError):
        return None
    official = FAMILY_FACTS[cfg.model_family].flavours.get(cfg.flavour())
    if arch.known and (cfg.pretrained_model_name_or_path not in (None, official)
                       or cfg.pretrained_transformer_model_name_or_path is not None):
        return None  # another hub model than the flavour's: its depth is known once it loads
    blocks = arch.config.get(BLOCK_COUNT_KEY.get(cfg.model_family, ""))
    return blocks if isinstance(blocks, int) and blocks > 0 else None


def check_before_load(cfg: Any, build_tiny: bool = True) -> None:
    """The routes against `blocks_before_load`: `difftune check` said OK to a route past the last block, and a run
    found it only after loading the model."""
    if cfg.tread_config is None:
        return
    blocks = blocks_before_load(cfg, build_tiny)
    if blocks is not None:
        try:
            resolve_routes(cfg.tread_config.routes, blocks)
        except TreadError as e:
            if not cfg.flavour().startswith("tiny"):
                raise
            raise TreadError(f"{e}; model_flavour {cfg.flavour()!r} is a tiny stand-in of {blocks} blocks: give a dry "
                             "run routes inside them (negative indices count from the end)") from e


class Router:
    """The hooks on one model. A plan lives from one call of the model to the next."""

    def __init__(self, layout: Any, routes: list[Route], generator: torch.Generator, protect_first_frame: bool):
        self.layout, self.routes, self.generator = layout, routes, generator
        self.protect_first_frame = protect_first_frame
        self.plans: dict[int, Plan] = {}
        self.handles: list[Any] = []
        self.window: tuple[int, int] | None = None  # (global batch, offset) of the next call: set by loop.micro_step

    def attach(self, transformer: Any) -> Router:
        self.handles.append(transformer.register_forward_pre_hook(self._on_call, with_kwargs=True))
        blocks = self.layout.blocks(transformer)
        for r, route in enumerate(self.routes):
            for index in range(route.start, route.end + 1):
                self.handles.append(blocks[index].register_forward_pre_hook(self._before(r, index == route.start)))
            self.handles.append(blocks[route.end].register_forward_hook(self._after(r)))
        return self

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.plans = {}

    def _on_call(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        self.plans = {}
        if not (module.training and torch.is_grad_enabled()):
            return  # validation, sampling and no-grad rollouts see every token
        for r, route in enumerate(self.routes):
            plan = self.layout.plan(module, kwargs, route.ratio, self.generator, self.protect_first_frame,
                                    self.window)
            if plan is not None:
                self.plans[r] = plan

    def _before(self, r: int, first: bool) -> Any:
        def hook(module: Any, args: tuple) -> tuple | None:
            plan = self.plans.get(r)
            if plan is None:
                return None
            args = list(args)
            if first:  # (again when gradient checkpointing recomputes the block: the same plan, the same values)
                plan.full = args[0]
                args[0] = plan.take(args[0])
                plan.extras = {i: plan.take(args[i]) for i in self.layout.token_args}
            for i, value in (plan.extras or {}).items():
                args[i] = value
            return tuple(args)

        return hook

    def _after(self, r: int) -> Any:
        def hook(module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            plan = self.plans.get(r)
            if plan is None:
                return None
            return plan.put(plan.full, output)

        return hook


def attach(tread_config: Any, family: Any, transformer: Any, generator: torch.Generator,
           protect_first_frame: bool) -> Router | None:
    """Hook TREAD onto `transformer` (the unwrapped model); None without tread_config."""
    routes = check(tread_config, family, transformer)
    if not routes:
        return None
    return Router(LAYOUTS[family.tread_layout], routes, generator, protect_first_frame).attach(transformer)
