"""The wizard's terminal: a question answered on stdin (end of input cancels), and values shown as typed."""

from __future__ import annotations

import json
from typing import Any


class Cancelled(Exception):
    pass


def _input(prompt: str) -> str:
    try:
        return input(prompt)
    except EOFError as e:
        raise Cancelled from e


def _yes(prompt: str) -> bool:
    return _input(prompt).strip().lower() in ("", "y", "yes")


def _show(value: Any) -> str:
    return "empty" if value is None else json.dumps(value) if isinstance(value, list | dict) else str(value)
