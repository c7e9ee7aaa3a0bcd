"""torch.compile of the transformer (`compile`, `dynamo_backend`, `dynamo_*`; the keys and their checks are in
config/speed_keys.py). One call in `setup.build_run`, after the adapter, block streaming, TREAD and CREPA are
attached and before `accelerator.prepare`.

What is compiled is each module's `forward`, replaced in place on the instance by a compiled one, and not its
`__call__` (`nn.Module.compile` would compile `_call_impl`, hooks included):
- Module names, parameters and state_dict keys do not change, so adapters, checkpoints, EMA and resume are
  unaffected (there is no `_orig_mod.` wrapper).
- The blocks' hooks stay outside the compiled code and run in Python as before: block streaming's weight moves
  (train/offload.py), TREAD's token gathering (train/tread.py), CREPA's capture (train/crepa.py), FSDP2's
  all-gathers (train/fsdp.py). Traced inside (measured with `nn.Module.compile`), block streaming's storage
  lookups break the graph, an error with dynamo_fullgraph. peft's LoRA layers and LyCORIS's wrapped forwards are
  inside the block and compiled with it; so are quantized weights (optimum-quanto, torchao, bitsandbytes NF4).
- Gradient checkpointing calls the block (`checkpointing.enable_checkpointing`), which runs its compiled forward,
  and again in the backward pass: the same graph, no recompilation.

Regions. Regional compilation (the default) makes one `torch.compile` of the block class's `forward` per block
stack of the family (`FamilyFacts.block_stacks`: Lumina2's context_refiner, noise_refiner and layers; Kandinsky 5's
text and visual blocks), shared by every block of that stack: a stack's blocks have the same code and
attributes, so one compilation serves all of them, and each stack counts its compilations separately
(`isolate_recompiles`). Whole-model compilation (`dynamo_use_regional_compilation: false`) is one region: the
transformer's own forward, its blocks' hooks traced inside it. Under gradient checkpointing torch.compile traces
the blocks without their hooks (TREAD then routed no token, silently), so speed_keys refuses whole-model
compilation with TREAD and checkpointing, CREPA, FSDP2 and block streaming.

Shapes. Every region is compiled again for what its guards do not cover: another shape (a bucket, a caption
length), gradients on or off (training, or validation sampling, whose classifier-free guidance doubles the batch),
another dtype. `dynamo_dynamic` is torch.compile's `dynamic`: None (unset) is torch's automatic dynamic shapes (the
first shape is compiled static; when a size changes, the region is compiled again with the sizes that changed
symbolic, and that graph serves later sizes), True is symbolic from the start, False is one static graph per
shape. `dynamo_recompile_limit` is torch.compile's `recompile_limit`, per region: after that many compilations,
inputs no compiled graph accepts run the region uncompiled (eager: the same results, slower); one "warning" event
says so (torch's own log line is caught). With dynamo_fullgraph that is an error instead, as torch makes it.

Errors. A compilation runs at the first call of a region with a new shape, i.e. inside a training step.
A compiler failure there (dynamo, inductor, a C++ compiler) is raised as `CompileError` naming dynamo_backend and
how to turn compilation off. The backward graph is compiled with the forward
(`force_non_lazy_backward_lowering`), so its failure is caught here too rather than in `loss.backward()`.
"""

from __future__ import annotations

import inspect
import logging
import re
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo.exc
import torch._functorch.config

from difftune.models.hub import ComponentError

LIMIT_MESSAGE = "torch._dynamo hit config."  # the start of torch's warning when a region reaches its limit


class CompileError(ComponentError):
    """torch.compile failed (exit code 2 with the message, like a component error)."""


@dataclass
class Region:
    name: str  # the block stack ("layers"), or "transformer" for whole-model compilation
    modules: list[torch.nn.Module]


@dataclass
class Compiled:
    backend: str
    mode: str
    regional: bool
    regions: list[Region] = field(default_factory=list)

    def blocks(self) -> int:
        return sum(len(r.modules) for r in self.regions) if self.regional else 0


def regions(stacks: tuple[str, ...], transformer: torch.nn.Module, regional: bool) -> list[Region]:
    """The regions to compile: one per block stack (split by class, should a stack mix them), or the model."""
    if not regional:
        return [Region("transformer", [transformer])]
    if not stacks:
        raise CompileError("this model family names no block stacks to compile one by one; set "
                           "dynamo_use_regional_compilation: false to compile the whole transformer")
    out = []
    for name in stacks:
        by_class: dict[type, list[torch.nn.Module]] = {}
        for block in getattr(transformer, name):
            by_class.setdefault(type(block), []).append(block)
        for cls, blocks in by_class.items():
            out.append(Region(name if len(by_class) == 1 else f"{name} ({cls.__name__})", blocks))
    return out


def recompile_limit(limit: int, compiled: list[Region]) -> dict[str, Any]:
    """torch.compile's options for `limit` compilations per region. torch 2.13 counts them per torch.compile call
    (`isolate_recompiles`). Older torch (2.11, the GPU images' torch) has only dynamo's global limit, counted per
    code object: regions whose blocks share a class (Lumina2's refiners and layers) share one count, so the global
    limit is raised to `limit` times the most regions sharing one, and never lowered."""
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return dict(recompile_limit=limit, isolate_recompiles=True)
    sharing = Counter(type(r.modules[0]).forward for r in compiled)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, limit * max(sharing.values(), default=1))
    return {}


