"""peft's input cast of LoRA layers, skipped where autocast makes it a round trip.

peft's `lora.Linear.forward` casts the layer's input to the LoRA weights' dtype before `lora_A`. Adapters train in
fp32 on a bf16 base (adapters/kinds.py), so under bf16 autocast that cast copies the bf16 activation to fp32, and
autocast's `F.linear` in `lora_A` copies it straight back to bf16: two full-size copies per LoRA layer in the
forward, again in gradient checkpointing's recompute, and their backward nodes (a Lumina2 LoRA step on an H100 was
launch-bound with 2,624 of its ~6,000 kernels dtype copies). bf16 -> fp32 -> bf16 is exact, so without the first
cast `lora_A` gets the very same bf16 input: losses and gradients are bit-identical
(tests/test_lora_casts.py).

Without autocast (validation samples the plain module in the weights' own dtype) the cast is what makes a bf16
input fit fp32 LoRA weights, so it stays. Which case a forward is in is decided once per transformer forward, by a
forward pre-hook reading `torch.is_autocast_enabled` for the input's device, and written to peft's own switch,
`cast_input_dtype_enabled`, only when it changes. Not a context manager around the training forward (peft's
`disable_input_dtype_casting`): gradient checkpointing recomputes blocks during the backward, outside that forward,
where such a switch would be back on and the recompute would pay the copies again (same numbers: the recompute
saves tensors of the same shapes and dtypes, so checkpointing does not object, but half the gain is lost). The
backward of a forward comes before the next forward, so the switch the forward set is still set when its recompute
runs, and recompute and forward do the same work.

Only vanilla LoRA on `lora.Linear` (which covers peft's torchao and quanto-wrapped linears, subclasses with the
same forward) without dropout skips the cast. A layer keeps it where the input meets other math before the autocast
matmul, which would then run in bf16 instead of fp32: a LoRA variant (DoRA's norms and scaling), or `lora_dropout`
(its 1/(1-p) scaling rounds differently in bf16: the same mask, other values). Other layer kinds (bitsandbytes,
convolutions, embeddings) are left as peft makes them.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear


class LoraInputCasts:
    """The forward pre-hook on `transformer` that turns peft's input casts off under autocast and on without it."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer
        self.layers = [m for m in transformer.modules() if isinstance(m, LoraLinear)]
        self.casting = True  # peft's default: every layer casts
        self.handle = transformer.register_forward_pre_hook(self.before_forward, with_kwargs=True)

    def before_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        casting = not torch.is_autocast_enabled(self.device_type(args, kwargs))
        if casting != self.casting:
            self.set(casting)

    def set(self, casting: bool) -> None:
        for layer in self.layers:
            # Variants and dropouts are read here, not when the hook was made, so an adapter added or made active
            # later is seen. This runs only when autocast turns on or off (validation), not every step.
            layer.cast_input_dtype_enabled = casting or not all(plain(layer, name) for name in layer.active_adapters)
        self.casting = casting

    def device_type(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """Where the forward computes: its first tensor input's device (the weights may be elsewhere, streamed
        in block by block), else the first parameter's."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                return value.device.type
        return next(self.transformer.parameters()).device.type


def plain(layer: LoraLinear, adapter: str) -> bool:
    """Whether `adapter`'s path in `layer` is lora_B(lora_A(x)) on the input as it comes: no variant, no dropout."""
    dropout = layer.lora_dropout[adapter] if adapter in layer.lora_dropout else None
    return adapter not in layer.lora_variant and not (isinstance(dropout, torch.nn.Dropout) and dropout.p > 0)


def skip_casts_under_autocast(transformer: torch.nn.Module) -> LoraInputCasts | None:
    """Attach `LoraInputCasts` to a transformer carrying peft LoRA layers; None when it has no `lora.Linear`."""
    hook = LoraInputCasts(transformer)
    if not hook.layers:
        hook.handle.remove()
        return None
    return hook
