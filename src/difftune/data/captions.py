"""Captions by strategy: textfile, filename, instanceprompt, parquet (or JSONL) tables.

Each image gets a tuple of captions (one is drawn per sample during training) or a problem saying
why it has none. The caption filters (caption_filter_list, data/caption_filter.py) come next, on the
captions read from the data only, then the shuffled variants of their tags (caption_shuffle); instance-prompt
options are applied last, so a trigger word stays first.
"""

from __future__ import annotations

import codecs
import json
import math
import random
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
    shuffle: CaptionShuffle | None = None  # caption_shuffle, when enabled


@dataclass(frozen=True)
class CaptionShuffle:
    """caption_shuffle (config/caption_shuffle_keys.py): `count` shuffled variants of each caption's tags."""

    count: int = 1
    seed: int = 0
    split_on: str = "comma"
    position_start: int = 0
    include_original: bool = True


_SPLIT = {"comma": (",", ", "), "space": (" ", " "), "period": (".", ". ")}  # split_on -> (separator, joiner)


def shuffled(text: str, rule: CaptionShuffle) -> tuple[str, ...]:
    """Up to `rule.count` distinct orders of the caption's tags other than its own, the first `position_start` kept
    in place; () when it has fewer than position_start + 2 tags. Drawn from a generator seeded with the seed and the
    caption, so the variants do not depend on the order the files are read in, nor on anything else."""
    separator, joiner = _SPLIT[rule.split_on]
    tags = [t.strip() for t in text.split(separator) if t.strip()]
    if len(tags) < rule.position_start + 2:
        return ()
    fixed, rest = tags[:rule.position_start], tags[rule.position_start:]
    end = "." if rule.split_on == "period" and text.rstrip().endswith(".") else ""
    own = joiner.join(tags) + end
    generator = random.Random(f"{rule.seed}\x00{text}")  # str seeds hash with SHA-512: the same on every start
    variants: list[str] = []
    for _ in range(20 * rule.count):  # few tags have few orders: stop trying after a while
        order = list(rest)
        generator.shuffle(order)
        variant = joiner.join(fixed + order) + end
        if variant != own and variant not in variants:
            variants.append(variant)
            if len(variants) == rule.count:
                break
    return tuple(variants)


def apply_shuffle(result: CaptionResult, rule: CaptionRule) -> CaptionResult:
    """Each caption followed by its shuffled variants (without it when include_original is off, unless it has
    none: then it stays, and the note says so)."""
    shuffle = rule.shuffle
    if shuffle is None or result.captions is None:
        return result
    out: list[str] = []
    kept = 0
    for text in result.captions:
        variants = shuffled(text, shuffle)
        if shuffle.include_original or not variants:
            out.append(text)
            kept += not shuffle.include_original
        out += [v for v in variants if v not in out]
    if not kept:
        return replace(result, captions=tuple(out))
    note = (f"caption_shuffle: {'its caption has' if len(result.captions) == 1 else f'{kept} of its captions have'} "
            f"no other order of its tags (fewer than {shuffle.position_start + 2} tags split on {shuffle.split_on}, or "
            "all alike): trained as written, although include_original is off")
    return replace(result, captions=tuple(out), note="; ".join(n for n in (result.note, note) if n))


def from_textfile(path: Path, split_lines: bool = True, empty: str = "an empty prompt") -> CaptionResult:
    """The captions of the .txt file beside the image; `empty` says what an empty file trains with, for its note."""
    txt = _caption_file(path)
    if txt is None:
        return CaptionResult(None, f"no caption file {path.with_suffix('.txt').name} (caption_strategy textfile "
                                   "needs one beside each image)")
    try:
        data = txt.read_bytes()
        # a byte-order mark says the encoding (Windows Notepad's "Unicode" is UTF-16); without one, UTF-8
        # (-sig: an editor's UTF-8 byte-order mark is not caption text)
        if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
            text = data.decode("utf-32")
        elif data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            text = data.decode("utf-16")
        else:
            text = data.decode("utf-8-sig")
    except OSError as e:
        return CaptionResult(None, f"caption file {txt.name} unreadable: {e}")
    except UnicodeDecodeError as e:
        return CaptionResult(None, f"caption file {txt.name} unreadable: {e}; save it as UTF-8")
    note = f"empty caption file: trained with {empty}"
    if not split_lines:  # disable_multiline_split: the whole file is one caption, its line breaks kept
        return CaptionResult((text.strip(),)) if text.strip() else CaptionResult(("",), note=note)
    lines = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not lines:
        return CaptionResult(("",), note=note)
    return CaptionResult(lines)


