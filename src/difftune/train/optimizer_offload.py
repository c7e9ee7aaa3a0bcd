"""`optimizer_cpu_offload_method: cpu`: the optimizer's state, and its step, in CPU memory.

A full fine-tune keeps gradients and optimizer state the size of the model or larger (AdamW with Kahan
summation: three tensors per weight); on a 16 GB card that state is what does not fit. Here the optimizer the
config names is built over CPU copies of the trained weights, so its state is made and kept in CPU memory. Each
step copies the gradients out (pinned buffers, a side CUDA stream), runs the optimizer there, and copies the new
weights back; the next forward pass waits on that copy on the device, not on the host.

Why not torchao's `CPUOffloadOptimizer`: it copies each gradient out in a post-accumulate hook, during the
backward pass, so clipping (max_grad_norm, applied after the backward) never reaches the copies, gradient
accumulation breaks when device gradients are freed, and under DDP the copy happens before the all-reduce has
averaged the gradient. It also builds one optimizer per tensor, which changes Prodigy (one step-size estimate
over all weights) and makes its state unreadable by a run without offload. This one copies after the loop has
reduced and clipped the gradients, builds one optimizer over all weights, and its `state_dict()` is the inner
optimizer's own: a checkpoint resumes with or without offload.

`optimizer_offload_gradients: true` goes further: each gradient is copied out by a post-accumulate hook as the
backward pass makes it and freed on the device, so the accelerator never holds the gradients either (a full
fine-tune then needs little more than its weights and activations). That is where torchao's trade-offs return,
so the config allows it only with one micro-batch per step and `host_step` only on one process, and the loop's
clipping (optimizers.clip_gradients) runs on the CPU copies (`clip`), which also measures their norm, so a
non-finite gradient still skips its step.

The device weights stay the truth: a weight written by anything but this step (a checkpoint loaded into the
model, DDP's first broadcast, an EMA swap) bumps the tensor's version counter, and its CPU copy is refreshed
from the device before the next step. Without CUDA the same code runs with plain copies and saves nothing; the
CPU tests prove the losses equal a run without offload, resume included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch


class HostStepOptimizer(torch.optim.Optimizer):
    """`build(cpu_params)`'s optimizer, stepping CPU copies of `params` (device tensors) and copying back.

    Like torchao's, it subclasses Optimizer without calling its __init__ (LR schedulers check the type); the
    param groups, state and state dict are the inner optimizer's."""

    def __init__(self, params: list[torch.nn.Parameter], build: Callable[[list], torch.optim.Optimizer],
                 device: torch.device, offload_gradients: bool = False) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.offload_gradients = offload_gradients
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.hosts: list[torch.nn.Parameter] = []
        self.grads: list[torch.Tensor] = []  # pinned buffers the device gradients are copied into
        with torch.no_grad():
            for p in self.params:
                local = p.detach()
                self.hosts.append(torch.nn.Parameter(torch.empty_like(local, device="cpu", pin_memory=self.cuda)))
                self.grads.append(torch.empty_like(local, device="cpu", pin_memory=self.cuda))
        self.versions = [-1] * len(self.params)  # -1: the CPU copy has not been filled yet
        self.pull()
        self.inner = build(self.hosts)
        if offload_gradients:
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(self._gradient_out(i))

    # --- what torch.optim.Optimizer users read
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.inner.load_state_dict(state_dict)
        self.pull(every=True)  # a resume loads the weights first: the CPU copies follow them

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, host in zip(self.params, self.hosts, strict=True):
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
            host.grad = None

    def bytes(self) -> int:
        """CPU bytes of the weights' copies and the gradient buffers (the state comes with the first step)."""
        return sum(h.numel() * h.element_size() * 2 for h in self.hosts)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.inner.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    # --- the step
    def _side(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def _pairs(self) -> Iterator[tuple[int, torch.nn.Parameter, torch.nn.Parameter]]:
        yield from ((i, p, h) for i, (p, h) in enumerate(zip(self.params, self.hosts, strict=True)))

    @torch.no_grad()
    def pull(self, every: bool = False) -> None:
        """Refresh the CPU copy of each weight written since this optimizer last wrote it (all with `every`)."""
        changed = [(i, p, h) for i, p, h in self._pairs() if every or p._version != self.versions[i]]
        if not changed:
            return
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.params[0].device))
        with self._side():
            for _, p, h in changed:
                h.copy_(p.detach(), non_blocking=True)
        if self.stream is not None:
            self.stream.synchronize()
        for i, p, _ in changed:
            self.versions[i] = p._version

    def _gradient_out(self, i: int) -> Callable[[torch.Tensor], None]:
        """optimizer_offload_gradients: the hook that sends weight i's gradient out as soon as the backward pass
        has made it, and frees it on the device (one micro-batch, one process: the config and `host_step` see to
        that, since the gradient leaves before accumulation or DDP's averaging could reach it)."""

        def out(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(p.device))
            with self._side():
                self.grads[i].copy_(p.grad, non_blocking=True)
            if self.stream is not None:
                p.grad.record_stream(self.stream)  # its memory is reused only once the copy is done
            self.hosts[i].grad = self.grads[i]
            p.grad = None

        return out

    @torch.no_grad()
    def clip(self, max_norm: float, method: str) -> torch.Tensor:
        """optimizer_offload_gradients: `max_grad_norm` applied to the gradients in CPU memory (the device has none
        left); returns their global norm before clipping, as `optimizers.clip_gradients` does on the device."""
        if self.stream is not None:
            self.stream.synchronize()
        grads = [h for h in self.hosts if h.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if method == "norm" else math.inf)
        if method == "value" and math.isfinite(max_norm):
            torch.nn.utils.clip_grad_value_(grads, max_norm)
        return norm

    def _gradients_in(self) -> None:
        """Copy the device gradients out, after the loop has reduced and clipped them."""
        if self.stream is not None:  # the backward pass (and clipping) that made the gradients comes first
            self.stream.wait_stream(torch.cuda.current_stream(self.params[0].device))
        with self._side():
            for i, p, h in self._pairs():
                if p.grad is None:
                    h.grad = None  # not used this step: the optimizer skips it, as it would on the device
                    continue
                h.grad = self.grads[i]
                h.grad.copy_(p.grad, non_blocking=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self.pull()
        if not self.offload_gradients:
            self._gradients_in()
        if self.stream is not None:
            self.stream.synchronize()  # the CPU reads the gradients next
        self.inner.step()
        if self.stream is not None:  # whatever the device queued after the last gradient copy reads the old weights
            self.stream.wait_stream(torch.cuda.current_stream(self.params[0].device))
        with self._side():
            for _, p, h in self._pairs():
                p.detach().copy_(h, non_blocking=True)
        if self.stream is not None:  # the next forward pass waits for the weights on the device, the host does not
            torch.cuda.current_stream(self.params[0].device).wait_stream(self.stream)
        self.versions = [p._version for p in self.params]
        return loss


def host_step(cfg: Any, params: list, build: Callable[[list], Any], device: torch.device,
              emit: Callable[..., None], processes: int = 1) -> Any:
    """The run's optimizer: `build(params)`, or with optimizer_cpu_offload_method 'cpu' the same optimizer built
    over CPU copies of `params` (HostStepOptimizer)."""
    if getattr(cfg, "optimizer_cpu_offload_method", "none") != "cpu":
        return build(params)
    import psutil

    gradients = bool(getattr(cfg, "optimizer_offload_gradients", False))
    if gradients and processes > 1:
        raise ValueError(f"optimizer_offload_gradients with {processes} processes: each gradient leaves the device "
                         "as the backward pass makes it, before the processes could average it; set "
                         "optimizer_offload_gradients to false (optimizer_cpu_offload_method 'cpu' works with "
                         "several processes), or train on one")
    optimizer = HostStepOptimizer(params, build, device, offload_gradients=gradients)
    pinned, free = optimizer.bytes(), psutil.virtual_memory().available
    where = "pinned CPU memory" if device.type == "cuda" else "CPU memory (no CUDA device: nothing is saved)"
    emit("info", message=f"optimizer_cpu_offload_method 'cpu': the {cfg.optimizer} optimizer steps in CPU memory"
         + (", each gradient leaves the device as the backward pass makes it (optimizer_offload_gradients)"
            if gradients else "")
         + f"; the weights' copies and gradient buffers take {pinned / 2**30:.2f} GiB of {where}, its state comes "
         f"with the first step ({free / 2**30:.1f} GiB of CPU memory free)", offloaded_bytes=pinned)
    return optimizer
