"""FSDP2 (`fsdp_enable`): the transformer's weights, gradients and optimizer state sharded between the
processes with torch's `fully_shard`, instead of a whole copy per process (DDP).

Why torch's `fully_shard` and not accelerate's FSDP plugin: accelerate turns FSDP on only for
accelerator devices (not for processes on the CPU with gloo, where the tests run), and its FSDP2 path
upcasts the trainable weights to fp32 and casts them back for compute, which would make an FSDP run
differ from a DDP or single-process run. Here the numbers are the same as one process with the same
global batch: autocast is the loop's, gradients are averaged by reduce-scatter as DDP averages them.

What it changes, and where:
- `shard` (from setup.build_run, after the adapter is attached and before the optimizer is built):
  one FSDP unit per transformer block (the classes of its `nn.ModuleList` entries and diffusers'
  `_no_split_modules`, or `fsdp_transformer_layer_cls_to_wrap`), then the root. The parameters become
  DTensors; a frozen base with trainable LoRA weights is fine (FSDP2 keeps requires_grad per parameter).
- `gathered` (around every save; every process enters it): the trainable weights (all of them for a
  full fine-tune) are gathered whole to process 0, which saves them with the usual code: the
  transformer's and the adapter's `state_dict` read the gathered tensors meanwhile. So checkpoints and
  results are the files a single process writes (a peft LoRA, a diffusers transformer folder).
  The optimizer state is saved by `fsdp_state_dict_type`: SHARDED (torch.distributed.checkpoint, each
  process writes its shard, the folder `optimizer_fsdp/`) or FULL (gathered into `optimizer_fsdp.pt`).
- `unsharded` (around validation): every process gathers the blocks' weights and keeps them gathered,
  so process 0 can sample alone with the stock pipeline (no collective runs while it samples); the
  others free them at once and wait at the barrier.
- Loading a checkpoint: the weights through `adapters.kinds._copy_into` (each process takes its part
  of the full tensor), the optimizer through `load_optimizer`.
- `fsdp_cpu_ram_efficient_loading` (accelerate's meaning): `transformer_on_meta` (around the family's
  `load`) makes every process but 0 build the transformer from its config.json on the meta device, so it
  reads no weight; `shard` then puts every process's transformer on meta (process 0 keeps its state dict
  on the CPU), shards it, gives each process empty shards on its device and fills them from process 0
  (`set_model_state_dict(..., broadcast_from_rank0=True)`): the pretrained weights and the adapter's
  seeded initial weights alike. Buffers, which `to_empty` leaves uninitialised and some of which are in
  no state dict (Kandinsky 5's RoPE tables are non-persistent), are sent from process 0 too.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.config.resume_check import not_written_by_fsdp

if TYPE_CHECKING:
    from difftune.train.distributed import Ranks
    from difftune.train.setup import Run

SHARDED_OPTIMIZER = "optimizer_fsdp"  # a torch.distributed.checkpoint folder: one file per process
FULL_OPTIMIZER = "optimizer_fsdp.pt"  # the whole state, keyed by parameter name
WEIGHTS_READ = "_difftune_weights_read"  # on the transformer: bytes of weights its loading put in memory


@dataclass
class Sharded:
    """What a run sharded: its units (root last) and how checkpoints keep the optimizer state."""

    root: Any
    blocks: list[Any]
    reshard_after_forward: bool
    state_dict_type: str
    staged: Any = None  # the optimizer state gathered for process 0 (FULL), or the folder written (SHARDED)
    units: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.units = [*self.blocks, self.root]


def block_classes(transformer: torch.nn.Module, names: list[str] | None) -> set[type]:
    """The classes sharded one unit per instance: `names` when given (each must name a class of the
    transformer's modules), else the classes of the transformer's block lists (the entries of its own
    `nn.ModuleList`s) and diffusers' `_no_split_modules`."""
    present = {type(m).__name__: type(m) for m in transformer.modules()}
    if names:
        unknown = [n for n in names if n not in present]
        if unknown:
            found = sorted(c.__name__ for c in _listed_blocks(transformer))
            raise ValueError(
                f"fsdp_transformer_layer_cls_to_wrap: {', '.join(unknown)} is not a class of this transformer's "
                f"modules; its blocks are {', '.join(found) or 'none'} (every class: {', '.join(sorted(present))})")
        return {present[n] for n in names}
    classes = _listed_blocks(transformer)
    if not classes:
        raise ValueError(f"FSDP: {type(transformer).__name__} has no list of blocks to shard; name the block class "
                         f"in fsdp_transformer_layer_cls_to_wrap (its classes: {', '.join(sorted(present))})")
    return classes


def _listed_blocks(transformer: torch.nn.Module) -> set[type]:
    named = set(getattr(transformer, "_no_split_modules", None) or [])
    classes = {type(m) for m in transformer.modules() if type(m).__name__ in named}
    for module in transformer.children():  # the block stacks (not the lists inside a block: to_out, ...)
        if isinstance(module, torch.nn.ModuleList):
            classes |= {type(child) for child in module}
    return classes


def ram_efficient(cfg: Any, ranks: Ranks) -> bool:
    """fsdp_cpu_ram_efficient_loading acts: FSDP with several processes (with one it is plain training)."""
    return bool(cfg.fsdp_enable and cfg.fsdp_cpu_ram_efficient_loading and ranks.count > 1)


@contextmanager
def transformer_on_meta(cfg: Any, ranks: Ranks) -> Iterator[None]:
    """Around the family's `load`. With fsdp_cpu_ram_efficient_loading, on every process but 0, a diffusers
    `from_pretrained(..., subfolder="transformer")` builds the model from its config.json on the meta device,
    the way diffusers builds it before reading the weights (the same default dtype, no initialisation), and
    reads no weight; the VAE and text encoders load as usual. Every process notes on the transformer the
    bytes of weights its loading put in memory (`WEIGHTS_READ`), which `shard` reports. Otherwise a no-op."""
    if not ram_efficient(cfg, ranks):
        yield
        return
    from diffusers import ModelMixin

    original = ModelMixin.__dict__["from_pretrained"]

    def from_pretrained(cls: type, source: Any, **kwargs: Any) -> Any:
        # the transformer, whatever its subfolder (pretrained_transformer_subfolder); VAEs are AutoencoderKL*
        if "Transformer" not in cls.__name__:
            return original.__func__(cls, source, **kwargs)
        model = original.__func__(cls, source, **kwargs) if ranks.main else _empty_model(cls, source, **kwargs)
        setattr(model, WEIGHTS_READ, sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta))
        return model

    ModelMixin.from_pretrained = classmethod(from_pretrained)  # a class attribute: restored right after loading
    try:
        yield
    finally:
        ModelMixin.from_pretrained = original


