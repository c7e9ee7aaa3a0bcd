"""Type 'huggingface': a dataset on the Hugging Face hub, or a local folder in its layout, downloaded into the
entry's instance_data_dir with datasets' `load_dataset` (the same call for a hub id and a folder; a private or
gated dataset uses huggingface_hub's usual login: HF_TOKEN or `hf auth login`).

Each row becomes `<row number, 8 digits>.<ext>` (the image or clip, with its original bytes and format; an image in
a format discovery does not train from is re-encoded to PNG) and, with caption_strategy 'huggingface',
`<row number>.txt` (one caption per line). The names follow the row order of the split, so a later run maps each
row to the same files: what is there is kept (while the source is unchanged, unread), only what is missing is
written, and a caption file whose text changed (another caption_column) is rewritten. `.difftune-source.json`
names the source the folder holds, with a digest of each row's file as downloaded and a stamp of the data it was
read from (datasets' fingerprint of a hub dataset, which names its revision; a local folder's file names, sizes
and times, whose change also makes datasets prepare its copy again): when the data changed since (a new revision,
an edited folder), each file is checked against its row and written again if its row now holds another one (else
an image would train with another row's caption), and the files of rows that are gone or now skipped are removed.

Without streaming, datasets first prepares its own copy in its cache (cheap to reopen: a second run of an
unchanged source reads only the caption columns and the rows whose files are missing). With streaming the rows
are read as they arrive and nothing is cached by datasets, so a finished streamed download is trusted as it is
and not read again.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from difftune.config.datasets import ImageDataset
from difftune.data.discovery import CLIP_SUFFIXES, VIDEO_SUFFIXES
from difftune.data.images import IMAGE_EXTENSIONS
from difftune.data.sources import (
    LEFT_OUT,
    MANIFEST,
    SourceError,
    first_visible,
    open_folder,
    partial,
    save_manifest,
    write_atomic,
    write_if_changed,
)

DIGITS = 8  # row numbers are zero-padded to this width whatever the dataset's size, so names never change
SHOWN = 20  # skipped rows reported one by one; after that they are only counted
# PIL's format name -> the extension discovery trains from; any other format is re-encoded to PNG
IMAGE_SUFFIX = {"JPEG": ".jpg", "MPO": ".jpg", "PNG": ".png", "WEBP": ".webp", "BMP": ".bmp", "GIF": ".gif",
                "TIFF": ".tif", "AVIF": ".avif"}
assert set(IMAGE_SUFFIX.values()) <= IMAGE_EXTENSIONS


class Unusable(Exception):
    """A row that cannot be used (no image, undecodable bytes); the message is the reason reported."""


def fetch(ds: ImageDataset, folder: Path, say: Callable[[str], None]) -> None:
    clips = ds.video is not None
    column_key = "video_column" if clips else "image_column"
    column = ds.video_column if clips else ds.image_column
    source = {"dataset_name": ds.dataset_name, "dataset_config": ds.dataset_config, "data_files": ds.data_files,
              "split": ds.split, "revision": ds.revision, column_key: column}
    source = json.loads(json.dumps(source))  # as it reads back from the manifest (tuples -> lists)
    text_columns = _caption_columns(ds)
    captions = {"caption_column": ds.caption_column, "fallback_caption_column": ds.fallback_caption_column} \
        if text_columns else None
    manifest = _claim(ds, folder, source)
    present = _present(folder, clips)
    if ds.streaming and _finished(manifest, captions, present):
        say(f"dataset {ds.id!r}: the streamed download in {str(folder)!r} is complete ({len(present)} files); "
            f"not read again (delete {MANIFEST} there to read the stream again)")
        return
    local = _folder_stamp(ds)  # a local folder's files, as they are now (None for a hub id)
    # datasets reuses its prepared copy of a local folder whose files changed: prepared again then
    data = _load(ds, again=local is not None and (manifest or {}).get("stamp") != local)
    data = _media_column(ds, data, column_key, column, clips)
    _check_columns(ds, data.features, text_columns)
    known: dict[str, str] = (manifest or {}).get("files") or {}  # stem -> digest of the row's bytes
    # a hub dataset's fingerprint names its revision; a stream has none: each row is checked as it is read
    stamp = local or (getattr(data, "_fingerprint", None) if not ds.streaming else None)
    unchanged = stamp is not None and (manifest or {}).get("stamp") == stamp
    # claimed before the first file is written; the digests carried over, the fingerprint only once complete
    _write_manifest(ds, folder, source, captions, complete=False, files=known)

    fetched = reused = updated = replaced = 0
    files: dict[str, str] = {}  # the rows trained from, as this run leaves them
    skipped: list[tuple[int, str]] = []  # (row, why)

    def skip(index: int, reason: str) -> None:
        skipped.append((index, reason))
        if len(skipped) <= SHOWN:
            say(f"dataset {ds.id!r}: row {index}: {reason}; skipped")
        if len(skipped) == SHOWN:
            say(f"dataset {ds.id!r}: more rows may be skipped; they are only counted below")

    rows = _rows(data, column, [c.split(".")[0] for c in text_columns])
    total = getattr(data, "num_rows", None)
    bar = _bar(total, ds.id)
    seen = 0
    try:
        for index, row, media in rows:
            seen = index + 1
            if bar is not None:
                bar.update(1)
            if index == 0 and data.features is None:  # a stream of unknown columns: check the first row
                _check_columns(ds, {k: None for k in row}, text_columns)
                if column not in row:
                    raise SourceError(f"dataset {ds.id!r}: {column_key} {column!r} is not a column of "
                                      f"{ds.dataset_name!r} (its columns: {', '.join(row)}); set {column_key} to "
                                      "the column of " + ("clips" if clips else "images"))
            text = None
            if text_columns:
                lines = _captions(row, ds)
                if not lines:
                    skip(index, f"no caption in caption_column {ds.caption_column!r}"
                         + (f" nor fallback_caption_column {ds.fallback_caption_column!r}"
                            if ds.fallback_caption_column else ""))
                    continue
                text = "\n".join(lines) + "\n"
            stem = f"{index:0{DIGITS}d}"
            path = present.get(stem)
            try:
                payload = None
                if path is not None and unchanged and stem in known:
                    files[stem] = known[stem]
                elif path is not None:  # the data changed (or no digest yet): is the file still this row's?
                    payload = _media_bytes(media(), column_key)
                    if _digest(payload[0]) == (known[stem] if stem in known else _file_digest(path)):
                        files[stem] = _digest(payload[0])
                    else:
                        _remove(present.pop(stem))
                        path = None
                        replaced += 1
                written = path is None
                if written:
                    payload = payload or _media_bytes(media(), column_key)
                    path = present[stem] = _write_media(folder, stem, payload, clips)
                    files[stem] = _digest(payload[0])
            except Unusable as e:
                skip(index, str(e))
                continue
            if written:
                fetched += 1
                if text is not None:
                    write_atomic(path.with_suffix(".txt"), text.encode("utf-8"))
            else:
                reused += 1
                if text is not None and write_if_changed(path.with_suffix(".txt"), text):
                    updated += 1  # a caption that changed (or was missing), beside a file already there
    except SourceError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets and fsspec raise many types mid-stream
        raise SourceError(f"dataset {ds.id!r}: reading {ds.dataset_name!r} failed after {seen} rows "
                          f"({_masked(f'{type(e).__name__}: {e}')}); what was written is kept: run again to go on"
                          ) from e
    finally:
        if bar is not None:
            bar.close()
    gone = [path for stem, path in present.items() if stem not in files]  # rows removed from the data, or skipped
    for path in gone:
        _remove(path)
    _write_manifest(ds, folder, source, captions, complete=True, rows=seen, skipped=skipped, files=files,
                    stamp=stamp)  # the skipped rows with their reasons, for the data report (data/discovery.py)
    say(f"dataset {ds.id!r}: {fetched} files downloaded, {reused} already there, {len(skipped)} rows skipped"
        + (f", {updated} caption files updated" if updated else "")
        + (f", {replaced} files replaced (their rows now hold other ones)" if replaced else "")
        + (f", {len(gone)} files of rows gone or skipped removed" if gone else "")
        + f" (huggingface {ds.dataset_name!r}, split {ds.split!r}) in {str(folder)!r}")


# --- the folder -----------------------------------------------------------------------------------------------

def _claim(ds: ImageDataset, folder: Path, source: dict[str, Any]) -> dict[str, Any] | None:
    """The folder's manifest when it holds this source's download; None for a new or empty folder. A folder of
    another source, or of files difftune did not download, is refused (never emptied)."""
    def other(found: dict[str, Any]) -> str:
        return (f"the download of another source (type {found.get('type')!r}: {json.dumps(found.get('source'))}), "
                f"not of this one ({json.dumps(source)})")

    # An earlier try of another huggingface source that wrote no file yet (a typo fixed since) is taken over: with
    # nothing downloaded there is nothing to mix with, so only the type has to match.
    empty = first_visible(folder) is None
    identity = {"type": "huggingface"} if empty else {"type": "huggingface", "source": source}
    manifest = open_folder(ds, folder, identity, "set instance_data_dir to a new or empty folder (difftune never "
                           "deletes files: empty that one yourself to reuse it)", other=other,
                           strangers="difftune did not download")
    return manifest if manifest is not None and manifest.get("source") == source else None


def _present(folder: Path, clips: bool) -> dict[str, Path]:
    """Row files already downloaded, by stem."""
    suffixes = CLIP_SUFFIXES if clips else IMAGE_EXTENSIONS
    if not folder.is_dir():
        return {}  # made when the manifest is first written
    return {p.stem: p for p in folder.iterdir() if p.suffix.lower() in suffixes and p.stem.isdigit()}


def _finished(manifest: dict[str, Any] | None, captions: dict[str, Any] | None, present: dict[str, Path]) -> bool:
    """A complete earlier download of the same captions, with every file still there."""
    if not manifest or manifest.get("complete") is not True or manifest.get("captions") != captions:
        return False
    rows, left_out = manifest.get("rows"), manifest.get("skipped")
    if not isinstance(rows, int) or not isinstance(left_out, list):
        return False
    for index in set(range(rows)) - set(left_out):
        path = present.get(f"{index:0{DIGITS}d}")
        if path is None or (captions is not None and not path.with_suffix(".txt").is_file()):
            return False
    return True


def _write_manifest(ds: ImageDataset, folder: Path, source: dict[str, Any], captions: dict[str, Any] | None,
                    complete: bool, rows: int | None = None, skipped: list[tuple[int, str]] | None = None,
                    files: dict[str, str] | None = None, stamp: str | None = None) -> None:
    body = {"type": "huggingface", "source": source, "captions": captions, "complete": complete, "files": files or {}}
    if complete:
        body |= {"rows": rows, "skipped": [index for index, _ in skipped or []], "stamp": stamp,
                 LEFT_OUT: [[f"row {index}", why] for index, why in skipped or []]}
    save_manifest(ds, folder, body)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _file_digest(path: Path) -> str:
    """A file's digest, for a row downloaded before digests were kept (its bytes as they came, unless re-encoded:
    then it differs, and the row is written once more)."""
    return _digest(path.read_bytes())


def _remove(path: Path) -> None:
    """A row's file and its caption file."""
    path.unlink(missing_ok=True)
    path.with_suffix(".txt").unlink(missing_ok=True)


