"""Batches for the loop, read ahead (`dataloader_prefetch`, on by default).

A background thread reads the next `dataloader_prefetch_qlen` batches from the caches (verified reads,
stacking, caption choice) while the accelerator computes; on CUDA it also copies them into pinned memory, so
the loop's copy to the device is asynchronous (`non_blocking`) and the host never waits on the disk or on a
pageable copy.

What makes read-ahead safe to resume: each batch carries `position`, the sampler's state just after it was
drawn. The loop records the position of the last batch it *consumed* (`TrainState.position`), and the
checkpoint saves that, not the sampler's own state, which is ahead by the batches still in the queue. The
batches themselves are the same as without read-ahead: caption choices come from (seed, epoch, index), and
the thread draws nothing from torch's RNG.

Not threaded when the data encodes latents on the fly (`TrainingData.encode`): the VAE would then run in two
threads, and its sampling draws from torch's global RNG, whose order must stay that of a synchronous run.
An error in the thread (every item left out, a damaged cache) is raised again in the loop, unchanged.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from difftune.data.batches import Batch


@dataclass
class _Failed:
    error: BaseException


_END = object()


class Prefetcher:
    """An iterator of device batches from `source`, `depth` read ahead in a thread (or none: `threaded`
    False reads each batch when asked, as the loop did before)."""

    def __init__(self, source: Iterable[Batch], device: torch.device, depth: int = 2, threaded: bool = True):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self._source = iter(source)
        self._threaded = threaded
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._fill, name="difftune-prefetch", daemon=True)
            self._thread.start()

    def _put(self, item: Any) -> bool:
        """Queue `item`, waiting for room; False when the loop has stopped listening."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self) -> None:
        try:
            for batch in self._source:
                if not self._put(batch.pinned() if self.pin else batch):
                    return
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which raises it
            self._put(_Failed(e))

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if not self._threaded:
            batch = next(self._source)
        else:
            item = self._queue.get()
            if isinstance(item, _Failed):
                self.close()
                raise item.error
            if item is _END:
                raise StopIteration
            batch = item
        return batch.to(self.device, non_blocking=self.pin)

    def close(self) -> None:
        """Stop the thread (it may be waiting for room in the queue) and drop what it read ahead."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


def feed(run: Any) -> Prefetcher:
    """The loop's batches for `run`, read ahead as its config says."""
    cfg = run.cfg
    threaded = cfg.dataloader_prefetch and run.data.encode is None
    return Prefetcher(run.data, run.accelerator.device, cfg.dataloader_prefetch_qlen, threaded)