def _caption_file(path: Path) -> Path | None:
    """The image's .txt file, whatever the case of its extension (IMG_1.JPG's caption is often IMG_1.TXT): the
    usual spellings are tried, not a listing of the folder per image."""
    for suffix in (".txt", ".TXT", ".Txt"):
        txt = path.with_suffix(suffix)
        if txt.is_file():
            return txt
    return None


def _empty_trains_with(rule: CaptionRule) -> str:
    """What an image whose caption is empty is trained with, for the notes that say so."""
    if rule.instance_prompt and (rule.prepend_instance_prompt or rule.only_instance_prompt):
        return f"instance_prompt {rule.instance_prompt!r} alone"
    return "an empty prompt"


def from_filename(path: Path) -> CaptionResult:
    """The file's stem with each underscore a space, exactly as SimpleTuner's prepare_instance_prompt_from_filename:
    hyphens stay ('t-shirt', 'close-up'), so a dataset captioned by its file names trains on the same captions."""
    return CaptionResult((path.stem.replace("_", " "),))


class CaptionTable:
    """A parquet or JSONL table: file name -> captions (and size)."""

    def __init__(self, path: Path, columns: Any):
        self.path, self.columns = path, columns
        rows = _read_rows(path)
        found = list(dict.fromkeys(k for row in rows for k in row))  # a JSONL row may leave a column out
        keys = {"filename_column": columns.filename_column, "caption_column": columns.caption_column,
                "fallback_caption_column": columns.fallback_caption_column, "width_column": columns.width_column,
                "height_column": columns.height_column}
        missing = [f"{key} {column!r}" for key, column in keys.items() if rows and column and column not in found]
        if missing:
            raise ValueError(f"{path}: no column named by {', '.join(missing)}; its columns are {', '.join(found)}")
        for number, row in enumerate(rows, 1):  # here, where the caller says it as the dataset's error
            for column in (columns.caption_column, columns.fallback_caption_column):
                if isinstance(row.get(column or ""), dict):
                    raise ValueError(f"{path}: row {number}: caption column {column!r} holds an object "
                                     f"({json.dumps(row[column])[:80]}): name the column of caption text, or of a "
                                     "list of captions")
        # each row by its identifier as written (a path below the dataset, or a bare name), and by the bare name
        # alone: a bare name that several rows share (a/cat, b/cat) is taken only by the path that names one of them
        self.rows: dict[str, dict[str, Any]] = {}
        self.bare: dict[str, list[str]] = {}  # bare name -> the identifiers that end in it
        self.twice: dict[str, int] = {}  # identifiers of several rows: the last one is used
        for number, row in enumerate(rows, 1):
            if row.get(columns.filename_column) in (None, ""):
                raise ValueError(f"{path}: row {number} has no {columns.filename_column!r} (filename_column); give "
                                 "each row the file it captions")
            name = str(row[columns.filename_column]).replace("\\", "/").removeprefix("./")
            if name in self.rows:
                self.twice[name] = self.twice.get(name, 1) + 1
            else:
                bare = Path(name).name if columns.identifier_includes_extension else Path(name).stem
                self.bare.setdefault(bare, []).append(name)
            self.rows[name] = row

    def unmatched(self, files: list[Path], root: Path) -> list[str]:
        """The identifiers of rows that name none of `files` (a renamed or deleted image: said, not silently
        unused), as lookup matches them: by the path below `root`, with or without the extension, or the bare name."""
        with_extension = self.columns.identifier_includes_extension
        keys, bares = set(), set()
        for path in files:
            rel = path.relative_to(root)
            keys |= {rel.as_posix()} if with_extension else {rel.as_posix(), rel.with_suffix("").as_posix()}
            bares.add(path.name if with_extension else path.stem)
        return [name for name in self.rows
                if name not in keys and (Path(name).name if with_extension else Path(name).stem) not in bares]

    def lookup(self, path: Path, root: Path, empty: str = "an empty prompt") -> CaptionResult:
        rel = path.relative_to(root)
        if self.columns.identifier_includes_extension:
            keys, bare = [rel.as_posix()], path.name
        else:  # the identifier without the extension (a table that writes it anyway matches too)
            keys, bare = [rel.with_suffix("").as_posix(), rel.as_posix()], path.stem
        name = next((k for k in keys if k in self.rows), None)
        if name is None and len(self.bare.get(bare, [])) > 1:
            return CaptionResult(from_filename(path).captions, note=f"{len(self.bare[bare])} rows of the parquet table "
                                 f"are named {bare!r} and none {keys[0]!r}: used the file name as caption; name each "
                                 "file by its path below the dataset in the table")
        if name is None and bare in self.bare:
            name = self.bare[bare][0]
        if name is None:
            hint = ""
            if self.columns.identifier_includes_extension and {rel.with_suffix("").as_posix(), path.stem} & self.rows.keys():
                hint = (f" (a row names it without its extension {path.suffix!r}: set identifier_includes_extension "
                        "false in the parquet block)")
            return CaptionResult(from_filename(path).captions,
                                 note=f"no row in the parquet table{hint}: used the file name as caption")
        row = self.rows[name]
        captions = _as_captions(row.get(self.columns.caption_column))
        if not captions and self.columns.fallback_caption_column:
            captions = _as_captions(row.get(self.columns.fallback_caption_column))
        twice = self.twice.get(name, 0)
        note = f"{twice} rows of the parquet table name it: the last one is used" if twice else None
        size = None
        if self.columns.width_column and self.columns.height_column:
            try:
                size = (int(row[self.columns.width_column]), int(row[self.columns.height_column]))
            except (KeyError, TypeError, ValueError):
                size = None
        if not captions:
            empty_note = f"empty caption in the parquet table: trained with {empty}"
            return CaptionResult(("",), note="; ".join(n for n in (note, empty_note) if n), size=size)
        return CaptionResult(captions, size=size, note=note)