# --- the dataset ----------------------------------------------------------------------------------------------

def _folder_stamp(ds: ImageDataset) -> str | None:
    """For a dataset_name that is a local folder, a digest of its files' names, sizes and times."""
    root = Path(os.path.expanduser(ds.dataset_name or ""))
    if not root.is_dir():
        return None
    # not what this run writes there (datasets' cache_dir, the download folder), which changed the stamp every run,
    # nor the hidden and dunder files that datasets itself does not read
    ours = [Path(os.path.expanduser(d)).resolve() for d in (ds.cache_dir, ds.instance_data_dir) if d]
    entries = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if any(part.startswith((".", "__")) for part in rel.parts) or not path.is_file() \
                or any(path.resolve().is_relative_to(d) for d in ours):
            continue
        st = path.stat()
        entries.append((str(rel), st.st_size, st.st_mtime_ns))
    return _digest(json.dumps(sorted(entries)).encode("utf-8"))


def _load(ds: ImageDataset, again: bool = False) -> Any:
    try:
        import datasets
    except ImportError as e:  # a dependency; only a broken install lacks it
        raise SourceError(f"dataset {ds.id!r}: type 'huggingface' needs the datasets package: pip install "
                          "datasets") from e
    args = {"path": os.path.expanduser(ds.dataset_name or ""), "name": ds.dataset_config,
            "data_files": ds.data_files, "split": ds.split, "revision": ds.revision, "cache_dir": ds.cache_dir,
            "num_proc": ds.num_proc}
    if again and not ds.streaming:  # its earlier copy's split sizes would refuse the new one
        args |= {"download_mode": "force_redownload", "verification_mode": "no_checks"}
    try:
        return datasets.load_dataset(**{k: v for k, v in args.items() if v is not None}, streaming=ds.streaming)
    except Exception as e:  # noqa: BLE001 - the hub, fsspec and the builders raise many types
        raise SourceError(_load_problem(ds, e)) from e


