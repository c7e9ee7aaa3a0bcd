"""The outputs of chosen image/video blocks in the transformer's last training call: what CREPA (train/crepa.py) and
LayerSync (train/layersync.py) align.

Hooked from outside diffusers' classes: a forward pre-hook on the transformer arms the taps only while training with
gradients on (validation, sampling, the no-grad rollouts and the regularisation targets never capture); a forward
hook on each tapped block (`tread.LAYOUTS`: Lumina2's joint `layers`, Kandinsky 5's visual blocks) keeps its first
output of the call, so gradient checkpointing's recomputation captures nothing again. A detached tap is a frozen
target: no gradient reaches its block through the alignment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any

import torch

from difftune.train.tread import LAYOUTS, resolve_routes


def check_indexes(cfg: Any, indexes: Mapping[str, int], count: int, error: type[Exception],
                  shown: Mapping[str, int] | None = None, first: int = 0) -> None:
    """Each tapped block (`indexes`: key -> 0-based index) against a model of `count` blocks and TREAD's routes there
    (resolved as TREAD does): a block inside a route sees only the tokens TREAD kept. `shown`: the values as the
    user wrote them, and `first` the number of the first block, where the key counts otherwise (LayerSync: from 1)."""
    shown = shown or indexes
    routes = [(r.start, r.end) for r in resolve_routes(getattr(cfg.tread_config, "routes", None) or [], count)]
    for key, index in indexes.items():
        if index >= count:
            raise error(f"{key} {shown[key]} is out of range: this model has {count} image/video blocks ({first} to "
                        f"{count - 1 + first})")
        for start, end in routes:
            if start <= index <= end:
                raise error(f"{key} {shown[key]} lies inside the TREAD route of blocks {start}-{end} (counted from 0), "
                            "whose blocks see only part of the tokens; choose a block outside the route")


def token_grid(x0: torch.Tensor, patch: tuple[int, int]) -> tuple[int, int, int]:
    """(latent frames, token rows, token columns) of a batch of latents [B, C, h, w] or [B, C, T, h, w]."""
    frames = x0.shape[2] if x0.dim() == 5 else 1
    return frames, x0.shape[-2] // patch[0], x0.shape[-1] // patch[1]


def spatial_patch(transformer: torch.nn.Module) -> tuple[int, int]:
    patch = transformer.config.patch_size
    return (patch, patch) if isinstance(patch, int) else tuple(patch[-2:])


class Taps:
    def __init__(self, transformer: torch.nn.Module, layout: str, indexes: Iterable[int], detached: Iterable[int] = ()):
        self.joint = layout == "joint"  # Lumina2: sample i's image tokens follow its caption tokens
        self.indexes, self.detached = set(indexes), set(detached)
        self.armed: set[int] = set()
        self.outputs: dict[int, torch.Tensor] = {}
        self.captions: list[int] | None = None
        blocks = LAYOUTS[layout].blocks(transformer)
        self.handles = [transformer.register_forward_pre_hook(self._on_call, with_kwargs=True)]
        self.handles += [blocks[i].register_forward_hook(partial(self._on_block, i)) for i in sorted(self.indexes)]

    def _on_call(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        on = module.training and torch.is_grad_enabled()
        self.armed = set(self.indexes) if on else set()
        self.outputs = {}
        if on and self.joint:
            self.captions = kwargs["encoder_attention_mask"].sum(dim=1).tolist()

    def _on_block(self, index: int, module: Any, args: tuple, output: Any) -> None:
        if index in self.armed:
            hidden = output[0] if isinstance(output, tuple) else output
            self.outputs[index] = hidden.detach() if index in self.detached else hidden
            self.armed.discard(index)

    def output(self, index: int) -> torch.Tensor | None:
        return self.outputs.get(index)

    def tokens(self, index: int, grid: tuple[int, int, int], what: str) -> torch.Tensor:
        """Block `index`'s image/video tokens of the last training call as [B, T, h*w, hidden]; `what` names the
        block in the error raised when it did not run."""
        hidden = self.outputs.get(index)
        if hidden is None:
            raise RuntimeError(f"{what} did not run in this training step")
        t, h, w = grid
        if self.joint:
            hidden = torch.stack([hidden[i, c : c + h * w] for i, c in enumerate(self.captions or [])])
        return hidden.reshape(hidden.shape[0], t, h * w, hidden.shape[-1])

    def clear(self) -> None:
        self.outputs = {}
