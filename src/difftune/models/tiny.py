"""Offline building blocks for tiny random-init models (tests and the demo).

Nothing here downloads: tokenizers are built from a character vocabulary, models from small configs.
Models are written in the exact hub folder layout so the real `from_pretrained` path is exercised.
"""

from __future__ import annotations

import os
import shutil
import string
import tempfile
from collections.abc import Callable
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


def char_vocab() -> dict[str, int]:
    """Special tokens, byte-fallback tokens, then printable characters and the SentencePiece space."""
    tokens = SPECIAL_TOKENS + [f"<0x{i:02X}>" for i in range(256)]
    tokens += list(string.ascii_letters + string.digits + string.punctuation) + ["\u2581"]
    return {tok: i for i, tok in enumerate(tokens)}


def gemma_tokenizer():
    """A Gemma tokenizer over `char_vocab()`: same class, normalizer and special tokens as the real one."""
    from transformers import GemmaTokenizer

    return GemmaTokenizer(vocab=char_vocab(), merges=[])


def difftune_home() -> Path:
    """Where built tiny models live: $DIFFTUNE_HOME or ~/.cache/difftune."""
    return Path(os.environ.get("DIFFTUNE_HOME") or Path.home() / ".cache" / "difftune")


def ensure_built(name: str, build: Callable[[Path], None], marker: str = "model_index.json") -> Path:
    """Build once into a temporary folder beside the target, then rename: never a half-built model.
    `marker`: the file whose presence means the folder is complete."""
    target = difftune_home() / "tiny" / name
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / marker).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