def _load_problem(ds: ImageDataset, error: Exception) -> str:
    text = str(error)
    name = type(error).__name__
    if "save_to_disk" in text:
        fix = ("that folder was written by save_to_disk, which load_dataset does not read (nor does SimpleTuner): "
               "write it with Dataset.to_parquet('<folder>/data/train.parquet') and name that folder")
    elif "split" in text.lower() and ("Unknown split" in text or "Bad split" in text or "split" in name.lower()):
        fix = f"fix split {ds.split!r}"
    elif "BuilderConfig" in text or "Config name is missing" in text:
        fix = f"set dataset_config to one of the dataset's configurations (now {ds.dataset_config!r})"
    elif "Revision" in name or "revision" in text.lower():
        fix = f"fix revision {ds.revision!r} (a branch, tag or commit of the dataset)"
    elif isinstance(error, FileNotFoundError) or "NotFound" in name or "Gated" in name:
        fix = ("check dataset_name: a hub id (user/name) or a folder in the hub's layout; a private or gated dataset "
               "needs a login (hf auth login, or HF_TOKEN)")
    else:
        fix = "check dataset_name, dataset_config, data_files, split and revision (and the network, or HF_HUB_OFFLINE)"
    return (f"dataset {ds.id!r}: type 'huggingface' dataset_name {ds.dataset_name!r} cannot be read "
            f"({_masked(f'{name}: {text}')}); {fix}")


