"""Frame counts of training clips as pure functions (no I/O, no torch): resampling to a frame rate, the
frame counts the video VAE accepts, and the frame part of a bucket.

The video VAE compresses time 4x causally: a clip of 4k+1 frames becomes k+1 latent frames. Every
count chosen here is of that form, so no frame is silently dropped by the VAE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TEMPORAL = 4  # the HunyuanVideo VAE's temporal compression
SLACK = 0.002  # seconds: containers round timestamps (Matroska to 1 ms), so spans come out a little short


@dataclass(frozen=True)
class FrameRule:
    num_frames: int
    frame_rate: float
    bucket_strategy: str = "aspect_ratio"  # or "resolution_frames"
    min_frames: int | None = None
    max_frames: int | None = None
    frame_interval: int = 4


def resampled_count(frames: int, span: float, source_fps: float, target_fps: float, variable: bool = False) -> int:
    """Frames a clip has at `target_fps`: one per 1/target_fps seconds while it plays, repeating or skipping source
    frames. It plays from its first frame's timestamp to the last one's (`span`) and, at a constant rate, for the
    last frame's own duration after it, the average gap (video.decode_frames shows it that long: 12 frames at 12 fps
    are 24 at 24 fps, not 23); a variable-rate clip is counted to its last timestamp only (its last frame's duration
    is unknown here). A clip at the target rate keeps its count (not a variable-rate one whose average is near it:
    its frames are taken by time, at the target rate)."""
    if frames <= 1 or span <= 0:
        return min(frames, 1)
    if same_rate(source_fps, target_fps) and not variable:
        return frames
    through_last = int(math.floor((span + SLACK) * target_fps)) + 1
    if variable:
        return through_last
    end = span + span / (frames - 1)  # times before the end of the last frame's duration, a little margin kept
    return max(through_last, math.ceil((end - SLACK) * target_fps))


def same_rate(source_fps: float, target_fps: float) -> bool:
    """Rates within 0.5%: a clip's average rate measured from rounded timestamps is rarely exact."""
    return abs(source_fps / target_fps - 1.0) < 0.005


def frame_times(count: int, fps: float) -> list[float]:
    """Seconds (from the clip's first frame) of the frames a sample trains on."""
    return [k / fps for k in range(count)]


def vae_frames(n: int, interval: int = TEMPORAL) -> int:
    """The largest count <= n of the form 1 + a multiple of lcm(4, interval); 0 when n < 1."""
    step = math.lcm(TEMPORAL, interval)
    return 0 if n < 1 else (n - 1) // step * step + 1


@dataclass(frozen=True)
class ClipPlan:
    frames: int | None  # frames the clip trains on; None: left out
    problem: str | None = None  # why it was left out
    note: str | None = None  # used, but worth telling the user


def plan_clip(available: int, source_fps: float, rule: FrameRule) -> ClipPlan:
    """How many frames of a clip with `available` frames (at the rule's frame rate) train, or why none."""
    at = f"{available} frame(s) at {rule.frame_rate:g} fps"
    resampled = available > 1 and source_fps > 0 and not same_rate(source_fps, rule.frame_rate)  # a still has no rate
    note = f"resampled from {source_fps:.3g} to {rule.frame_rate:g} fps" if resampled else None
    if rule.min_frames is not None and available < rule.min_frames:
        return ClipPlan(None, f"{at}, below min_frames {rule.min_frames}")
    if rule.max_frames is not None and available > rule.max_frames:
        return ClipPlan(None, f"{at}, above max_frames {rule.max_frames}")
    if rule.bucket_strategy == "aspect_ratio":
        if available < rule.num_frames:
            return ClipPlan(None, f"{at}, shorter than num_frames {rule.num_frames}; lower num_frames or use "
                                  "bucket_strategy 'resolution_frames' to train on shorter clips")
        if available > rule.num_frames:
            trimmed = f"trimmed to the first {rule.num_frames} of {available} frames"
            note = f"{note}; {trimmed}" if note else trimmed
        return ClipPlan(rule.num_frames, None, note)
    frames = vae_frames(min(available, rule.num_frames), rule.frame_interval)
    if frames < 1:
        return ClipPlan(None, f"{at}: no frame count of the form 1 + k*{math.lcm(TEMPORAL, rule.frame_interval)} fits")
    if rule.min_frames is not None and frames < rule.min_frames:
        return ClipPlan(None, f"{at} round down to {frames} (frame_interval {rule.frame_interval}), below "
                              f"min_frames {rule.min_frames}")
    if frames < available:
        why = [f"num_frames {rule.num_frames}"] if available > rule.num_frames else []
        if frames < min(available, rule.num_frames):
            why.append(f"frame_interval {rule.frame_interval}" if rule.frame_interval != TEMPORAL else "4k+1")
        trimmed = f"trimmed to the first {frames} of {available} frames ({', '.join(why)})"
        note = f"{note}; {trimmed}" if note else trimmed
    return ClipPlan(frames, None, note)


def bucket_name(width: int, height: int, frames: int = 0) -> str:
    """'WxH' for images, 'WxH@F' for clips."""
    return f"{width}x{height}@{frames}" if frames else f"{width}x{height}"
