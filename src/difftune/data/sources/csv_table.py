"""Type 'csv' datasets: a CSV table of file locations (http(s) URLs, file:// URLs or paths) and captions,
downloaded into the dataset's folder with a caption file beside each file (config/source_csv_keys.py).

Each row's file is named by a hash of its location (16 hex digits) plus its extension, so names do not depend on
the order of downloads and a second run finds what the first one wrote. Downloads run in a few threads (they wait
on the network, not on the CPU); every file is written under a hidden temporary name in the folder, checked (an
image must open with PIL and pass `verify`, a clip must have a video extension), then renamed into place. The
folder is this table's alone: a manifest names the table, a folder holding other files is refused, and downloads
whose rows are gone from the table are removed, so the folder always trains on what the table lists now.
"""

from __future__ import annotations

import csv
import hashlib
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

from difftune.config.datasets import ImageDataset
from difftune.data.discovery import CLIP_SUFFIXES
from difftune.data.images import IMAGE_EXTENSIONS
from difftune.data.sources import LEFT_OUT, SourceError, open_folder, partial, save_manifest, write_if_changed

WORKERS = 8  # parallel downloads
ATTEMPTS = 4  # tries per URL on a connection error, a timeout, HTTP 408, 429 or 5xx
BACKOFF_S = 0.5  # first wait between tries, doubled each time (an HTTP Retry-After is used instead, up to 30 s)
TIMEOUT_S = (10, 60)  # connect, and between bytes of the answer
CHUNK = 1 << 16
STEM = re.compile(r"^[0-9a-f]{16}$")
# Content-Type -> extension, for a URL whose path has no usable one
CONTENT_TYPES = {
    "image/jpeg": ".jpg", "image/jpg": ".jpg", "image/pjpeg": ".jpg", "image/png": ".png", "image/webp": ".webp",
    "image/gif": ".gif", "image/bmp": ".bmp", "image/x-ms-bmp": ".bmp", "image/tiff": ".tiff", "image/avif": ".avif",
    "video/mp4": ".mp4", "video/quicktime": ".mov", "video/webm": ".webm", "video/x-matroska": ".mkv",
}
PIL_FORMATS = {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tiff",
               "AVIF": ".avif"}


class ItemError(Exception):
    """One row's file cannot be used; the message is the reason reported."""


@dataclass(frozen=True)
class Row:
    line: int  # the line of csv_file the row starts on, for reports
    location: str
    caption: str | None  # None with caption_strategy instanceprompt (no caption files)

    @property
    def stem(self) -> str:
        return hashlib.sha256(self.location.encode("utf-8")).hexdigest()[:16]


def shown(location: str) -> str:
    """A location fit for a log: no user:password, no query string (signed URLs carry their secret there)."""
    parts = urlsplit(location)
    if parts.scheme not in ("http", "https"):
        return location
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}" + ("?***" if parts.query else "")


def _scrub(text: str) -> str:
    """An error message without query strings or user:password (requests' messages quote the URL)."""
    text = re.sub(r"\?[^\s'\")]*", "?***", text)
    return re.sub(r"//[^/\s@]+@", "//***@", text)


