"""The cheapest set of memory levers that fits an accelerator: `choose(cfg, found, gigabytes, processes)`.

The levers are tried as a ladder, cheapest first, each rung keeping the ones below it; the first rung whose
predicted peak fits is the answer. Because the rungs are fixed and each one's peak does not depend on the
memory asked for, more memory never needs a higher rung (monotone), and a config that fits needs none. A lever
of the answer without which it still fits is dropped (a free rung that saved nothing).

1. offload_during_startup (no cost once training runs), with vae_batch_size 1 when caching latents is the peak
2. gradient_checkpointing (about 30% slower steps)
3. gradient_checkpointing_backend 'unsloth': the checkpointed blocks' inputs wait in CPU memory (copies that
   overlap the compute; no quality cost, so before quantization)
4. base_model_precision int8-quanto (LoRA/LyCORIS only: a small quality cost; int8-torchao where the trainer
   refuses quanto, DoRA on bf16 weights); a full fine-tune of fp32 weights
   takes the 8-bit optimizer state instead (optimizer adamw8bit: on bf16/fp16 weights it has no Kahan summation and
   loses small updates, so it is not offered there), then, when that is not enough, its own optimizer stepping
   in CPU memory (optimizer_cpu_offload_method 'cpu': slower steps, no quality cost), then its gradients too
   (optimizer_offload_gradients, one micro-batch per step)
5. musubi_blocks_to_swap N, the fewest blocks that fit (copies over PCIe: slower)
6. enable_group_offload with the largest group that fits (every block streams: slower still)
7. fsdp_enable across the processes (needs processes > 1; FSDP takes neither quantization nor streaming, so
   this rung is gradient checkpointing plus FSDP)
8. base_model_precision int4-quanto (or nf4-bnb where quanto is refused, as in 4) with block streaming (the largest quality cost)

`reserve`: GiB of the card kept free for what the prediction does not count, the CUDA context (about 0.5 GiB with
cuBLAS's workspace) and the caching allocator's fragmentation; `difftune plan`, the wizard and the web UI keep
`reserve_for(gigabytes)` (a 24 GiB card is planned to 23 GiB).

Every candidate is validated by TrainConfig first, so a combination the trainer refuses is never proposed.
A full fine-tune of bf16/fp16 weights with an optimizer the trainer warns about (no Kahan summation: small updates
lost to rounding) is planned with the one the trainer says to use instead, its first step (train/setup.py's rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from difftune.memory_plan.predict import GIB, Prediction, predict

SPEED = {
    "offload_during_startup": "none while training (the transformer moves after caching)",
    "vae_batch_size": "caching only: one image per VAE pass",
    "gradient_checkpointing": "about 30% slower steps (activations are recomputed)",
    "base_model_precision": "small quality cost (frozen weights rounded); int4 larger",
    "optimizer": "8-bit optimizer state: a small quality cost",
    "gradient_checkpointing_backend": "little: the inputs' copies to and from CPU memory overlap the compute; "
                                      "needs pinned CPU memory of their size",
    "musubi_blocks_to_swap": "slower: the swapped blocks are copied from CPU memory every step",
    "enable_group_offload": "slower: every block is copied from CPU memory every step",
    "group_offload_blocks_per_group": "",
    "fsdp_enable": "communication between the processes every step",
    "optimizer_cpu_offload_method": "slower steps: the optimizer runs on the CPU, the gradients and weights cross "
                                    "PCIe every step; needs CPU memory for the state and twice the weights (pinned)",
    "optimizer_offload_gradients": "the gradients leave as the backward pass makes them: one micro-batch per step, "
                                   "one process",
}


@dataclass
class Step:
    key: str
    value: Any
    saving: int  # bytes of peak saved by this lever, given the ones before it (negative: it costs)
    why: str
    phase: str = ""  # when the peak did not move: the phase whose memory it changed, and `saving` is of that phase

    def where(self) -> str:
        """' of training (not the peak)' for a lever needed below the peak, else ''."""
        return f" of {self.phase} (not the peak)" if self.phase else ""

    def effect(self, digits: int = 1) -> str:
        """'saves 1.2 GiB', or for a lever needed below the peak 'saves 1.2 GiB of training (not the peak)'."""
        return f"{'saves' if self.saving >= 0 else 'costs'} {abs(self.saving) / GIB:.{digits}f} GiB{self.where()}"


def change(before: Prediction, after: Prediction) -> tuple[int, str]:
    """(bytes saved, "") of the peak; when the peak did not move (a lever for a phase below it, which a later lever
    makes the peak: offload_during_startup before checkpointing), (bytes saved, name) of the phase it changed most."""
    if before.peak != after.peak:
        return before.peak - after.peak, ""
    totals = {p.name: p.total for p in before.phases}
    saved, name = max(((totals[p.name] - p.total, p.name) for p in after.phases if p.name in totals),
                      key=lambda d: abs(d[0]), default=(0, ""))
    return (saved, name) if saved else (0, "")


def reserve_for(gigabytes: float) -> float:
    """GiB of a card of `gigabytes` GiB the user-facing planners keep free (module docstring): 1 GiB, or 5% of a
    card under 20 GiB."""
    return min(1.0, 0.05 * gigabytes)


@dataclass
class Choice:
    fits: bool
    gigabytes: float
    before: Prediction
    after: Prediction | None
    steps: list[Step] = field(default_factory=list)
    message: str = ""
    reserve: float = 0.0  # GiB of `gigabytes` kept free (reserve_for)
    frugal: dict[str, Any] = field(default_factory=dict)  # when nothing fits: the most frugal settings tried

    def settings(self) -> dict[str, Any]:
        return {s.key: s.value for s in self.steps}


def _valid(cfg: Any, changes: dict[str, Any]) -> Any | None:
    """The TrainConfig with `changes`, or None when the trainer would refuse it."""
    try:
        return type(cfg).model_validate({**cfg.model_dump(exclude_unset=True), **changes})
    except ValueError:
        return None


def _has(cfg: Any, key: str) -> bool:
    return key in type(cfg).model_fields


def ladder(cfg: Any, before: Prediction, processes: int) -> list[list[dict[str, Any]]]:
    """Rungs, cheapest first; each rung lists alternatives (the first that fits wins, e.g. N blocks swapped)."""
    rungs: list[list[dict[str, Any]]] = []
    base: dict[str, Any] = {}
    if not cfg.offload_during_startup:  # free once training runs; `choose` drops it again when it saves nothing
        base = {"offload_during_startup": True}
        if before.peak_phase == "caching: latents" and cfg.vae_batch_size > 1:
            base["vae_batch_size"] = 1
        rungs.append([dict(base)])
    if not cfg.gradient_checkpointing:
        base = {**base, "gradient_checkpointing": True}
        rungs.append([dict(base)])
    if _has(cfg, "gradient_checkpointing_backend") and cfg.gradient_checkpointing_backend == "torch":
        base = {**base, "gradient_checkpointing_backend": "unsloth"}
        rungs.append([dict(base)])
    full = cfg.model_type == "full"
    if full:
        if cfg.optimizer != "adamw8bit" and cfg.weight_dtype_name() == "fp32":  # else lossy: see the docstring
            rungs.append([{**base, "optimizer": "adamw8bit"}])
        if _has(cfg, "optimizer_cpu_offload_method") and not cfg.optimizer_offload_gradients:
            # the optimizer the user chose, on the CPU; then its gradients too (one micro-batch, one process)
            offload = {**base, "optimizer_cpu_offload_method": "cpu"}
            rungs.append([offload] + ([{**offload, "optimizer_offload_gradients": True}] if processes == 1 else []))
    elif cfg.base_model_precision in ("no_change", "fp8-torchao", "fp8-quanto") and \
            (int8 := _accepted(cfg, base, ("int8-quanto", "int8-torchao"))):
        base = {**base, "base_model_precision": int8}  # kept by the later rungs
        rungs.append([dict(base)])
    if not full:
        stacks = _main_stack_size(cfg)
        if _has(cfg, "musubi_blocks_to_swap") and stacks:
            rungs.append([{**base, "musubi_blocks_to_swap": n} for n in range(1, stacks + 1)])
        if _has(cfg, "enable_group_offload"):
            rungs.append([{**base, "enable_group_offload": True, "group_offload_blocks_per_group": k}
                          for k in (8, 4, 2, 1)])
    if processes > 1 and _has(cfg, "fsdp_enable"):
        # with the cheaper levers so far (offload_during_startup, unsloth: FSDP takes them), quantization aside
        # (FSDP shards plain weights); the bare set where a kept one is refused with FSDP
        sharded = {"gradient_checkpointing": True, "fsdp_enable": True, "base_model_precision": "no_change"}
        rungs.append([sharded, {**base, **sharded}] if {**base, **sharded} != sharded else [sharded])
    if not full and _has(cfg, "enable_group_offload") and \
            (int4 := _accepted(cfg, {**base, "enable_group_offload": True}, ("int4-quanto", "nf4-bnb"))):
        rungs.append([{**base, "base_model_precision": int4, "enable_group_offload": True,
                       "group_offload_blocks_per_group": k} for k in (4, 2, 1)])
    return rungs


def _accepted(cfg: Any, base: dict[str, Any], precisions: tuple[str, ...]) -> str | None:
    """The first of `precisions` the trainer takes with `base` (optimum-quanto's first: it also runs on the CPU; DoRA
    on bf16 weights refuses it, torchao's then), or None: a rung that no precision passes is left out, and the
    later rungs do not carry a quantization that would make every one of them invalid."""
    return next((p for p in precisions if _valid(cfg, {**base, "base_model_precision": p}) is not None), None)


def _main_stack_size(cfg: Any) -> int:
    from difftune.memory_plan import architecture as A
    from difftune.memory_plan.predict import _transformer

    arch = A.architecture_of(cfg)
    blocks = _transformer(arch, cfg.weight_dtype_name(), cfg.base_model_precision)[1]
    return list(blocks.count.values())[-1] if blocks.count else 0


def lossless_optimizer(cfg: Any) -> dict[str, Any]:
    """{'optimizer': the one to use} when the trainer would warn that this full fine-tune loses small updates (its
    bf16/fp16 weights and an optimizer without Kahan summation: train/setup.py), else {}."""
    from difftune.train.optimizer_catalog import STOCHASTIC_ROUNDING
    from difftune.train.optimizers import KAHAN_INSTEAD, OPTIMIZER_ALIASES, small_update_advice

    name = OPTIMIZER_ALIASES.get(cfg.optimizer, cfg.optimizer)
    if small_update_advice(cfg) is None or name in STOCHASTIC_ROUNDING:  # torchao's: stochastic rounding (its
        return {}  # optimizer_config, which the warning names) keeps its small state; adamw_bf16 would multiply it
    return {"optimizer": KAHAN_INSTEAD.get(name, "adamw_bf16")}


def choose(cfg: Any, found: list[Any] | None, gigabytes: float, processes: int = 1,
           before: Prediction | None = None, reserve: float = 0.0) -> Choice:
    """The cheapest lever set whose predicted peak fits `gigabytes` GiB less `reserve` (see the module docstring)."""
    before = before or predict(cfg, found, processes)
    fix = lossless_optimizer(cfg)
    fixed = _valid(cfg, fix) if fix else None
    if fixed is None:
        return _choose(cfg, found, gigabytes, processes, before, reserve)
    # the optimizer change first (its cost said as a negative saving), then the levers planned with it
    start = predict(fixed, found, processes)
    choice = _choose(fixed, found, gigabytes, processes, start, reserve)
    why = (f"a full fine-tune of {cfg.weight_dtype_name()} weights with '{cfg.optimizer}' loses small updates to "
           "rounding; this one keeps them (Kahan summation)")
    saved, phase = change(before, start)
    step = Step("optimizer", fix["optimizer"], saved, why, phase)
    message = (f"fits with {len(choice.steps) + 1} change(s)" if choice.fits
               else f"{choice.message}; planned with optimizer '{fix['optimizer']}': {why}")
    return Choice(choice.fits, gigabytes, before, choice.after, [step, *choice.steps] if choice.fits else [],
                  message, reserve, frugal={} if choice.fits else {**fix, **choice.frugal})


def _choose(cfg: Any, found: list[Any] | None, gigabytes: float, processes: int, before: Prediction,
            reserve: float) -> Choice:
    """`choose` for a config whose optimizer is kept: the ladder's first rung that fits."""
    limit = (gigabytes - reserve) * GIB
    kept = f" ({reserve:g} GiB kept free)" if reserve else ""
    if before.peak <= limit:
        return Choice(True, gigabytes, before, before, [], "fits as it is: no lever needed", reserve)
    frugal, frugal_changes = before, {}  # the lowest prediction of the sets tried, and that set
    for rung in ladder(cfg, before, processes):
        # a rung's alternatives save more and more (more blocks swapped, smaller groups): bisect for the first
        options = [(changes, candidate) for changes in rung if (candidate := _valid(cfg, changes)) is not None]
        # the rung's most frugal option, kept when it is the lowest so far (a later rung's can be higher: FSDP
        # drops the quantization of the rungs before it)
        if options and (most := predict(options[-1][1], found, processes)).peak < frugal.peak:
            frugal, frugal_changes = most, options[-1][0]
        low, high, best = 0, len(options) - 1, None
        while low <= high:
            middle = (low + high) // 2
            after = predict(options[middle][1], found, processes)
            if after.peak <= limit:
                best, high = (options[middle][0], after), middle - 1
            else:
                low = middle + 1
        if best is not None:
            changes, after = _without_needless(cfg, *best, found, processes, limit)
            return Choice(True, gigabytes, before, after, explain(cfg, changes, found, processes, before),
                          f"fits with {len(changes)} change(s)", reserve)
    if frugal_changes:  # less what the lowest peak does not need (levers of phases below it)
        frugal_changes, frugal = _without_needless(cfg, frugal_changes, frugal, found, processes, frugal.peak)
    return Choice(False, gigabytes, before, None, [],
                  f"nothing fits in {gigabytes:g} GiB{kept}: the most frugal settings still need "
                  f"{frugal.peak / GIB:.2f} GiB ({frugal.peak_phase})" + _beyond(cfg, frugal, processes), reserve,
                  frugal=frugal_changes)


def _without_needless(cfg: Any, changes: dict[str, Any], after: Prediction, found: list[Any] | None,
                      processes: int, limit: float) -> tuple[dict[str, Any], Prediction]:
    """`changes` less every lever the answer fits without (a free one that saved nothing, or checkpointing a later
    rung made needless), tried again after each removal: a lever may be needed only by another (activation offload
    needs checkpointing), so one pass in ladder order could keep one that can go once the other has gone."""
    removed = True
    while removed:
        removed = False
        for key in list(changes):
            fewer = {k: v for k, v in changes.items() if k != key}
            candidate = _valid(cfg, fewer) if fewer else None
            if candidate is not None and (lighter := predict(candidate, found, processes)).peak <= limit:
                changes, after, removed = fewer, lighter, True
    return changes, after


def _beyond(cfg: Any, frugal: Prediction, processes: int) -> str:
    """What could go further when no lever fits, by the phase still over: processes divide the training step's
    weights (FSDP), not the text encoders or the VAE of the caching phases."""
    if frugal.peak_phase.startswith("caching: text"):
        return ("; more processes do not divide the text encoders: text_encoder_1_precision (and _2) int8-quanto "
                "quantizes them (other embeddings: the specs keep Qwen2.5-VL at no_change), or fill the text "
                "cache on a larger GPU once (`difftune cache`: training then keeps the text encoders off this GPU; "
                "this plan still counts their phase)")
    if frugal.peak_phase.startswith("caching"):
        return "; the VAE's phase: lower vae_batch_size, or fill the latent cache on a larger GPU once (`difftune cache`)"
    if not _has(cfg, "fsdp_enable") or _valid(cfg, {"fsdp_enable": True, "gradient_checkpointing": True,
                                                     "base_model_precision": "no_change"}) is None:
        return ""  # FSDP is refused with this config (EMA, a LyCORIS network, ...): no hint to follow
    if processes > 1:
        return " (more processes with fsdp_enable would divide the weights)"
    return " (run on more GPUs: --processes N with fsdp_enable)"


def explain(cfg: Any, changes: dict[str, Any], found: list[Any] | None, processes: int,
            before: Prediction) -> list[Step]:
    """Each change with the peak it saves given the ones before it (in the ladder's order; `change`)."""
    steps: list[Step] = []
    applied: dict[str, Any] = {}
    previous = before
    for key, value in changes.items():
        applied[key] = value
        candidate = _valid(cfg, applied)
        after = predict(candidate, found, processes) if candidate is not None else previous
        saved, phase = change(previous, after)
        steps.append(Step(key, value, saved, SPEED.get(key, ""), phase))
        previous = after
    return steps
