"""Type 'aws' datasets: the images (or clips) under a prefix of an S3 bucket, on AWS or any S3-compatible store
(MinIO, R2, Backblaze), downloaded into the dataset's folder with boto3.

Each object keeps its key below aws_data_prefix as its name in the folder (sub-folders kept), so names are stable and
a caption object `<stem>.txt` lands beside its image, where caption_strategy 'textfile' looks for it. The folder's
manifest (.difftune-source.json, hidden from discovery) names the bucket and prefix and records each object's size
and ETag: an object already downloaded with the same ones is not fetched again, one that changed in the bucket is,
and a file whose object is gone from the bucket (or no longer wanted) is removed. An object that is not a readable
image (clip) is reported, recorded and skipped. Credentials: the entry's keys, else boto3's usual chain; they are
never printed (messages mask them).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from difftune.config.datasets import ImageDataset
from difftune.config.source_aws_keys import AWS_DEFAULT_POOL
from difftune.data.discovery import CLIP_SUFFIXES, VIDEO_SUFFIXES
from difftune.data.images import IMAGE_EXTENSIONS, BadImage, probe_size
from difftune.data.sources import LEFT_OUT, MANIFEST, SourceError, open_folder, partial, save_manifest
from difftune.data.sources import PARTIAL as PART_SUFFIX  # noqa: F401 (the name the tests give a leftover)

MAX_THREADS = 8  # downloads at once (fewer with a smaller aws_max_pool_connections)
SAVE_EVERY_S = 5.0  # the manifest is rewritten this often during a download, so a killed run loses little
CHUNK = 1 << 20
# Where boto3 found the credentials (botocore's Credentials.method), for messages.
_CREDENTIAL_SOURCES = {
    "explicit": "the entry's aws_access_key_id and aws_secret_access_key",
    "env": "the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)",
    "shared-credentials-file": "~/.aws/credentials (AWS_PROFILE, AWS_SHARED_CREDENTIALS_FILE)",
    "config-file": "~/.aws/config (AWS_PROFILE, AWS_CONFIG_FILE)",
    "iam-role": "the instance's role",
}
_FIX_CREDENTIALS = ("set aws_access_key_id and aws_secret_access_key on the dataset entry, or the environment "
                    "variables AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN for temporary ones), "
                    "or a profile in ~/.aws/credentials (AWS_PROFILE)")
_REFUSED_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                        "InvalidClientTokenId", "TokenRefreshRequired", "AuthorizationHeaderMalformed"}


@dataclass(frozen=True)
class Item:
    key: str  # the object's key in the bucket
    name: str  # its path in the folder (the key below the prefix)
    size: int
    tag: str  # ETag, or LastModified where a store gives no ETag
    media: bool  # an image or clip (checked after download), not a caption or a table


class Bucket:
    """One dataset's bucket: the client, and messages that never show a secret."""

    def __init__(self, ds: ImageDataset):
        import boto3
        from botocore.config import Config

        self.ds = ds
        self.key_id = ""
        self.name = ds.aws_bucket_name or ""
        folder = ds.aws_data_prefix.strip("/")
        self.prefix = f"{folder}/" if folder else ""
        self.url = f"s3://{self.name}/{self.prefix}"
        self.pool = ds.aws_max_pool_connections or AWS_DEFAULT_POOL
        self.threads = min(self.pool, MAX_THREADS)
        self.secrets = [s for s in (ds.aws_secret_access_key, ds.aws_session_token) if s]
        try:
            session = boto3.session.Session(
                aws_access_key_id=ds.aws_access_key_id or None, aws_secret_access_key=ds.aws_secret_access_key or None,
                aws_session_token=ds.aws_session_token or None, region_name=ds.aws_region_name or None,
            )
            credentials = session.get_credentials()
        except Exception as e:  # noqa: BLE001 - a missing profile, a broken ~/.aws/config: botocore's many errors
            raise self.error(f"boto3 cannot read the credentials: {type(e).__name__}: {e}; {_FIX_CREDENTIALS}") from e
        if credentials is None:
            raise self.error(f"no AWS credentials were found (aws_access_key_id and aws_secret_access_key are not "
                             f"set, nor AWS_ACCESS_KEY_ID, nor a profile in ~/.aws); {_FIX_CREDENTIALS}")
        frozen = credentials.get_frozen_credentials()
        self.secrets += [s for s in (frozen.secret_key, frozen.token) if s]
        self.key_id = frozen.access_key or ""
        self.credentials = (f"{_CREDENTIAL_SOURCES.get(credentials.method, credentials.method)}, access key id "
                            f"{mask(self.key_id)}")
        config = Config(max_pool_connections=self.pool, retries={"mode": "standard"})
        try:
            self.client = session.client("s3", endpoint_url=ds.aws_endpoint_url or None, config=config)
        except Exception as e:  # noqa: BLE001 - an unknown region, a malformed endpoint
            raise self.error(f"cannot make an S3 client: {type(e).__name__}: {self.hide(str(e))}; check "
                             "aws_endpoint_url and aws_region_name") from e

    def hide(self, text: str) -> str:
        """`text` with every secret (and the access key id) masked."""
        for secret in self.secrets:
            text = text.replace(secret, "****")
        return text.replace(self.key_id, mask(self.key_id)) if self.key_id else text

    def error(self, message: str) -> SourceError:
        return SourceError(f"dataset {self.ds.id!r} (type 'aws', {self.url}): {self.hide(message)}")

    def failure(self, e: Exception, doing: str) -> SourceError:
        """A SourceError for an error of a request that concerns the whole bucket, naming the key to fix."""
        from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

        where = self.ds.aws_endpoint_url or "AWS S3"
        if isinstance(e, NoCredentialsError):
            return self.error(f"no AWS credentials were found; {_FIX_CREDENTIALS}")
        if isinstance(e, EndpointConnectionError):
            return self.error(f"cannot reach {where} while {doing}: {e}; check aws_endpoint_url (and the network)")
        if not isinstance(e, ClientError):
            return self.error(f"{doing} failed: {type(e).__name__}: {e}")
        err = e.response.get("Error", {})
        code, text = str(err.get("Code", "")), str(err.get("Message", "")) or str(e)
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket" or (code == "404" and doing.startswith("listing")):
            return self.error(f"the bucket {self.name!r} does not exist at {where}; check aws_bucket_name (and "
                              "aws_endpoint_url for an S3-compatible store)")
        if code in _REFUSED_CREDENTIALS:
            return self.error(f"{where} refused the credentials ({code}: {text}); they came from {self.credentials}: "
                              f"{_FIX_CREDENTIALS}")
        if code in ("PermanentRedirect", "IllegalLocationConstraintException") or status == 301:
            return self.error(f"the bucket is in another region ({code}: {text}); set aws_region_name to the "
                              "bucket's region")
        if code in ("AccessDenied", "AllAccessDisabled", "403") or status == 403:
            return self.error(f"access denied while {doing} ({code}: {text}) for the credentials from "
                              f"{self.credentials}: give them s3:ListBucket and s3:GetObject on the bucket, or set "
                              "other ones (aws_access_key_id and aws_secret_access_key)")
        return self.error(f"{doing} failed ({code or status}: {text})")

    def listing(self) -> Iterator[dict[str, Any]]:
        """Every object under the prefix, page after page."""
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=self.prefix):
                yield from page.get("Contents", [])
        except Exception as e:  # noqa: BLE001 - ClientError, BotoCoreError: sorted out by failure()
            raise self.failure(e, f"listing {self.url}") from e