def _empty_model(cls: type, source: Any, torch_dtype: torch.dtype | None = None, **kwargs: Any) -> Any:
    """What diffusers' from_pretrained builds before it reads the weights: the parameters on the meta
    device, buffers and other tensors computed in `__init__` under the same default dtype."""
    from accelerate import init_empty_weights
    from diffusers.models.modeling_utils import no_init_weights

    kwargs.pop("variant", None)  # names a weight file: the config is the same
    config, unused = cls.load_config(source, return_unused_kwargs=True, **kwargs)
    default = torch.get_default_dtype()
    if torch_dtype is not None and torch_dtype.is_floating_point:
        torch.set_default_dtype(torch_dtype)
    try:
        with no_init_weights(), init_empty_weights():
            model = cls.from_config(config, **unused)
    finally:
        torch.set_default_dtype(default)
    model.register_to_config(_name_or_path=source)
    return model.eval()


def shard(cfg: Any, transformer: torch.nn.Module, adapter: Any, ranks: Ranks, device: torch.device,
          emit: Any) -> Sharded | None:
    """Apply FSDP2 to `transformer` (in place) when fsdp_enable and several processes run; else None.
    The adapter's parameter list is refreshed: fully_shard replaces every parameter with a DTensor.
    With fsdp_cpu_ram_efficient_loading the shards are filled from process 0's weights (`_from_process0`)."""
    if not cfg.fsdp_enable:
        if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("true", "1"):  # accelerate launch --use_fsdp
            emit("warning", message="accelerate launch --use_fsdp is not read by difftune: this run is data-parallel, "
                                    "a whole model per process; set fsdp_enable: true (and fsdp_version 2) to shard")
        return None
    if ranks.count == 1:
        emit("warning", message="fsdp_enable with a single process: nothing to shard, training as one process "
                                "(launch several: torchrun --nproc_per_node N -m difftune.cli train ...)")
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    classes = block_classes(transformer, cfg.fsdp_transformer_layer_cls_to_wrap)
    mesh = init_device_mesh(device.type, (ranks.count,))
    # Innermost first: a unit's parameters are those not already in a unit below it.
    blocks = [m for m in reversed(list(transformer.modules())) if type(m) in classes and m is not transformer]
    names = ", ".join(sorted({type(b).__name__ for b in blocks}))  # before fully_shard renames the classes
    staged = _to_meta(transformer, ranks) if ram_efficient(cfg, ranks) else None
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=cfg.fsdp_reshard_after_forward)
    # The root keeps its weights after the forward pass: its backward comes right after (torch's default).
    fully_shard(transformer, mesh=mesh, reshard_after_forward=False)
    if staged is not None:
        _from_process0(transformer, staged, ranks, device, emit)
    adapter.params = [p for p in transformer.parameters() if p.requires_grad]
    emit("info", message=f"FSDP2: {len(blocks)} blocks ({names}) and the rest of the transformer sharded between "
                         f"{ranks.count} processes; optimizer state in checkpoints: {cfg.fsdp_state_dict_type}")
    return Sharded(transformer, blocks, cfg.fsdp_reshard_after_forward, cfg.fsdp_state_dict_type)


