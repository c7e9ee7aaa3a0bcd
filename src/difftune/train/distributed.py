"""Several processes (torchrun / accelerate launch): who does what, and the few collectives we need.

Rules: every process loads the model and trains its slice of each global batch; caching work is split
between processes (each encodes every n-th item, then all wait and read the shared cache); process 0
alone writes the event log, checkpoints, samples and the final adapter, and reads commands, which it
then broadcasts so every process stops at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Ranks:
    index: int = 0
    count: int = 1
    accelerator: Any = None

    @property
    def main(self) -> bool:
        return self.index == 0

    def shard(self, items: list) -> list:
        """This process's share of a work list (every count-th item)."""
        return items[self.index :: self.count]

    def barrier(self) -> None:
        if self.count > 1:
            self.accelerator.wait_for_everyone()

    def gather(self, value: Any) -> list[Any]:
        if self.count == 1:
            return [value]
        from accelerate.utils import gather_object

        return gather_object([value])

    def broadcast(self, value: Any) -> Any:
        """Process 0's value, on every process."""
        if self.count == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]

    def mean(self, value: float) -> float:
        return self.means([value])[0]

    def means(self, values: list[float]) -> list[float]:
        """Each value's mean over the processes, in one collective."""
        if self.count == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        return [float(v) for v in self.accelerator.reduce(tensor, reduction="mean").tolist()]


def ranks_of(accelerator: Any) -> Ranks:
    return Ranks(accelerator.process_index, accelerator.num_processes, accelerator)


def outside(params: list[torch.nn.Parameter], module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trained parameters that are not `module`'s own (LyCORIS's network wraps the layers from outside): DDP, which
    wraps `module`, neither sees nor averages them."""
    own = {id(p) for p in module.parameters()}
    return [p for p in params if id(p) not in own]


def average_gradients(params: list[torch.nn.Parameter], ranks: Ranks) -> None:
    """Average `params`' gradients over the processes, in one collective, as DDP averages the parameters it wraps
    (called once per optimizer step, after the last micro-batch's backward). A parameter without a gradient
    contributes zeros, so every process sends the same sizes."""
    if ranks.count == 1 or not params:
        return
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= ranks.count
    start = 0
    for p in params:
        p.grad.copy_(flat[start : start + p.numel()].view_as(p.grad))
        start += p.numel()