def fetch(ds: ImageDataset, folder: Path, say: Callable[[str], None] = print) -> None:
    """Fill `folder` with the files of the rows of `ds.csv_file` (and their caption files with caption_strategy
    'csv'): what is already there is reused, the rest fetched; unusable rows are reported and skipped."""
    table = Path(str(ds.csv_file)).expanduser()
    rows, left_out = read_table(ds, table, lambda note: say(f"dataset {ds.id!r}: {note}"))
    identity = claim(ds, folder, table)
    suffixes = CLIP_SUFFIXES if ds.video is not None else IMAGE_EXTENSIONS
    present = {p.stem: p.name for p in folder.iterdir()
               if STEM.match(p.stem) and p.suffix.lower() in suffixes and p.is_file()}
    fetcher = Fetcher(folder, table.parent, video=ds.video is not None)
    try:
        outcomes = fetcher.run(rows, present)
    finally:
        fetcher.close()
    counts = {"fetched": 0, "reused": 0, "skipped": len(left_out)}
    kept: set[str] = set()
    for row, (status, detail) in zip(rows, outcomes, strict=True):
        counts[status] += 1
        if status == "skipped":
            say(f"dataset {ds.id!r}: skipped csv_file line {row.line} ({shown(row.location)}): {detail}")
            left_out.append((f"csv_file line {row.line} ({shown(row.location)})", detail))
        else:
            kept.add(row.stem)
    save_manifest(ds, folder, {**identity, "dataset": ds.id, LEFT_OUT: sorted(left_out, key=_line_of)})
    removed = remove_stale(folder, kept, suffixes)
    if removed:
        say(f"dataset {ds.id!r}: removed {removed} earlier download(s) whose rows are gone from csv_file (or were "
            "skipped this time)")
    say(f"dataset {ds.id!r}: {counts['fetched']} fetched, {counts['reused']} reused, {counts['skipped']} skipped, "
        f"from {table} into {folder}")


def read_table(ds: ImageDataset, table: Path, say: Callable[[str], None]) -> tuple[list[Row], list[tuple[str, str]]]:
    """The usable rows (one per location, the last row's caption winning, as SimpleTuner) and the rows left out
    (each reported), as (which row, why)."""
    where = f"dataset {ds.id!r}: csv_file {str(table)!r}"
    if not table.is_file():
        raise SourceError(f"{where} is not a file; fix csv_file")
    url_column, caption_column = ds.csv_url_column, ds.csv_caption_column
    wants_caption = ds.caption_strategy == "csv"
    try:
        with table.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            columns = reader.fieldnames
            if not columns:
                raise SourceError(f"{where} is empty; its first line must name the columns")
            missing = [(k, c) for k, c in (("csv_url_column", url_column), ("csv_caption_column", caption_column))
                       if c is not None and (k == "csv_url_column" or wants_caption) and c not in columns]
            if missing:
                raise SourceError(f"{where} has no column {', '.join(repr(c) for _, c in missing)} (its columns: "
                                  f"{', '.join(repr(c) for c in columns)}); fix {', '.join(k for k, _ in missing)}")
            by_location: dict[str, Row] = {}
            skipped: list[tuple[str, str]] = []
            repeated: list[int] = []
            line = reader.line_num + 1
            for record in reader:
                start, line = line, reader.line_num + 1
                location = (record.get(url_column) or "").strip()
                caption = " ".join((record.get(caption_column) or "").split()) if wants_caption else None
                why = (f"the {url_column!r} column is empty" if not location else
                       f"the {caption_column!r} column is empty (add a caption, or use caption_strategy "
                       "'instanceprompt')" if wants_caption and not caption else None)
                if why is not None:
                    label = f"csv_file line {start}" + (f" ({shown(location)})" if location else "")
                    skipped.append((label, why))
                    say(f"skipped {label}: {why}")
                    continue
                key = _same_file(location, table.parent)  # a.png, ./a.png and file:///.../a.png are one file
                if key in by_location:
                    repeated.append(start)
                by_location[key] = Row(by_location[key].line if key in by_location else start,
                                       by_location[key].location if key in by_location else location, caption)
    except UnicodeDecodeError as e:
        raise SourceError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from e
    except csv.Error as e:
        raise SourceError(f"{where} is not a readable CSV table (line {reader.line_num}: {e}); fix the file") from e
    if repeated:
        say(f"{len(repeated)} row(s) repeat the location of an earlier row (csv_file line "
            f"{', '.join(map(str, repeated[:5]))}{', ...' if len(repeated) > 5 else ''}): each location is fetched "
            "once, with the caption of its last row (a path and a file:// URL of one file are one location)")
    return list(by_location.values()), skipped