def _media_column(ds: ImageDataset, data: Any, key: str, column: str, clips: bool) -> Any:
    """The dataset with its image (or clip) column giving undecoded bytes, so files keep their original bytes."""
    import datasets

    features = data.features
    if features is None:
        return data  # a stream of unknown columns: each value is checked as it comes
    what = "clips" if clips else "images"
    if column not in features:
        raise SourceError(f"dataset {ds.id!r}: {key} {column!r} is not a column of {ds.dataset_name!r} (its "
                          f"columns: {', '.join(features)}); set {key} to the column of {what}")
    feature = features[column]
    wanted, other = (datasets.Video, datasets.Image) if clips else (datasets.Image, datasets.Video)
    if isinstance(feature, wanted):
        return data.cast_column(column, wanted(decode=False))
    if isinstance(feature, datasets.Value) and feature.dtype in ("binary", "large_binary"):
        return data
    hint = (f"it holds {'images' if clips else 'clips'}: set dataset_type {'image' if clips else 'video'!r}"
            if isinstance(feature, other) else f"set {key} to the column of {what}")
    kind = feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__
    raise SourceError(f"dataset {ds.id!r}: {key} {column!r} of {ds.dataset_name!r} holds {kind} values, not "
                      f"{what}; {hint}")


def _caption_columns(ds: ImageDataset) -> list[str]:
    if ds.caption_strategy != "huggingface":
        return []
    columns = ds.caption_column if isinstance(ds.caption_column, list) else [ds.caption_column]
    return columns + ([ds.fallback_caption_column] if ds.fallback_caption_column else [])