def compile_transformer(cfg: Any, stacks: tuple[str, ...], transformer: torch.nn.Module,
                        emit: Callable[..., Any]) -> Compiled | None:
    """Compile the transformer's block stacks (or the whole transformer) in place, as the config asks; None
    when compilation is off."""
    backend = cfg.compile_backend()
    if backend is None:
        return None
    compiled = Compiled(backend, cfg.dynamo_mode or "default", cfg.dynamo_use_regional_compilation,
                        regions(stacks, transformer, cfg.dynamo_use_regional_compilation))
    options: dict[str, Any] = dict(backend=backend, fullgraph=cfg.dynamo_fullgraph, dynamic=cfg.dynamo_dynamic)
    options |= recompile_limit(cfg.dynamo_recompile_limit, compiled.regions)
    if cfg.dynamo_mode is not None:  # inductor only (speed_checks)
        options["mode"] = cfg.dynamo_mode
    # The backward graph compiles at the forward's first call: a failure surfaces in `guarded`, named.
    torch._functorch.config.force_non_lazy_backward_lowering = True
    WATCH.attach(emit, compiled)
    for region in compiled.regions:
        # The class's function, not a bound method: one compiled region serves every module of the stack.
        function = torch.compile(type(region.modules[0]).forward, **options)
        for module in region.modules:
            module.forward = types.MethodType(guarded(function, region.name, backend, cfg.dynamo_fullgraph), module)
    shapes = {None: "automatic dynamic shapes", True: "dynamic shapes", False: "static shapes"}[cfg.dynamo_dynamic]
    what = (f"{compiled.blocks()} blocks in {len(compiled.regions)} regions, one per block stack "
            f"({', '.join(r.name for r in compiled.regions)})" if compiled.regional else "the whole transformer")
    emit("info", message=f"torch.compile: {what}; backend {backend}, mode {compiled.mode}, {shapes}, at most "
                         f"{cfg.dynamo_recompile_limit} compilations per region (then eager); the first step and "
                         "the first validation compile, and a new shape may compile again",
         compiled_blocks=compiled.blocks(), backend=backend, mode=compiled.mode, regional=compiled.regional,
         regions=[r.name for r in compiled.regions])
    return compiled


def guarded(function: Callable[..., Any], region: str, backend: str, fullgraph: bool) -> Callable[..., Any]:
    """`function` (a compiled forward) with compiler failures raised as CompileError, named and with the fix."""

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(self, *args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise CompileError(f"torch.compile: the {region} region reached dynamo_recompile_limit with "
                               "dynamo_fullgraph on, where torch refuses to run it uncompiled; raise "
                               "dynamo_recompile_limit, leave dynamo_dynamic unset (or true), or set dynamo_fullgraph "
                               "false") from e
        except torch._dynamo.exc.TorchDynamoException as e:
            raise CompileError(failure(e, region, backend, fullgraph)) from e

    return forward


def failure(error: Exception, region: str, backend: str, fullgraph: bool) -> str:
    """The message of a compiler failure: torch's first line and the model line it names, then the way out."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    summary = " ".join([lines[0] if lines else type(error).__name__]
                       + [line for line in lines[1:] if line.startswith("Caused by:")][:1])
    advice = "to train without compiling, set dynamo_backend 'no' and compile false"
    if backend == "inductor":
        advice += "; dynamo_backend 'aot_eager' (no code generation) tells a kernel problem from a tracing one"
    if fullgraph:
        advice += "; dynamo_fullgraph makes every graph break an error: set it false to let the graph split"
    return (f"torch.compile failed (dynamo_backend {backend!r}, {region} region): {summary}. {advice[0].upper()}"
            f"{advice[1:]}. The whole error is chained below.")


class RecompileWatch(logging.Handler):
    """Turns torch's log line about a region reaching its recompile limit into one "warning" event per
    function. Process-wide (torch's logger is); the latest compiling run receives the events."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.emit_event: Callable[..., Any] | None = None
        self.seen: set[str] = set()
        self.names: dict[str, str] = {}  # torch's name of a compiled function -> the regions it compiles

    def attach(self, emit_event: Callable[..., Any], compiled: Compiled) -> None:
        self.emit_event, self.seen, self.names = emit_event, set(), {}
        regions: dict[str, list[str]] = {}
        for region in compiled.regions:  # torch names the function as its format_func_info writes it
            function = type(region.modules[0]).forward
            code = function.__code__
            key = f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})"
            regions.setdefault(key, []).append(region.name)
            what = (f"a region compiling {function.__qualname__} (the {' or '.join(regions[key])} blocks)"
                    if compiled.regional else f"the whole transformer ({function.__qualname__})")
            self.names[key] = what
        logger = logging.getLogger("torch._dynamo.convert_frame")
        if self not in logger.handlers:
            logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if self.emit_event is None or not str(record.msg).startswith(LIMIT_MESSAGE):
            return
        text = record.getMessage()
        function = re.search(r"function: (.*)", text)
        name = function.group(1).strip() if function else "?"
        where = self.names.get(name, f"the compiled function {name}")
        if where in self.seen:
            return
        self.seen.add(where)
        limit = re.search(r"hit config\.(\w+) \((\d+)\)", text)
        key = "dynamo_recompile_limit" if limit is None or limit.group(1) == "recompile_limit" else \
            f"torch's {limit.group(1)}"
        count = f"{key} {limit.group(2)}" if limit else key
        self.emit_event("warning", message=f"torch.compile: {where} reached its compilation limit ({count}): inputs "
                                           "that none of its compiled graphs accepts now run uncompiled (the same "
                                           "results, slower). Raise dynamo_recompile_limit, or leave dynamo_dynamic "
                                           "unset (or true) so that one dynamic graph serves every bucket",
                        recompile_limit_hit=where)


WATCH = RecompileWatch()
