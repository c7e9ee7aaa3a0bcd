"""Request limits, applied before any route sees a request: a body size limit, and JSON bodies that the
routes can take without surprises (UTF-8, finite numbers, integers of sane length, shallow nesting).

The JSON parser of the framework would turn a NaN into a value that cannot be answered back as JSON,
a 1e999 into infinity and a 100 000-deep list into a RecursionError (a 500); these are answered here
with a 4xx and a message instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from difftune.config.jsonfile import duplicates_hook, syntax_problem

MAX_BODY_BYTES = 1024 * 1024  # a config and its dataset list are a few kB
MAX_DEPTH = 32  # a config nests two levels (a dataset's parquet block in the list)
MAX_INT_DIGITS = 100


class BadJson(ValueError):
    pass


def _constant(name: str) -> Any:
    raise BadJson(f"{name} is not a number JSON allows; give a finite number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJson(f"{text} is too large a number")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BadJson(f"a number of {len(text)} digits is too large")
    return int(text)


def parse_json(data: bytes | str, path: Path | str = "", what: str = "", duplicates: list[str] | None = None) -> Any:
    """The JSON value, or BadJson with a message (not UTF-8, not JSON, non-finite, too deep). With `duplicates`, a
    key written twice in one object is appended there as a problem of `path` (the `what` file), as the loader
    says it (config/jsonfile.py)."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8-sig")  # a BOM (Windows Notepad), as the loader reads it (config/jsonfile.py)
        except UnicodeDecodeError as e:
            raise BadJson(f"the text is not UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(data, parse_constant=_constant, parse_float=_float, parse_int=_int,
                           object_pairs_hook=duplicates_hook(path, what, duplicates))
    except BadJson:
        raise
    except RecursionError:
        raise BadJson(f"the JSON nests deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as e:
        raise BadJson(syntax_problem(data, e)) from None
    except ValueError as e:
        raise BadJson(f"not valid JSON: {e}") from None
    if _depth(value) > MAX_DEPTH:
        raise BadJson(f"the JSON nests deeper than {MAX_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    """Nesting depth, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                return depth
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


class BodyLimit:
    """ASGI middleware: reads a request's body (at most `limit` bytes, else 413), checks a JSON body
    with `parse_json` (else 400), then hands the route the body it read."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length", "")
        if length and (not length.isdigit() or len(length) > 12):
            return await _answer(send, 400, "the Content-Length header is not a number")
        if length and int(length) > self.limit:
            return await _answer(send, 413, f"the request body is larger than {self.limit} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _answer(send, 413, f"the request body is larger than {self.limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if body and headers.get("content-type", "").split(";")[0].strip() == "application/json":
            try:
                parse_json(body)
            except BadJson as e:
                return await _answer(send, 400, f"bad request: the body: {e}")
        given = False

        async def replay():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def _answer(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