def _check_columns(ds: ImageDataset, features: Any, columns: list[str]) -> None:
    if features is None:
        return
    for column in columns:
        if column not in features and column.split(".")[0] not in features:
            key = "fallback_caption_column" if column == ds.fallback_caption_column else "caption_column"
            raise SourceError(f"dataset {ds.id!r}: {key} {column!r} is not a column of {ds.dataset_name!r} (its "
                              f"columns: {', '.join(features)}); set {key} to the column of captions, or use "
                              "caption_strategy 'instanceprompt'")


def _rows(data: Any, column: str, text_columns: list[str]) -> Iterator[tuple[int, dict[str, Any], Callable[[], Any]]]:
    """(row number, the row's caption columns, a call giving its image or clip). A map-style dataset is read
    column-wise, so rows whose files are there cost no image read; a stream is read row by row."""
    import datasets

    if not isinstance(data, datasets.Dataset):
        for index, row in enumerate(data):
            yield index, row, lambda row=row: row.get(column)
        return
    media = data.select_columns([column])
    texts: Iterator[dict[str, Any]] = itertools.repeat({})
    if text_columns:
        texts = _dicts(data.select_columns(sorted(set(text_columns))))
    for index, row in zip(range(data.num_rows), texts, strict=False):
        yield index, row, lambda index=index: media[index][column]


def _dicts(data: Any) -> Iterator[dict[str, Any]]:
    for batch in data.iter(batch_size=1000):
        keys = list(batch)
        for j in range(len(batch[keys[0]])):
            yield {k: batch[k][j] for k in keys}


