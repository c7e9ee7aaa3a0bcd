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