def mask(key_id: str) -> str:
    """An access key id shown by its last 4 characters only."""
    return f"****{key_id[-4:]}" if len(key_id) > 8 else "****"


def _media_extensions(ds: ImageDataset) -> set[str]:
    return CLIP_SUFFIXES if ds.video is not None else IMAGE_EXTENSIONS


def wanted(bucket: Bucket, objects: list[dict[str, Any]], say: Callable[[str], None]) -> list[Item]:
    """The objects to download: images (clips) and, by caption strategy, their captions or the caption table."""
    ds, media = bucket.ds, _media_extensions(bucket.ds)
    table = ds.parquet.path.replace("\\", "/") if ds.caption_strategy == "parquet" and ds.parquet else None
    found: dict[str, Item] = {}
    hidden = 0
    for obj in objects:
        key = obj["Key"]
        name = key[len(bucket.prefix):]
        suffix = PurePosixPath(name).suffix.lower()
        if key.endswith("/") or not (suffix in media or suffix == ".txt" or name == table):
            continue
        parts = name.split("/")
        if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
            say(f"dataset {ds.id!r}: skipped s3://{bucket.name}/{key}: its key has an empty, '.' or '..' part (or a "
                "backslash), so it has no safe name in the folder")
            continue
        if any(p.startswith(".") for p in parts):
            hidden += 1  # discovery passes over hidden files and folders: they would never be trained on
            continue
        tag = str(obj.get("ETag") or obj.get("LastModified") or "")
        found[name] = Item(key, name, int(obj.get("Size", 0)), tag, suffix in media)
    if hidden:
        say(f"dataset {ds.id!r}: {hidden} objects under hidden names (a part starting with '.') are left out, as "
            "discovery passes over hidden files")
    stems = {str(PurePosixPath(n).with_suffix(".txt")) for n, item in found.items() if item.media}
    keep_txt = ds.caption_strategy == "textfile"
    return sorted((item for name, item in found.items()
                   if item.media or name == table or (keep_txt and name in stems)), key=lambda item: item.name)


