"""The console output of `difftune plan`: one table per phase, the peak, and the levers chosen (rich)."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from difftune.memory_plan.levers import Choice
from difftune.memory_plan.predict import GIB, Prediction


def gib(n: float) -> str:
    """GiB with 2 decimals; below 0.1 GiB in MiB (tiny models, small parts)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= 0.1 * GIB else f"{n / 2**20:.1f} MiB"


def phase_tables(prediction: Prediction, title: str) -> list[Table]:
    tables = []
    for phase in prediction.phases:
        table = Table(title=f"{title}: {phase.name}", title_justify="left", show_footer=True)
        table.add_column("part", footer="total")
        table.add_column("memory", justify="right", footer=gib(phase.total))
        table.add_column("how", style="dim")
        for line in phase.lines:
            table.add_row(line.label, gib(line.bytes), line.note)
        tables.append(table)
    return tables


def render(prediction: Prediction, choice: Choice | None, console: Console | None = None) -> None:
    console = console or Console(highlight=False)
    for table in phase_tables(prediction, "predicted"):
        console.print(table)
    for note in prediction.notes:
        console.print(f"note: {note}")
    per = f" per process ({prediction.processes} processes)" if prediction.processes > 1 else ""
    console.print(f"predicted peak{per}: {gib(prediction.peak)} ({prediction.peak_phase})")
    if choice is None:
        return
    if not choice.fits:
        console.print(f"[bold red]{choice.message}[/]")
        if choice.frugal:  # what that lowest peak was predicted with
            console.print("the most frugal settings tried:")
            console.print(json.dumps(choice.frugal, indent=2), markup=False)
        return
    kept = (f", keeping {choice.reserve:g} GiB free for the CUDA context and fragmentation (not predicted)"
            if choice.reserve else "")
    if not choice.steps:
        console.print(f"[green]fits in {choice.gigabytes:g} GiB as it is{kept}: no lever needed[/]")
        return
    table = Table(title=f"levers for {choice.gigabytes:g} GiB, cheapest first", title_justify="left")
    table.add_column("key")
    table.add_column("value")
    table.add_column("saves", justify="right")
    table.add_column("cost")
    for step in choice.steps:
        table.add_row(step.key, json.dumps(step.value), gib(step.saving) + step.where(), step.why)
    console.print(table)
    assert choice.after is not None
    console.print(f"[green]with these: predicted peak {gib(choice.after.peak)} ({choice.after.peak_phase}), "
                  f"fits in {choice.gigabytes:g} GiB{kept}[/]")
    console.print("paste into config.json:")
    console.print(json.dumps(choice.settings(), indent=2), markup=False)


def as_json(prediction: Prediction, choice: Choice | None) -> dict[str, Any]:
    """The same in plain data (the web UI's answer)."""
    out: dict[str, Any] = {
        "peak_bytes": prediction.peak, "peak_phase": prediction.peak_phase, "notes": prediction.notes,
        "phases": [{"name": p.name, "total_bytes": p.total,
                    "lines": [{"label": li.label, "bytes": li.bytes, "note": li.note} for li in p.lines]}
                   for p in prediction.phases],
    }
    if choice is not None:
        out["choice"] = {"fits": choice.fits, "gigabytes": choice.gigabytes, "reserve_gigabytes": choice.reserve,
                         "message": choice.message,
                         "settings": choice.settings(), "frugal": choice.frugal,
                         "steps": [{"key": s.key, "value": s.value, "saving_bytes": s.saving, "cost": s.why,
                                    "phase": s.phase}
                                   for s in choice.steps],
                         "peak_bytes_after": choice.after.peak if choice.after else None}
    return out
