"""Values that config keys spell as strings or files: resolutions, sizes, JSON files, prompt libraries.
Each raises ValueError with the reason; the schema turns it into the key's error."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from difftune.files import read_settings_text


def parse_resolutions(value: str) -> list[tuple[int, int]]:
    """'1024x768' or '512' or '512x512,768x768' -> [(width, height), ...]."""
    out = []
    for part in str(value).split(","):
        written = part.strip()
        part = re.sub(r"(\d+)\.0*(?=x|$)", r"\1", written.lower())  # "64.0" (a number written by a tool) is 64
        m = re.fullmatch(r"(\d+)(?:x(\d+))?", part)
        if not m:
            whole = " (a whole number of pixels)" if "." in part and re.fullmatch(r"[\d.x]+", part) else ""
            raise ValueError(f"{written!r} is not a resolution{whole}; write WIDTHxHEIGHT such as 1024x1024, or one "
                             "number such as 1024")
        w = int(m.group(1))
        h = int(m.group(2) or m.group(1))
        out.append((w, h))
    return out


def snap_size(w: int, h: int, multiple: int) -> tuple[int, int]:
    """The nearest size whose sides are positive multiples of `multiple` (854 -> 848 for 16); a side halfway between
    two goes up (Python's round() takes the even one: 40x24 became 32x32, a landscape turned square)."""
    return tuple(max(multiple, math.floor(side / multiple + 0.5) * multiple)  # type: ignore[return-value]
                 for side in (w, h))


def read_json_file(path: str, what: str) -> object:
    """A JSON file named by a config key; ValueError with the reason (the schema turns it into the key's error)."""
    try:
        return json.loads(read_settings_text(path))  # a BOM (Windows editors) read as without
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON (line {e.lineno}): {e.msg}") from e


def prompt_library(path: str) -> dict[str, str]:
    """A user prompt library: a JSON object of name -> prompt."""
    data = read_json_file(path, "prompt library")
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"prompt library {path} must be a JSON object of name -> prompt text")
    bad = [k for k in data if not re.fullmatch(r"[\w.-]+", k)]
    if bad:
        raise ValueError(f"prompt library {path}: names {bad} must be letters, digits, '_', '-' or '.' (used in file names)")
    # a sample's file name is the name plus up to ~60 characters (step, size, -1ofN, -ema, -vs-base, .tmp); most
    # file systems stop at 255 bytes
    long = [k for k in data if len(k.encode()) > MAX_PROMPT_NAME]
    if long:
        raise ValueError(f"prompt library {path}: the names {[k[:40] + '...' for k in long]} are longer than "
                         f"{MAX_PROMPT_NAME} characters; they name the sample files, so shorten them")
    # the samples of validation_prompt and of the empty prompt carry these names: an entry of the same name would
    # overwrite the other's file (unconditional) or share its label in the trackers (validation)
    reserved = [k for k in data if k.lower() in RESERVED_PROMPT_NAMES]
    if reserved:
        raise ValueError(f"prompt library {path}: the names {reserved} are taken by the samples of validation_prompt "
                         "and of the empty prompt ('validation', 'unconditional'); rename those entries")
    return data


RESERVED_PROMPT_NAMES = ("validation", "unconditional")
MAX_PROMPT_NAME = 120


def resolution_value(v: object) -> object:
    """validation_resolution as written (resolution_text) in its text form, every size checked positive ("" is
    unset); a value of another type is left for the schema to refuse."""
    v = resolution_text(v)
    if v in (None, ""):
        return None
    if not isinstance(v, str):
        return v
    for w, h in parse_resolutions(v):
        if w <= 0 or h <= 0:
            raise ValueError(f"{v!r}: {w}x{h}: width and height must be positive")
    return v


def resolution_text(v: object) -> object:
    """validation_resolution as written in JSON -> its text form. A number (64) is the one-number form, as on the
    command line and in SimpleTuner (which passes config.json values on as command-line text); a whole float (64.0)
    too; a list is the comma-separated form. A fraction, or a float under 16, is a megapixel figure: refused."""
    if isinstance(v, float) and v.is_integer() and v >= 16:
        v = int(v)
    if isinstance(v, float):
        raise ValueError(f"{v!r} is not a size in pixels: write WIDTHxHEIGHT such as \"1024x1024\", or one whole "
                         "number for a square (megapixel sizes are a dataset's resolution_type 'area', not a "
                         "validation size)")
    if isinstance(v, list) and v and all(isinstance(x, str | int) and not isinstance(x, bool) for x in v):
        return ",".join(str(x) for x in v)
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


NAME_MAX = 255  # bytes of one file or folder name on the usual file systems (ext4, APFS, NTFS in UTF-16 units)
PATH_MAX = 4095  # bytes of a whole path (Linux)


def overlong_name(key: str, value: Any) -> str | None:
    """Why a path value cannot name anything (a part longer than NAME_MAX bytes: `exists()` raises
    'File name too long' there), or None. Keys naming files or folders only: a long prompt is no path."""
    pathy = "_dir" in key or "path" in key or key.endswith(("_file", "_library")) or key in (
        "init_lora", "resume_from_checkpoint", "conditioning_data", "data_backend_config", "lycoris_config",
        "caption_filter_list")  # cache_dir_vae, instance_data_dir, ...; not optimizer_config, tread_config, ...
    if not (pathy and isinstance(value, str)) or value.lstrip().startswith(("{", "[")):  # JSON written in place
        return None
    if len(value.encode()) > PATH_MAX:
        return f"the path is {len(value.encode())} bytes long, more than a file system allows ({PATH_MAX}); shorten it"
    longest = max(value.replace("\\", "/").split("/"), key=lambda part: len(part.encode()))
    size = len(longest.encode())
    if size <= NAME_MAX:
        return None
    return (f"a name in this path is {size} bytes long ({longest[:24]}...), more than a file system allows "
            f"({NAME_MAX}); shorten it")
