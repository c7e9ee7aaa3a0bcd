"""The wizard's looks at the dataset's files (`difftune configure`): their sizes and the clips' lengths, read from a
few headers, so that the resolution and num_frames it offers keep the files. A mixin of `ui.wizard.Wizard`, whose
config, entry and questions it uses."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from difftune.data.buckets import measure
from difftune.data.discovery import NOTE_UPSCALE
from difftune.data.frames import resampled_count
from difftune.models.registry import FAMILY_FACTS

VIDEO_RESOLUTION = 512  # the resolution offered for clips
PROBE_CAP = 32  # files probed for their size or length (a header read or a demux each, no decoding)


class DataProbes:
    config: dict[str, Any]
    image_specs: dict[str, Any]
    sizes: list[tuple[int, int]]

    def say(self, text: str = "") -> None: ...

    def image_entry(self) -> dict[str, Any]: ...

    def shortest_clip(self, files: list[Path]) -> tuple[int, int, float] | None:
        """(frames, clips probed, fps) of the shortest of the first clips, counted at the frame rate training
        resamples them to (as discovery does); None when none could be read (the review says why)."""
        from difftune.data.video import BadVideo, probe_video

        entry_video = self.image_entry().get("video")
        fps = entry_video.get("frame_rate") if isinstance(entry_video, dict) else None
        fps = fps or self.config.get("frame_rate") or FAMILY_FACTS[self.config["model_family"]].default_frame_rate
        if not isinstance(fps, int | float) or fps <= 0:
            return None  # the review names the bad frame_rate
        counts = []
        for path in files[:PROBE_CAP]:
            try:
                info = probe_video(path)
            except (BadVideo, OSError):
                continue
            counts.append(resampled_count(info.frames, info.span, info.fps, fps, info.variable_rate))
        return (min(counts), len(counts), float(fps)) if counts else None

    @staticmethod
    def probe_sizes(files: list[Path], video: bool) -> list[tuple[int, int]]:
        """(width, height) as displayed of the first files (a header read each), for the resolution offered."""
        from difftune.data.images import BadImage, probe_size
        from difftune.data.video import BadVideo, probe_video

        sizes = []
        for path in files[:PROBE_CAP]:
            try:
                sizes.append((lambda i: (i.width, i.height))(probe_video(path)) if video else probe_size(path))
            except (BadImage, BadVideo, OSError):
                continue
        return sizes

    def resolution_offer(self, entry: dict[str, Any]) -> float | None:
        """A resolution that fits the files probed, offered where the default would enlarge most of them more than
        discovery's note threshold (the wizard's default, 1024, would leave 96x64 clips out altogether), said with
        why; for clips at most VIDEO_RESOLUTION (offered as it is where they fit it); None where the default fits
        or the entry sets its own."""
        if "resolution" in entry:
            return None
        kind = entry.get("resolution_type", self.image_specs["resolution_type"]["default"])
        # clips: 512 (the specs' video examples; at 1024 a clip's activations need far more memory than an image's)
        video = entry.get("dataset_type") == "video" and kind != "area"
        default = VIDEO_RESOLUTION if video else self.image_specs["resolution"]["default"]
        if kind not in ("pixel", "pixel_area", "area") or not isinstance(default, int | float) or not self.sizes:
            return VIDEO_RESOLUTION if video else None
        sizes = sorted(measure(w, h, kind) for w, h in self.sizes)
        median = sizes[len(sizes) // 2]
        scale = math.sqrt(default / median) if kind == "area" else default / median  # linear enlargement
        if scale <= NOTE_UPSCALE:
            return VIDEO_RESOLUTION if video else None
        step = 64 if median >= 64 else 16
        offer = round(median, 2) if kind == "area" else max(16, int(median // step) * step)
        self.say(f"\n  the median of {len(sizes)} file(s) probed is {median:.3g} in {kind} units: resolution {offer:g} "
                 f"fits them ({'the clips' if video else 'the'} default {default:g} would enlarge it {scale:.1f}x)")
        return offer