# --- the folder and its manifest ------------------------------------------------------------------------------

def _identity(bucket: Bucket) -> dict[str, str]:
    return {"type": "aws", "bucket": bucket.name, "prefix": bucket.prefix}


def read_manifest(bucket: Bucket, folder: Path) -> dict[str, Any]:
    """This download's manifest (a new one, not yet written, for an empty or missing folder); a folder of another
    source, or one holding files that no download wrote, is an error."""
    ident = _identity(bucket)

    def other(found: dict[str, Any]) -> str:
        named = {k: v for k, v in found.items() if isinstance(v, str)}
        return f"another download ({named}, see its {MANIFEST}), not {bucket.url}"

    fix = (f"give this dataset another instance_data_dir (or leave it out: the default is cache/sources/"
           f"{bucket.ds.id}), or empty that folder yourself (difftune never deletes files it did not download)")
    manifest = open_folder(bucket.ds, folder, ident, fix, other=other, strangers="no download put there")
    if manifest is None:
        return {**ident, "endpoint": bucket.ds.aws_endpoint_url, "objects": {}}
    if not isinstance(manifest.get("objects"), dict):
        manifest["objects"] = {}
    return manifest


def _target(folder: Path, name: str) -> Path:
    return folder.joinpath(*name.split("/"))


def reusable(folder: Path, item: Item, record: Any) -> bool:
    """The object was handled by an earlier run and has not changed since (same size and ETag)."""
    if not isinstance(record, dict) or record.get("size") != item.size or record.get("tag") != item.tag:
        return False
    if record.get("unusable"):
        return True
    target = _target(folder, item.name)
    return target.is_file() and target.stat().st_size == item.size


# --- downloads ------------------------------------------------------------------------------------------------

def _check_media(path: Path, suffix: str) -> str | None:
    """Why a downloaded file is no usable image (clip), or None."""
    if suffix in VIDEO_SUFFIXES:
        from difftune.data.video import BadVideo, probe_video

        try:
            probe_video(path)
        except BadVideo as e:
            return f"not a readable clip: {e}"
        return None
    try:
        probe_size(path)
    except BadImage as e:
        return str(e)
    return None


def download(bucket: Bucket, folder: Path, item: Item) -> dict[str, Any]:
    """Fetch one object into its place (atomically); returns its manifest record ('unusable' when skipped)."""
    target = _target(folder, item.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with partial(target) as tmp:
        with tmp.open("wb") as f:
            answer = bucket.client.get_object(Bucket=bucket.name, Key=item.key)
            for chunk in answer["Body"].iter_chunks(CHUNK):
                f.write(chunk)
        size = tmp.stat().st_size
        # What was fetched (the object may have changed since it was listed): recorded as it is.
        record = {"size": size, "tag": str(answer.get("ETag") or answer.get("LastModified") or item.tag)}
        if size != answer.get("ContentLength", size):
            raise OSError(f"{size} of {answer['ContentLength']} bytes arrived")
        reason = _check_media(tmp, target.suffix.lower()) if item.media else None
        if reason is not None:
            return {**record, "unusable": reason}
        os.replace(tmp, target)
        return record


def _progress(total: int):
    if total < 20:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="downloading", unit="file", leave=False, dynamic_ncols=True, file=sys.stderr,
                disable=None)