def _as_captions(value: Any) -> tuple[str, ...]:
    """The captions of a table cell: a string, or a list of them; empty, null and NaN values are no caption (a
    list's null items too: pandas writes a missing caption as NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ()
    if isinstance(value, str):
        return (value.strip(),) if value.strip() else ()
    if isinstance(value, list | tuple):
        return tuple(text for item in value for text in _as_captions(item))
    return (str(value),)


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """The table's rows: a parquet file, JSON Lines (one object per line), or a .json file of one array of objects
    (or JSON Lines too)."""
    if not path.is_file():
        raise ValueError(f"parquet caption table {path} not found; fix parquet.path")
    if path.suffix.lower() not in (".jsonl", ".json"):
        import pyarrow.parquet as pq  # imported here: only parquet users need it

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON (line {e.lineno}): {e.msg}") from e
        where = "item"
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {number} is not JSON: {e.msg}") from e
        where = "row"
    bad = next((i for i, row in enumerate(rows, 1) if not isinstance(row, dict)), None)
    if bad is not None:
        raise ValueError(f"{path}: {where} {bad} is not an object ({{\"filename\": ..., \"caption\": ...}}); each "
                         "row must be one")
    return rows


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
        note = f"caption_filter_list left nothing of its caption: trained with {_empty_trains_with(rule)}"
    elif emptied:
        note = f"caption_filter_list left nothing of {emptied} of its {len(filtered)} captions: those are not used"
    notes = "; ".join(n for n in (result.note, note) if n) or None
    return replace(result, captions=kept or ("",), note=notes, changed=changed, emptied=emptied)


def caption(path: Path, root: Path, rule: CaptionRule, table: CaptionTable | None) -> CaptionResult:
    if rule.strategy == "textfile":
        result = from_textfile(path, rule.split_lines, _empty_trains_with(rule))
    elif rule.strategy == "filename":
        result = from_filename(path)
    elif rule.strategy == "instanceprompt":  # the prompt as it is: prepend_instance_prompt would double it
        return CaptionResult((rule.instance_prompt or "",))
    else:
        assert table is not None
        result = table.lookup(path, root, _empty_trains_with(rule))
    if not rule.only_instance_prompt:  # else no caption of the data is used
        result = apply_shuffle(apply_filters(result, rule), rule)
    return apply_instance_prompt(result, rule)
