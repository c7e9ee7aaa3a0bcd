"""Typed sub-objects and choices of the experimental training keys: `tread_config` (train/tread.py) and
scheduled sampling (train/rollout.py). Import-light, like the rest of config/."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Rollout samplers of the spec; only 'euler' is implemented (TrainConfig refuses the others while rollouts are on).
ROLLOUT_SAMPLERS = ("euler", "unipc", "dpm", "rk4", "heun")


class TreadRoute(BaseModel):
    """One span of blocks that a share of the image/video tokens skips."""

    model_config = ConfigDict(extra="forbid")

    selection_ratio: float = Field(
        ..., ge=0.0, lt=1.0, description="Share of the image/video tokens that skip the route's blocks (0.5: half).",
    )
    start_layer_idx: int = Field(
        ..., description="First block of the route (0-based; negative counts from the end, -1 is the last block).",
    )
    end_layer_idx: int = Field(
        ..., description="Last block of the route, included (negative counts from the end); the routed tokens "
        "rejoin after it.",
    )


class TreadConfig(BaseModel):
    """TREAD token routing: routes of blocks that part of the tokens skip during training."""

    model_config = ConfigDict(extra="forbid")

    routes: list[TreadRoute] = Field(
        ..., min_length=1, description="The routes, as a JSON list such as "
        '[{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]; they must not share a block.',
    )

    @model_validator(mode="after")
    def _routes_apart(self) -> TreadConfig:
        """What can be told without the model's block count (train/tread.py checks the rest once it loads): indices
        of one sign, counted from the same end, in order and not shared."""
        spans = []
        for i, r in enumerate(self.routes):
            start, end = r.start_layer_idx, r.end_layer_idx
            if (start < 0) == (end < 0) and start > end:
                raise ValueError(f"routes[{i}]: start_layer_idx {start} comes after end_layer_idx {end}")
            if (start < 0) == (end < 0):
                spans.append((start, end, i))
        for sign in (False, True):
            ordered = sorted(s for s in spans if (s[0] < 0) == sign)
            for (_, a_end, i), (b_start, _, j) in zip(ordered, ordered[1:], strict=False):
                if b_start <= a_end:
                    first, second = sorted((i, j))
                    raise ValueError(f"routes[{first}] and routes[{second}] overlap (blocks "
                                     f"{self.routes[first].start_layer_idx} to {self.routes[first].end_layer_idx} and "
                                     f"{self.routes[second].start_layer_idx} to {self.routes[second].end_layer_idx}); "
                                     "routes must not share a block")
        return self


def tread_from_text(value: Any) -> Any:
    """`--tread_config '{"routes": [...]}'` on the command line arrives as text: its JSON value."""
    if not isinstance(value, str):
        return value
    if value.strip().lower() in ("", "null", "none"):
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"tread_config is not valid JSON ({e.msg}); write it as "
                         '{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}') from e
