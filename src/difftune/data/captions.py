"""Captions by strategy: textfile, filename, instanceprompt, parquet (or JSONL) tables.

Each image gets a tuple of captions (one is drawn per sample during training) or a problem saying
why it has none. The caption filters (caption_filter_list, data/caption_filter.py) come next, on the
captions read from the data only; instance-prompt options are applied last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from difftune.data.caption_filter import CaptionFilter


@dataclass(frozen=True)
class CaptionResult:
    captions: tuple[str, ...] | None
    problem: str | None = None  # why the image is left out
    note: str | None = None  # used, but the user should know
    size: tuple[int, int] | None = None  # from a table's width/height columns
    changed: int = 0  # captions the caption filters changed
    emptied: int = 0  # ... of which they left nothing


@dataclass(frozen=True)
class CaptionRule:
    strategy: str
    instance_prompt: str | None = None
    prepend_instance_prompt: bool = False
    only_instance_prompt: bool = False
    split_lines: bool = True  # textfile: each non-empty line a caption (False: disable_multiline_split)
    filters: CaptionFilter | None = None  # caption_filter_list of the dataset's text_embeds entry


def from_textfile(path: Path, split_lines: bool = True) -> CaptionResult:
    txt = path.with_suffix(".txt")
    if not txt.is_file():
        return CaptionResult(None, f"no caption file {txt.name} (caption_strategy textfile needs one beside each image)")
    try:
        text = txt.read_text(encoding="utf-8-sig")  # -sig: an editor's byte-order mark is not caption text
    except (OSError, UnicodeDecodeError) as e:
        return CaptionResult(None, f"caption file {txt.name} unreadable: {e}")
    if not split_lines:  # disable_multiline_split: the whole file is one caption, its line breaks kept
        return CaptionResult((text.strip(),)) if text.strip() else CaptionResult(
            ("",), note="empty caption file: trained with an empty prompt")
    lines = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not lines:
        return CaptionResult(("",), note="empty caption file: trained with an empty prompt")
    return CaptionResult(lines)


def from_filename(path: Path) -> CaptionResult:
    """The file's stem with each underscore a space, exactly as SimpleTuner's prepare_instance_prompt_from_filename:
    hyphens stay ('t-shirt', 'close-up'), so a dataset captioned by its file names trains on the same captions."""
    return CaptionResult((path.stem.replace("_", " "),))


class CaptionTable:
    """A parquet or JSONL table: file name -> captions (and size)."""

    def __init__(self, path: Path, columns: Any):
        self.columns = columns
        rows = _read_rows(path)
        missing = [c for c in (columns.filename_column, columns.caption_column) if rows and c not in rows[0]]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(missing)}; columns are {', '.join(rows[0])}")
        self.rows: dict[str, dict[str, Any]] = {}
        for row in rows:
            name = str(row[columns.filename_column])
            self.rows[name if columns.identifier_includes_extension else Path(name).stem] = row

    def lookup(self, path: Path, root: Path) -> CaptionResult:
        rel = path.relative_to(root)
        keys = [str(rel), path.name] if self.columns.identifier_includes_extension else [str(rel.with_suffix("")), path.stem]
        row = next((self.rows[k] for k in keys if k in self.rows), None)
        if row is None:
            return CaptionResult(from_filename(path).captions, note="no row in the parquet table: used the file name as caption")
        captions = _as_captions(row.get(self.columns.caption_column))
        if not captions and self.columns.fallback_caption_column:
            captions = _as_captions(row.get(self.columns.fallback_caption_column))
        size = None
        if self.columns.width_column and self.columns.height_column:
            try:
                size = (int(row[self.columns.width_column]), int(row[self.columns.height_column]))
            except (KeyError, TypeError, ValueError):
                size = None
        if not captions:
            return CaptionResult(("",), note="empty caption in the parquet table: trained with an empty prompt", size=size)
        return CaptionResult(captions, size=size)


def _as_captions(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value.strip(),) if value.strip() else ()
    try:
        return tuple(str(v).strip() for v in value if str(v).strip())
    except TypeError:
        return (str(value),)


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ValueError(f"parquet caption table {path} not found; fix parquet.path")
    if path.suffix.lower() in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {number} is not JSON: {e.msg}") from e
        return rows
    import pyarrow.parquet as pq  # imported here: only parquet users need it

    return pq.read_table(path).to_pylist()


def apply_instance_prompt(result: CaptionResult, rule: CaptionRule) -> CaptionResult:
    if result.captions is None or not rule.instance_prompt:
        return result
    if rule.only_instance_prompt:
        captions: tuple[str, ...] = (rule.instance_prompt,)
    elif rule.prepend_instance_prompt:
        captions = tuple(f"{rule.instance_prompt} {c}".strip() for c in result.captions)
    else:
        return result
    return replace(result, captions=captions)


def apply_filters(result: CaptionResult, rule: CaptionRule) -> CaptionResult:
    """The captions with the caption filters applied. A caption they empty is dropped when the image has others
    (lines of its caption file), and otherwise trained as an empty caption, as an empty caption file is; either
    way the note says so. Instance prompts are the user's own text: never filtered (applied after this)."""
    if rule.filters is None or result.captions is None:
        return result
    filtered = tuple(rule.filters.apply(c) for c in result.captions)
    changed = sum(before != after for before, after in zip(result.captions, filtered, strict=True))
    if not changed:
        return result
    emptied = sum(1 for before, after in zip(result.captions, filtered, strict=True) if before and not after)
    kept = tuple(c for c in filtered if c)
    note = None
    if emptied and not kept:
        instead = f"instance_prompt {rule.instance_prompt!r} alone" if rule.prepend_instance_prompt else \
            "an empty prompt"
        note = f"caption_filter_list left nothing of its caption: trained with {instead}"
    elif emptied:
        note = f"caption_filter_list left nothing of {emptied} of its {len(filtered)} captions: those are not used"
    notes = "; ".join(n for n in (result.note, note) if n) or None
    return replace(result, captions=kept or ("",), note=notes, changed=changed, emptied=emptied)


def caption(path: Path, root: Path, rule: CaptionRule, table: CaptionTable | None) -> CaptionResult:
    if rule.strategy == "textfile":
        result = from_textfile(path, rule.split_lines)
    elif rule.strategy == "filename":
        result = from_filename(path)
    elif rule.strategy == "instanceprompt":
        result = CaptionResult((rule.instance_prompt or "",))
    else:
        assert table is not None
        result = table.lookup(path, root)
    if rule.strategy != "instanceprompt" and not rule.only_instance_prompt:  # else no caption of the data is used
        result = apply_filters(result, rule)
    return apply_instance_prompt(result, rule)