def claim(ds: ImageDataset, folder: Path, table: Path) -> dict[str, str]:
    """Make `folder` this table's download folder (a manifest naming the table), or refuse one that holds
    something else; returns the manifest's identity."""
    identity = {"type": "csv", "csv_file": str(table.resolve())}

    def other(found: dict) -> str:
        if found.get("type") != "csv":
            return f"the download of a dataset of type {found.get('type')!r}, not this csv table"
        return f"the download of another table ({found.get('csv_file')})"

    fix = ("set instance_data_dir (or csv_cache_dir) to a new or empty folder (difftune never deletes files: empty "
           "that one yourself to reuse it)")
    if open_folder(ds, folder, identity, fix, other=other, strangers="are not a download of this table") is None:
        save_manifest(ds, folder, {**identity, "dataset": ds.id})
    return identity


def _same_file(location: str, base: Path) -> str:
    """What tells rows of one file apart: a local file's absolute path (however the row spells it), else the URL."""
    parts = urlsplit(location)
    scheme = parts.scheme.lower() if "://" in location else ""
    if scheme not in ("file", ""):
        return location
    path = Path(url2pathname(unquote(parts.path))) if scheme else Path(location).expanduser()
    return os.path.normpath(path if path.is_absolute() else base.resolve() / path)


def _line_of(left_out: tuple[str, str]) -> int:
    return int(left_out[0].split()[2])  # "csv_file line 12 (...)"


def remove_stale(folder: Path, kept: set[str], suffixes: set[str]) -> int:
    """Remove this table's earlier downloads not in `kept` (and their caption files). Only names this module makes
    (16 hex digits) are touched."""
    removed = 0
    for path in folder.iterdir():
        if STEM.match(path.stem) and path.stem not in kept and path.is_file():
            removed += path.suffix.lower() in suffixes
            path.unlink(missing_ok=True)
    return removed