def fetch(ds: ImageDataset, folder: Path, say: Callable[[str], None]) -> None:
    """Fill `folder` with the dataset's objects (see the module's docstring)."""
    bucket = Bucket(ds)
    manifest = read_manifest(bucket, folder)
    items = wanted(bucket, list(bucket.listing()), say)
    if not any(item.media for item in items):
        kinds = ", ".join(sorted(_media_extensions(ds)))
        raise bucket.error(f"no {'clips' if ds.video is not None else 'images'} ({kinds}) under the prefix; check "
                           "aws_bucket_name and aws_data_prefix")
    save_manifest(ds, folder, manifest)  # before any download, so that a killed first download is known as ours
    records: dict[str, Any] = manifest["objects"]
    removed = _remove_stale(folder, records, {item.name for item in items})
    todo = [item for item in items if not reusable(folder, item, records.get(item.name))]
    waiting = {item.name for item in todo}
    counts = {"downloaded": 0, "already there": 0, "skipped": 0}
    for item in items:
        if item.name in waiting:
            continue
        reason = records[item.name].get("unusable")
        counts["skipped" if reason else "already there"] += 1
        if reason:
            say(f"dataset {ds.id!r}: skipped s3://{bucket.name}/{item.key}: {reason} (unchanged since the last "
                "download)")
    try:
        _download_all(bucket, folder, todo, manifest, counts, say)
    finally:  # the objects left out, with their reasons, for the data report (data/discovery.py)
        manifest[LEFT_OUT] = [[f"s3://{bucket.name}/{item.key}", records[item.name]["unusable"]] for item in items
                              if "unusable" in records.get(item.name, {})]
        save_manifest(ds, folder, manifest)
    summary = ", ".join(f"{n} {what}" for what, n in counts.items())
    if todo:
        summary += f" ({bucket.threads} download{'s' if bucket.threads > 1 else ''} at a time)"
    if removed:
        summary += f", {removed} removed (gone from the bucket, or no longer used)"
    say(f"dataset {ds.id!r}: {bucket.url} -> {folder}: {len(items)} files: {summary}")


def _remove_stale(folder: Path, records: dict[str, Any], names: set[str]) -> int:
    """Remove the files of an earlier download whose objects are gone from the bucket (or no longer wanted: a
    changed caption_strategy); only files this module wrote, as the manifest records them."""
    removed = 0
    for name in [n for n in records if n not in names]:
        target = _target(folder, name)
        if target.is_file():
            target.unlink()
            removed += 1
        del records[name]
    return removed


def _download_all(bucket: Bucket, folder: Path, todo: list[Item], manifest: dict[str, Any], counts: dict[str, int],
                  say: Callable[[str], None]) -> None:
    """Download `todo` on a few threads, recording each object as it lands (the manifest is saved every few
    seconds, so a killed run goes on where it stopped)."""
    from botocore.exceptions import ClientError

    records, ident = manifest["objects"], f"dataset {bucket.ds.id!r}"
    bar, saved = _progress(len(todo)), time.monotonic()
    pool = ThreadPoolExecutor(max_workers=bucket.threads)
    try:
        futures = {pool.submit(download, bucket, folder, item): item for item in todo}
        for future in as_completed(futures):
            item, record = futures[future], None
            try:
                record = future.result()
            except ClientError as e:
                error = e.response.get("Error", {})
                if error.get("Code") in _REFUSED_CREDENTIALS:  # every other object would fail alike
                    raise bucket.failure(e, f"downloading {item.key}") from e
                reason = f"{error.get('Code')}: {error.get('Message')}"
            except Exception as e:  # noqa: BLE001 - one object's failure never stops the others
                reason = f"{type(e).__name__}: {e}"
            if record is None:
                counts["skipped"] += 1
                say(f"{ident}: skipped s3://{bucket.name}/{item.key}: {bucket.hide(reason)} (tried again on the "
                    "next run)")
            else:
                records[item.name] = record
                counts["skipped" if record.get("unusable") else "downloaded"] += 1
                if record.get("unusable"):
                    say(f"{ident}: skipped s3://{bucket.name}/{item.key}: {record['unusable']}")
            if bar is not None:
                bar.update(1)
            if time.monotonic() - saved > SAVE_EVERY_S:
                save_manifest(bucket.ds, folder, manifest)
                saved = time.monotonic()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # an error or Ctrl-C: the queued downloads never start
        if bar is not None:
            bar.close()
