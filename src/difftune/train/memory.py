"""Peak memory at the phases of a run, as one "memory" event each: after the model loads (and is
quantized), after the caches are filled, after the first optimizer step, and over the first validation (the
counter reset before it: `difftune plan` predicts that phase too).

On CUDA, `cuda_peak_bytes` is `torch.cuda.max_memory_allocated` since the previous phase (the counter is
reset after each line); `rss_peak_bytes` is the process's peak resident memory so far (getrusage
ru_maxrss, which never goes down), on every device.
"""

from __future__ import annotations

import sys

import torch

from difftune.train.events import Events


def peak_rss_bytes() -> int:
    import resource  # POSIX only

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def record_peak_memory(events: Events, phase: str, device: torch.device) -> None:
    """One "memory" event for `phase` with the peaks in bytes (see the module docstring)."""
    try:
        fields: dict[str, int] = {"rss_peak_bytes": peak_rss_bytes()}
    except ImportError:  # Windows has no resource module
        fields = {}
    if device.type == "cuda":
        fields["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    shown = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {v / 2**30:.2f} GiB" for k, v in fields.items())
    events.emit("memory", phase=phase, device=str(device), message=f"memory after {phase}: {shown or 'unknown'}",
                **fields)


def reset_peak_memory(device: torch.device) -> None:
    """Start a phase's CUDA peak from here (the first validation's, apart from the steps before it)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