@dataclass
class _Staged:
    """Process 0's whole transformer on the CPU, kept while the sharded model is filled from it."""

    state: dict[str, torch.Tensor]  # its state dict (empty on the other processes)
    buffers: dict[str, torch.Tensor]  # every buffer, those in no state dict too (empty on the other processes)
    loading: list[dict[str, Any]]  # per process: how its transformer was built


def _to_meta(transformer: torch.nn.Module, ranks: Ranks) -> _Staged:
    """Every process: check that its transformer (with the adapter) has process 0's names and shapes, take
    process 0's dtypes (diffusers keeps `_keep_in_fp32_modules` in fp32 while it reads the weights, which the
    empty build does not), then move it to the meta device; process 0 keeps its weights on the CPU."""
    tensors = {**dict(transformer.named_parameters()), **dict(transformer.named_buffers())}
    layout = ranks.broadcast({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()})
    problem = None
    if tensors.keys() != layout.keys():
        differ = sorted(tensors.keys() ^ layout.keys())
        problem = f"{len(differ)} tensors are not on both (first: {differ[0]})"
    elif (name := next((n for n, t in tensors.items() if tuple(t.shape) != layout[n][0]), None)) is not None:
        problem = f"{name} is {tuple(tensors[name].shape)} here, {layout[name][0]} on process 0"
    read = getattr(transformer, WEIGHTS_READ, None)
    loading = ranks.gather({"process": ranks.index, "weights_read_bytes": read, "problem": problem})
    bad = [e for e in loading if e["problem"] or e["weights_read_bytes"] is None
           or (e["process"] > 0) == (e["weights_read_bytes"] > 0)]
    if bad:  # every process raises, none waits at the next collective
        e = bad[0]
        why = e["problem"] or (
            "its family did not load the transformer through from_pretrained(subfolder='transformer')"
            if e["weights_read_bytes"] is None else f"it read {e['weights_read_bytes']} bytes of weights")
        raise RuntimeError(f"fsdp_cpu_ram_efficient_loading: process {e['process']}'s transformer is not what "
                           f"process 0 loaded ({why}); set fsdp_cpu_ram_efficient_loading false")
    with torch.no_grad():
        for name, tensor in tensors.items():
            dtype = layout[name][1]
            if tensor.dtype == dtype:
                continue
            if isinstance(tensor, torch.nn.Parameter):
                tensor.data = tensor.data.to(dtype)
            else:
                owner, _, leaf = name.rpartition(".")
                transformer.get_submodule(owner)._buffers[leaf] = tensor.to(dtype)
    state = transformer.state_dict() if ranks.main else {}  # references: moving the model does not free them
    buffers = dict(transformer.named_buffers()) if ranks.main else {}
    transformer.to("meta")
    return _Staged(state, buffers, loading)


