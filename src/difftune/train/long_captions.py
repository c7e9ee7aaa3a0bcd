"""Captions longer than the prompt length, as the text cache meets them.

A caption over the pipeline's `max_sequence_length` (tokenizer_max_length) is cut at its end when it is encoded
(the models' own rule). diffusers' Lumina2 pipeline says so with a warning that quotes the cut-off part of the whole
padded batch: one 3000-word caption among 15 short ones printed the long one's tail and about a megabyte of `<pad>`
for the others. Here that warning is caught while the caches fill; the run says instead, once, how many captions
were cut, naming a few, so the user can shorten them or raise tokenizer_max_length."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

CUT = "part of your input was truncated because"  # diffusers' wording (Lumina2Pipeline._get_gemma_prompt_embeds)


class _Catch(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.fired = False

    def filter(self, record: logging.LogRecord) -> bool:
        if CUT in record.getMessage():
            self.fired = True
            return False
        return True


class LongCaptions:
    """`wrap(encode)` watches each encoding batch; `cut` holds the longest caption of each batch diffusers cut."""

    def __init__(self) -> None:
        self.catch = _Catch()
        self.cut: list[str] = []

    def wrap(self, encode: Callable[[list[str], Any], Any]) -> Callable[[list[str], Any], Any]:
        def watched(prompts: list[str], images: Any) -> Any:
            self.catch.fired = False
            result = encode(prompts, images)
            if self.catch.fired:  # the batch held at least one: its longest caption is the one to name
                self.cut.append(max(prompts, key=len))
            return result
        return watched

    def message(self) -> str | None:
        if not self.cut:
            return None
        shown = "; ".join(repr(c[:60] + ("..." if len(c) > 60 else "")) for c in self.cut[:3])
        more = f" and {len(self.cut) - 3} more" if len(self.cut) > 3 else ""
        return (f"{len(self.cut)} caption(s) are longer than the prompt length and were cut at their end (for "
                f"example {shown}{more}); shorten them, or raise tokenizer_max_length")


@contextlib.contextmanager
def watching() -> Iterator[LongCaptions]:
    """While the caches fill: diffusers' truncation warnings are caught on its handlers, not printed."""
    from diffusers.utils import logging as diffusers_logging

    watcher = LongCaptions()
    root = diffusers_logging._get_library_root_logger()
    targets = [*root.handlers] or [root]
    for target in targets:
        target.addFilter(watcher.catch)
    try:
        yield watcher
    finally:
        for target in targets:
            target.removeFilter(watcher.catch)
