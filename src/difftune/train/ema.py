"""Exponential moving average (EMA) of the trainable parameters: `EMA(params, decay, ...)`.

Built on diffusers' `EMAModel` (diffusers.training_utils), which it keeps as `EMA.ema`: the decay
schedule (`get_decay`: `decay`, `min_decay`, `update_after_step`, `use_ema_warmup`, `inv_gamma`,
`power`), the checkpoint format (`state_dict`, so a diffusers `EMAModel` can load ours), `copy_to`, and
`store`/`restore` for swapping weights all come from it. Its `step()` is not used, for three reasons:

- it computes `shadow - param` directly, so a shadow copy on the CPU with parameters on an accelerator
  fails with a device mismatch. Here each chunk of parameters is copied to the shadow's device first,
  at most `chunk_bytes` at a time, so the extra memory stays bounded.
- it has no update interval: here `step(global_step)` updates only when `global_step` is a multiple of
  `update_interval`.
- it keeps the shadow in the parameters' dtype. Here it is fp32 by default: with decay 0.999, a bf16
  shadow would lose the small `(1 - decay) * (param - shadow)` increments, the same problem that
  `adamw_bf16` solves for the weights.

The update is `shadow += (1 - d) * (param - shadow)` (a `torch._foreach_lerp_`), with `d` from
`EMAModel.get_decay(n)`, where `n` counts EMA updates, not optimizer steps. As in diffusers, the first
update (and every update within the first `update_after_step` updates) copies the parameters
(`d = 0`). After that, `d` is the constant `decay` by default (`min_decay=None` means `min_decay =
decay`). Pass `min_decay=0.0` for diffusers' default ramp `min(decay, (1 + n) / (10 + n))`, or
`use_ema_warmup=True` for `1 - (1 + n / inv_gamma) ** -power`, capped to [min_decay, decay].
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from diffusers.training_utils import EMAModel

EMADevice = Literal["cpu", "accelerator"]
_HYPER = ("decay", "min_decay", "update_after_step", "use_ema_warmup", "inv_gamma", "power", "update_interval")
CONFIG_KEYS = {"decay": "ema_decay", "update_interval": "ema_update_interval"}  # the settings difftune's keys set


class EMA:
    """EMA of `params`, kept on the CPU (`device="cpu"`) or beside each parameter (`"accelerator"`).

    Call `step(global_step)` after each optimizer step; use `with ema.swap():` to validate or save with
    the EMA weights; save `state_dict()` in checkpoints and `load_state_dict()` it on resume.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        decay: float,
        update_interval: int = 1,
        device: EMADevice = "accelerator",
        *,
        min_decay: float | None = None,
        update_after_step: int = 0,
        use_ema_warmup: bool = False,
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
        dtype: torch.dtype | None = torch.float32,
        chunk_bytes: int = 256 * 2**20,
    ):
        self.params = list(params)
        if not self.params:
            raise ValueError("EMA: no parameters to average")
        if not all(p.is_floating_point() for p in self.params):
            raise ValueError("EMA: every parameter must be floating point")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be between 0 and 1, got {decay}")
        if update_interval < 1:
            raise ValueError(f"EMA update_interval must be at least 1, got {update_interval}")
        if device not in ("cpu", "accelerator"):
            raise ValueError(f"EMA device must be 'cpu' or 'accelerator', got {device!r}")
        self.update_interval = int(update_interval)
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.changed: str | None = None  # after load_state_dict: the settings that differ from the checkpoint's
        min_decay = float(decay if min_decay is None else min_decay)
        # An empty EMAModel (its constructor would clone every parameter on its own device first: a
        # transient copy in accelerator memory); the shadow tensors are made here, where they belong.
        self.ema = EMAModel([], decay=float(decay), min_decay=min_decay, update_after_step=int(update_after_step),
                            use_ema_warmup=use_ema_warmup, inv_gamma=inv_gamma, power=power, foreach=False)
        with torch.no_grad():
            self.ema.shadow_params = [
                p.detach().to(device=self._home(p), dtype=dtype or p.dtype, copy=True) for p in self.params
            ]

    # --- the shadow copy
    @property
    def shadow_params(self) -> list[torch.Tensor]:
        return self.ema.shadow_params

    @property
    def num_updates(self) -> int:
        """EMA updates made so far (diffusers' `optimization_step`)."""
        return self.ema.optimization_step

    @property
    def last_decay(self) -> float | None:
        """The decay used by the latest update (None before the first)."""
        return self.ema.cur_decay_value

    def _home(self, p: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.device == "cpu" else p.device

    def _follow_params(self) -> None:
        """In accelerator mode the shadow follows its parameter (for example after accelerate moves it)."""
        if self.device == "accelerator":
            shadow = self.ema.shadow_params
            for i, (s, p) in enumerate(zip(shadow, self.params, strict=True)):
                if s.device != p.device:
                    shadow[i] = s.to(p.device)

    def _chunks(self) -> Iterator[list[int]]:
        """Indices of parameters, grouped so a chunk copied to the shadow's device stays small."""
        chunk: list[int] = []
        size = 0
        for i, (s, p) in enumerate(zip(self.ema.shadow_params, self.params, strict=True)):
            moved = s.device != p.device or s.dtype != p.dtype
            nbytes = s.numel() * s.element_size() if moved else 0
            if chunk and size + nbytes > self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(i)
            size += nbytes
        if chunk:
            yield chunk

    # --- updates
    def step(self, global_step: int) -> bool:
        """Call after optimizer step `global_step` (1, 2, ...); updates when it is a multiple of
        update_interval. Returns whether it updated."""
        if global_step % self.update_interval:
            return False
        self.ema.optimization_step += 1
        decay = self.ema.get_decay(self.ema.optimization_step)
        self.ema.cur_decay_value = decay
        self._update(1.0 - decay)
        return True

    @torch.no_grad()
    def _update(self, weight: float) -> None:
        self._follow_params()
        shadow = self.ema.shadow_params
        for chunk in self._chunks():
            targets = [shadow[i] for i in chunk]
            sources = [self.params[i].detach().to(device=shadow[i].device, dtype=shadow[i].dtype) for i in chunk]
            if weight == 1.0:
                torch._foreach_copy_(targets, sources)
            elif weight != 0.0:
                torch._foreach_lerp_(targets, sources, weight)

    def copy_to(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Write the EMA weights into `params` (default: the averaged parameters), cast to their dtype."""
        with torch.no_grad():
            self.ema.copy_to(self.params if params is None else params)

    @contextmanager
    def swap(self) -> Iterator[None]:
        """Put the EMA weights into the live parameters for the duration of the block, then restore the
        live weights exactly (they are kept on the CPU meanwhile)."""
        if self.ema.temp_stored_params is not None:
            raise RuntimeError("EMA.swap() is already active; it cannot be nested")
        # store/copy_to/restore write through `.data`: no autograd history, whatever the grad mode.
        self.ema.store(self.params)
        try:
            self.ema.copy_to(self.params)
            yield
        finally:
            self.ema.restore(self.params)

    # --- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """diffusers' EMAModel state (shadow tensors by reference, as torch's state_dicts do) plus
        `update_interval`."""
        state = self.ema.state_dict()
        state["shadow_params"] = list(state["shadow_params"])
        state["update_interval"] = self.update_interval
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the shadow tensors and the update count. The schedule settings given to the
        constructor (the current config) stay in force; `changed` then names any that differ from the saved
        ones (the checkpoint loader puts it in the event log), since the run no longer repeats the saved one."""
        saved = state.get("shadow_params")
        if not isinstance(saved, list) or not all(isinstance(t, torch.Tensor) for t in saved):
            raise ValueError("EMA state has no list of shadow tensors")
        shadow = self.ema.shadow_params
        shapes = [tuple(t.shape) for t in saved]
        if shapes != [tuple(s.shape) for s in shadow]:
            raise ValueError(
                f"EMA state does not match these parameters ({len(saved)} tensors saved, {len(shadow)} here, "
                "or different shapes); was the adapter or model changed?"
            )
        count = state.get("optimization_step")
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"EMA state has an invalid optimization_step: {count!r}")
        changed = [k for k in _HYPER if k in state and state[k] != self._hyper(k)]
        # by the config keys that set them (min_decay follows ema_decay: it is not its own key)
        named = {CONFIG_KEYS.get(k, k): (state[k], self._hyper(k)) for k in changed if k != "min_decay"}
        self.changed = ("EMA settings differ from the checkpoint's: "
                        + ", ".join(f"{k} {old!r} then, {new!r} now" for k, (old, new) in named.items())
                        + "; the EMA goes on with this run's") if named else None
        with torch.no_grad():
            for s, t in zip(shadow, saved, strict=True):
                s.copy_(t)
        self.ema.optimization_step = count
        self.ema.cur_decay_value = self.ema.get_decay(count) if count else None

    def _hyper(self, key: str) -> Any:
        return self.update_interval if key == "update_interval" else getattr(self.ema, key)
