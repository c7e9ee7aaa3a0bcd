"""A dataset entry's `caption_shuffle` block (SimpleTuner's DATALOADER.md): shuffled variants of tag captions, made
when the captions are read (data/captions.py), encoded with the others before training, one drawn per sample.

SimpleTuner's keys and defaults. The seed: the block's, else the run's `seed`, else 0, so the same caption gets
the same variants on every start and the text cache is reused.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict

from difftune.config.fields import UnsetSpellings, field

SPLITS = ("comma", "space", "period")


class CaptionShuffleOptions(UnsetSpellings):  # "" and "none" as null, as in config.json
    """Shuffled variants of each caption's tags, drawn from with the caption itself."""

    model_config = ConfigDict(extra="forbid")

    enable: bool = field(False, "Make shuffled variants of each caption (off: the block changes nothing).", "data")
    count: int = field(1, "Shuffled variants per caption (fewer when its tags have fewer distinct orders).", "data",
                       ge=1)
    seed: int | None = field(None, "Seed of the shuffles (empty: the run's seed, else 0). The same caption gets the "
                             "same variants on every start, so the text cache is reused.", "data")
    split_on: Literal[SPLITS] = field(  # type: ignore[valid-type]
        "comma", "What separates the tags: 'comma' (joined again with ', '), 'space' or 'period' (sentences).", "data")
    position_start: int = field(0, "The first N tags keep their place (the subject or trigger first); the rest are "
                                "shuffled. A caption with fewer than N + 2 tags is not shuffled.", "data", ge=0)
    include_original: bool = field(True, "Keep the caption as written among its variants. Off: only the shuffled "
                                   "variants (a caption that cannot be shuffled is kept, with a note).", "data")