class Fetcher:
    """Fetches rows into one folder; one requests.Session per thread (a Session is not shared across threads)."""

    def __init__(self, folder: Path, base: Path, video: bool):
        self.folder, self.base, self.video = folder, base, video
        self.suffixes = CLIP_SUFFIXES if video else IMAGE_EXTENSIONS
        self.local = threading.local()
        self.sessions: list = []
        self.lock = threading.Lock()

    def run(self, rows: list[Row], present: dict[str, str]) -> list[tuple[str, str]]:
        """(status, detail) for each row, in the rows' order: 'reused', 'fetched' or 'skipped' with the reason."""
        from tqdm import tqdm

        def one(row: Row) -> tuple[str, str]:
            try:
                if row.stem in present:
                    status, name = "reused", present[row.stem]
                else:
                    status, name = "fetched", self.fetch_row(row)
                if row.caption is not None:
                    write_if_changed(self.folder / f"{row.stem}.txt", row.caption + "\n")
                return status, name
            except ItemError as e:
                return "skipped", str(e)

        todo = sum(row.stem not in present for row in rows)
        bar = tqdm(total=len(rows), desc="downloading", unit="file", leave=False, dynamic_ncols=True,
                   file=sys.stderr, disable=None if todo >= 2 else True)
        results = []
        pool = ThreadPoolExecutor(max_workers=max(1, min(WORKERS, todo)))
        try:
            for result in pool.map(one, rows):  # in the rows' order, whatever order they finish in
                results.append(result)
                bar.update(1)
        finally:  # on Ctrl-C, drop the rows not started instead of waiting for all of them
            pool.shutdown(wait=True, cancel_futures=True)
            bar.close()
        return results

    def close(self) -> None:
        for session in self.sessions:
            session.close()

    def session(self):
        import requests

        if not hasattr(self.local, "session"):
            self.local.session = requests.Session()
            with self.lock:
                self.sessions.append(self.local.session)
        return self.local.session

    def fetch_row(self, row: Row) -> str:
        """Fetch one row's file into the folder; its file name."""
        parts = urlsplit(row.location)
        scheme = parts.scheme.lower() if "://" in row.location else ""
        with partial(self.folder / row.stem) as tmp:
            if scheme in ("http", "https"):
                content_type = self.download(row.location, tmp)
                suffix = self.suffix_of(unquote(parts.path), content_type, tmp)
            elif scheme in ("file", ""):
                source = self.local_path(row.location, parts.path if scheme else None)
                link_or_copy(source, tmp)
                suffix = self.suffix_of(source.name, None, tmp)
            else:
                raise ItemError(f"cannot fetch {scheme}:// locations; use http(s), file:// or a path")
            self.check(tmp, suffix)
            name = f"{row.stem}{suffix}"
            os.replace(tmp, self.folder / name)
            return name

    def local_path(self, location: str, url_path: str | None) -> Path:
        path = Path(url2pathname(unquote(url_path))) if url_path is not None else Path(location).expanduser()
        if not path.is_absolute():
            path = self.base / path  # relative to the CSV file's folder
        if not path.is_file():
            raise ItemError(f"no such file {str(path)!r}")
        return path

    def download(self, url: str, tmp: Path) -> str | None:
        """Stream `url` into `tmp`, retrying connection errors, timeouts, 408, 429 and 5xx; the answer's
        Content-Type."""
        import requests

        last = ""
        for attempt in range(ATTEMPTS):
            wait = BACKOFF_S * 2 ** attempt
            try:
                with self.session().get(url, stream=True, timeout=TIMEOUT_S) as answer:
                    if answer.status_code in (408, 429) or answer.status_code >= 500:
                        last = f"HTTP {answer.status_code} {answer.reason or ''}".strip()
                        wait = retry_after(answer.headers.get("Retry-After"), wait)
                    elif answer.status_code >= 400:
                        raise ItemError(f"HTTP {answer.status_code} {answer.reason or ''}".strip())
                    else:
                        with tmp.open("wb") as out:
                            for chunk in answer.iter_content(CHUNK):
                                out.write(chunk)
                        return answer.headers.get("Content-Type")
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
                last = f"{type(e).__name__}: {_scrub(str(e))}"
            except requests.RequestException as e:  # an invalid URL, too many redirects: trying again will not help
                raise ItemError(f"{type(e).__name__}: {_scrub(str(e))}") from e
            if attempt + 1 < ATTEMPTS:
                time.sleep(wait)
        raise ItemError(f"{last} ({ATTEMPTS} tries)")

    def suffix_of(self, name: str, content_type: str | None, tmp: Path) -> str:
        """The file's extension: from its name, else from the Content-Type, else (images) from its content."""
        suffix = Path(name).suffix.lower()
        if suffix in self.suffixes:
            return suffix
        media = (content_type or "").split(";")[0].strip().lower()
        if CONTENT_TYPES.get(media) in self.suffixes:
            return CONTENT_TYPES[media]
        if not self.video:
            detected = PIL_FORMATS.get(image_format(tmp) or "")
            if detected:
                return detected
            raise ItemError(f"not an image ({media or suffix or 'no extension, no Content-Type'})")
        what = ", ".join(x for x in (suffix or "no extension", media) if x)
        raise ItemError(f"not a clip ({what}); a video dataset takes {', '.join(sorted(self.suffixes))}")

    def check(self, path: Path, suffix: str) -> None:
        if path.stat().st_size == 0:
            raise ItemError("empty file (0 bytes)")
        if suffix in IMAGE_EXTENSIONS:
            from PIL import Image

            try:
                with Image.open(path) as img:
                    img.verify()
            except Exception as e:  # noqa: BLE001 - PIL raises many types for files that are not images
                raise ItemError(f"not a readable image: {type(e).__name__}: {e}") from e


def image_format(path: Path) -> str | None:
    from PIL import Image

    try:
        with Image.open(path) as img:
            return img.format
    except Exception:  # noqa: BLE001 - not an image PIL knows
        return None


def retry_after(header: str | None, default: float) -> float:
    """The wait an HTTP Retry-After asks for (in seconds, at most 30), else `default`."""
    try:
        return min(max(float(header), 0.0), 30.0) if header is not None else default
    except ValueError:
        return default  # an HTTP date: the plain backoff is near enough


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the folder is on the same disk (no copy of the bytes), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