def _from_process0(transformer: torch.nn.Module, staged: _Staged, ranks: Ranks, device: torch.device,
                   emit: Any) -> None:
    """Every process, after fully_shard on the meta device: empty shards on `device`, filled from process 0's
    state dict one tensor at a time (set_model_state_dict with broadcast_from_rank0; each process keeps its
    part), then every buffer sent whole: `to_empty` left them uninitialised, and the non-persistent ones (RoPE
    tables) are in no state dict."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from difftune.train.memory import peak_rss_bytes

    transformer.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(transformer, staged.state, options=options)
    with torch.no_grad():
        for name, buffer in transformer.named_buffers():
            if ranks.main:
                buffer.copy_(staged.buffers[name])
            dist.broadcast(buffer, src=0)
    staged.state.clear()
    staged.buffers.clear()
    peaks = ranks.gather(peak_rss_bytes())  # after filling: process 0's peak includes the whole model
    loading = [{"process": e["process"], "built": "read" if e["weights_read_bytes"] else "meta",
                "weights_read_bytes": e["weights_read_bytes"], "rss_peak_bytes": peak}
               for e, peak in zip(staged.loading, peaks, strict=True)]
    parts = [f"process {e['process']} " + (f"read the weights ({e['weights_read_bytes'] / 2**20:.1f} MiB)"
                                           if e["built"] == "read" else "built it on meta, weights from process 0")
             for e in loading]
    emit("info", loading=loading, message="fsdp_cpu_ram_efficient_loading: " + "; ".join(parts) + "; peak RSS: "
         + ", ".join(f"{e['rss_peak_bytes'] / 2**20:.0f} MiB" for e in loading))


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


@contextmanager
def gathered(run: Run, optimizer: bool = False, step: int | None = None) -> Iterator[None]:
    """Every process enters; inside, process 0's `transformer.state_dict()` and `adapter.state_dict()`
    return the whole tensors (on the CPU), so the usual save code writes the usual files. With
    `optimizer`, the optimizer state is prepared for `save_optimizer` (checkpoint `step`)."""
    sharded: Sharded | None = getattr(run, "fsdp", None)
    if sharded is None:
        yield
        return
    from torch.distributed.tensor import DTensor

    model = sharded.root
    full_model = type(run.adapter).__name__ == "FullAdapter"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    wanted = None if full_model else set(trainable)
    full: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, value in model.state_dict().items():  # the same order on every process: the collectives match
            if wanted is not None and name not in wanted:
                continue
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if run.ranks.main:
                full[name] = value.cpu()
    if optimizer:
        _stage_optimizer(run, sharded, step)
    if not run.ranks.main:
        yield
        return
    model.state_dict = lambda *args, **kwargs: dict(full)
    if not full_model:  # a full fine-tune's adapter reads the transformer's state_dict
        run.adapter.state_dict = lambda: {n: full[n].clone() for n in trainable}
    try:
        yield
    finally:
        del model.state_dict
        run.adapter.__dict__.pop("state_dict", None)
        sharded.staged = None


def _stage_optimizer(run: Run, sharded: Sharded, step: int | None) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    inner = _inner(run.optimizer)
    if sharded.state_dict_type == "FULL_STATE_DICT":
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sharded.staged = get_optimizer_state_dict(sharded.root, inner, options=options)  # empty except on 0
        return
    import torch.distributed.checkpoint as dcp

    from difftune.train.checkpoint import checkpoints_dir, written

    # Beside the checkpoints (a `.tmp-` name: clean_partial removes it after a kill); process 0 moves it
    # into the checkpoint it writes.
    folder = checkpoints_dir(run.output_dir) / f".tmp-{SHARDED_OPTIMIZER}-{step or 0:07d}"
    if run.ranks.main:
        shutil.rmtree(folder, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
    run.ranks.barrier()
    with written(f"the sharded optimizer state of step {step or 0}", folder, run.output_dir, partial=folder):
        dcp.save({"optimizer": get_optimizer_state_dict(sharded.root, inner)}, checkpoint_id=str(folder))
    run.ranks.barrier()
    sharded.staged = folder


def save_optimizer(run: Run, folder: Path) -> None:
    """Process 0, inside `gathered(run, optimizer=True)`: put the optimizer state into checkpoint `folder`."""
    sharded: Sharded = run.fsdp
    if sharded.staged is None:
        raise RuntimeError("FSDP: save_optimizer outside gathered(run, optimizer=True)")
    if isinstance(sharded.staged, Path):
        sharded.staged.replace(folder / SHARDED_OPTIMIZER)
    else:
        torch.save(sharded.staged, folder / FULL_OPTIMIZER)


def load_optimizer(run: Run, folder: Path) -> None:
    """Every process: the optimizer state of checkpoint `folder`, in either layout, into its shard."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    sharded: Sharded = run.fsdp
    inner = _inner(run.optimizer)
    if (folder / SHARDED_OPTIMIZER).is_dir():
        import torch.distributed.checkpoint as dcp

        state = {"optimizer": get_optimizer_state_dict(sharded.root, inner)}  # the layout to fill
        dcp.load(state, checkpoint_id=str(folder / SHARDED_OPTIMIZER))
        set_optimizer_state_dict(sharded.root, inner, state["optimizer"])
    elif (folder / FULL_OPTIMIZER).is_file():
        state = torch.load(folder / FULL_OPTIMIZER, map_location="cpu", weights_only=True)
        set_optimizer_state_dict(sharded.root, inner, state, options=StateDictOptions(full_state_dict=True))
    else:
        raise ValueError(not_written_by_fsdp(folder))


@contextmanager
def unsharded(run: Run) -> Iterator[None]:
    """Every process enters: the weights are gathered whole and stay so through forward passes, so
    process 0 can sample alone. The other processes free them at once (no collective is pending)."""
    sharded: Sharded | None = getattr(run, "fsdp", None)
    if sharded is None:
        yield
        return
    for unit in sharded.units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in sharded.units:
            unit.reshard()
            unit.set_reshard_after_forward(sharded.reshard_after_forward and unit is not sharded.root, recurse=False)