def _nested(row: dict[str, Any], column: str) -> Any:
    if column in row:
        return row[column]
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _texts(value: Any) -> list[str]:
    """The captions in a cell: a string, or a list of them; newlines inside a caption become spaces."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [text for item in value for text in _texts(item)]
    text = " ".join(str(value).split("\n")).replace("\r", " ").strip()
    return [text] if text else []


def _captions(row: dict[str, Any], ds: ImageDataset) -> list[str]:
    columns = ds.caption_column if isinstance(ds.caption_column, list) else [ds.caption_column]
    found = [text for column in columns for text in _texts(_nested(row, column))]
    if not found and ds.fallback_caption_column:
        found = _texts(_nested(row, ds.fallback_caption_column))
    return found


# --- one row's file -------------------------------------------------------------------------------------------

def _media_bytes(value: Any, key: str) -> tuple[bytes, str]:
    """(the bytes, a file name that came with them or '') of one cell of the image or clip column."""
    from PIL import Image

    if value is None:
        raise Unusable(f"empty {key}")
    if isinstance(value, Image.Image):  # a decoded image (a stream whose columns were unknown): re-encoded
        buffer = io.BytesIO()
        _png_ready(value).save(buffer, "PNG")
        return buffer.getvalue(), ".png"
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), ""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        name = str(value.get("path") or "")
        if value.get("bytes"):
            return bytes(value["bytes"]), name
        if name:
            return _read(name), name
        raise Unusable(f"empty {key}")
    raise Unusable(f"{key} holds a {type(value).__name__}, not a file's bytes")


def _read(path: str) -> bytes:
    """A file the dataset refers to: local (an image folder), or remote (hf://, https://, read with the login)."""
    try:
        if os.path.isfile(path):
            return Path(path).read_bytes()
        from datasets.utils.file_utils import xopen

        with xopen(path, "rb") as f:
            return f.read()
    except Exception as e:  # noqa: BLE001 - fsspec raises many types
        raise Unusable(f"{path} cannot be read ({_masked(f'{type(e).__name__}: {e}')})") from e


def _png_ready(img: Any) -> Any:
    return img if img.mode in ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA") else img.convert("RGBA")


def _write_media(folder: Path, stem: str, payload: tuple[bytes, str], clips: bool) -> Path:
    data, name = payload
    if not data:
        raise Unusable("empty file (0 bytes)")
    if clips:
        return _write_clip(folder, stem, data, name)
    data, suffix = _image_file(data)
    path = folder / f"{stem}{suffix}"
    write_atomic(path, data)
    return path


def _image_file(data: bytes) -> tuple[bytes, str]:
    """The bytes to write and their extension: the original ones when discovery trains from that format, else
    PNG. The image is decoded once, so a truncated or corrupt one is caught here rather than at caching."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format == "JPEG":
                img.draft("RGB", (1, 1))  # decodes at 1/8 scale: still reads every byte of the image data
            img.load()
            suffix = IMAGE_SUFFIX.get(img.format or "")
            if suffix is not None:
                return data, suffix
            buffer = io.BytesIO()
            _png_ready(img).save(buffer, "PNG")
            return buffer.getvalue(), ".png"
    except Exception as e:  # noqa: BLE001 - PIL raises many types for non-images
        raise Unusable(f"not a readable image ({type(e).__name__}: {e})") from e


def _write_clip(folder: Path, stem: str, data: bytes, name: str) -> Path:
    """The clip's bytes as they are, once PyAV can read its frames; the extension is the name's or the
    container's."""
    import av

    from difftune.data.video import BadVideo, probe_video

    with partial(folder / stem) as tmp:
        tmp.write_bytes(data)
        suffix = Path(name).suffix.lower()
        if suffix not in VIDEO_SUFFIXES:
            try:
                with av.open(str(tmp)) as container:
                    formats = set(container.format.name.split(","))
            except Exception as e:  # noqa: BLE001 - FFmpeg errors
                raise Unusable(f"not a readable clip ({type(e).__name__}: {e})") from e
            suffix = ".mp4" if formats & {"mp4", "mov"} else ".mkv" if formats & {"matroska", "webm"} else ""
            if not suffix:
                raise Unusable(f"a {'/'.join(sorted(formats))} file, not an mp4, mov, webm or mkv clip")
        try:
            probe_video(tmp)
        except BadVideo as e:
            raise Unusable(f"not a usable clip ({e})") from e
        path = folder / f"{stem}{suffix}"
        os.replace(tmp, path)
        return path


# --- output ---------------------------------------------------------------------------------------------------

def _masked(text: str) -> str:
    """`text` with the hub token (if one is set) replaced by ***: errors may quote requests."""
    tokens = {os.environ.get(name) for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    try:
        from huggingface_hub import get_token

        tokens.add(get_token())
    except Exception:  # noqa: BLE001 - no login is no token
        pass
    for token in tokens:
        if token and len(token) >= 8:
            text = text.replace(token, "***")
    return text


def _bar(total: int | None, ident: str) -> Any:
    from tqdm import tqdm

    # disable=None: only on a terminal (logs and the web UI's event stream get the summary line instead)
    return tqdm(total=total, desc=f"downloading {ident}", unit="row", leave=False, dynamic_ncols=True,
                file=sys.stderr, disable=None)
