"""Type 'aws' datasets (config/source_aws_keys.py, data/sources/s3.py): the keys, their misuse, and downloads from a
real S3 endpoint over HTTP (moto's server, with IAM signatures checked), boto3 pointed at it by aws_endpoint_url."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conftest import config_problems as problems
from conftest import write_config
from difftune.config import load_config
from difftune.config.datasets import ImageDataset
from difftune.data.sources import SourceError, fetch_all, s3
from difftune.demo import make_dataset

BUCKET = "photos"
WRONG_SECRET = "wrong-Secret/Value+123456789"


def aws_entry(folder, store=None, **keys) -> dict:
    entry = {"type": "aws", "aws_bucket_name": BUCKET, "aws_data_prefix": "sets/shapes",
             "instance_data_dir": str(folder)}
    if store is not None:
        entry |= {"aws_endpoint_url": store.url, "aws_region_name": "us-east-1",
                  "aws_access_key_id": store.key_id, "aws_secret_access_key": store.secret}
    return entry | keys


# --- config ------------------------------------------------------------------------------------------------------

def test_keys_parse_and_the_refusal_is_gone(tmp_path, dataset):
    entry = aws_entry(tmp_path / "dl", aws_endpoint_url="http://localhost:9000", aws_region_name="auto",
                      aws_access_key_id="AKIAEXAMPLE123", aws_secret_access_key="s3cr3t", aws_session_token="tok",
                      aws_max_pool_connections=16)
    ds = load_config(write_config(tmp_path, dataset, dataset=entry)).datasets.images[0]
    assert (ds.type, ds.aws_bucket_name, ds.aws_data_prefix, ds.aws_endpoint_url) == \
        ("aws", BUCKET, "sets/shapes", "http://localhost:9000")
    assert (ds.aws_region_name, ds.aws_session_token, ds.aws_max_pool_connections) == ("auto", "tok", 16)
    # the folder defaults to cache/sources/<id>; null keys are "not set" (SimpleTuner's example writes them)
    entry = {"type": "aws", "aws_bucket_name": BUCKET, "instance_data_dir": "", "aws_region_name": None,
             "aws_access_key_id": None, "aws_secret_access_key": None}
    run = load_config(write_config(tmp_path, dataset, dataset=entry))
    ds = run.datasets.images[0]
    assert ds.instance_data_dir == "cache/sources/train" and ds.aws_data_prefix == ""
    # SimpleTuner's cache_dir_vae on an aws entry is a prefix in the bucket; here a local folder, said so
    assert any("cache_dir_vae" in n and "a prefix inside the bucket" in n for n in run.notes())


def test_config_level_pool_size_is_the_default_of_aws_entries(tmp_path, dataset):
    local = {"id": "local", "type": "local", "instance_data_dir": str(dataset)}
    path = write_config(tmp_path, dataset, dataset=aws_entry(tmp_path / "dl"), extra_datasets=[local],
                        aws_max_pool_connections=4)
    plan = load_config(path).datasets
    by_id = {ds.id: ds for ds in plan.images}
    assert by_id["train"].aws_max_pool_connections == 4 and by_id["local"].aws_max_pool_connections is None
    own = aws_entry(tmp_path / "dl", aws_max_pool_connections=2)
    assert load_config(write_config(tmp_path, dataset, dataset=own, aws_max_pool_connections=4)).datasets \
        .images[0].aws_max_pool_connections == 2


@pytest.mark.parametrize("keys,expected", [
    ({"type": "local"}, "aws_bucket_name, aws_data_prefix belong to datasets of type 'aws'; this one is type "
     "'local': remove them or set type to 'aws'"),
    ({"aws_bucket_name": None}, "type 'aws' needs aws_bucket_name"),
    ({"aws_bucket_name": "s3://photos/sets/shapes"}, "aws_bucket_name 'photos', aws_data_prefix 'sets/shapes'"),
    ({"aws_data_prefix": "s3://photos/x"}, "aws_data_prefix 's3://photos/x' is a URL"),
    ({"aws_endpoint_url": "localhost:9000"}, "aws_endpoint_url 'localhost:9000' is not an http(s) URL"),
    ({"aws_access_key_id": "AKIAEXAMPLE123"}, "aws_access_key_id is set but aws_secret_access_key is not"),
    ({"aws_secret_access_key": "TopSecret99"}, "aws_secret_access_key is set but aws_access_key_id is not"),
    ({"aws_session_token": "TopSecret99"}, "aws_session_token goes with aws_access_key_id"),
    ({"aws_secret_access_key": 73125499}, "aws_secret_access_key: must be a string"),
    ({"aws_access_key_id": "{env:KEY}", "aws_secret_access_key": "${SECRET}"},
     "aws_access_key_id looks like an environment variable placeholder"),
    ({"aws_max_pool_connections": 0}, "aws_max_pool_connections"),
    ({"caption_strategy": "csv"}, "caption_strategy 'csv' reads the captions of a type 'csv' dataset"),
])
def test_misuse_names_the_key_and_hides_secrets(tmp_path, dataset, keys, expected):
    text = problems(write_config(tmp_path, dataset, dataset=aws_entry(tmp_path / "dl") | keys))
    assert expected in text, text
    assert "TopSecret99" not in text and "73125499" not in text  # a secret is never repeated
    assert "not implemented yet" not in text


# --- a real S3 endpoint ------------------------------------------------------------------------------------------

class Store:
    """moto's S3 server on a local port, with IAM on: only the reader's key, correctly signed, gets in."""

    def __init__(self):
        import boto3
        import requests
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        iam = boto3.client("iam", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        requests.post(f"{self.url}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()  # IAM on
        self.client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                                   aws_access_key_id=self.key_id, aws_secret_access_key=self.secret)

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=body)

    def fill(self, images: Path, prefix: str) -> None:
        for path in sorted(images.rglob("*")):
            if path.is_file():
                self.put(f"{prefix}/{path.relative_to(images).as_posix()}", path.read_bytes())

    def stop(self) -> None:
        import requests

        requests.post(f"{self.url}/moto-api/reset-auth", data=b"inf", timeout=10)
        self.server.stop()


@pytest.fixture(scope="module")
def server():
    store = Store()
    yield store
    store.stop()


@pytest.fixture
def store(server, monkeypatch):
    """An empty bucket; boto3 finds no credentials of this machine (only what a test gives it)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    client = server.client
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET) if _exists(client) else []:
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    if not _exists(client):
        client.create_bucket(Bucket=BUCKET)
    return server


def _exists(client) -> bool:
    return BUCKET in [b["Name"] for b in client.list_buckets().get("Buckets", [])]


def fetch(entry: dict, messages: list[str] | None = None) -> list[str]:
    messages = [] if messages is None else messages
    ds = ImageDataset(id="shapes", **entry)
    s3.fetch(ds, Path(ds.instance_data_dir), messages.append)
    return messages


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and not p.name.startswith(".")}


@pytest.fixture
def shapes(tmp_path) -> Path:
    """Six images with captions, two of them in a sub-folder."""
    images = tmp_path / "shapes"
    made = make_dataset(images, count=6)
    (images / "night").mkdir()
    for path in made[4:]:
        for file in (path, path.with_suffix(".txt")):
            file.rename(images / "night" / file.name)
    return images


def test_prefix_pages_captions_reuse_and_changes(tmp_path, store, shapes, monkeypatch):
    monkeypatch.setenv("MOTO_S3_DEFAULT_MAX_KEYS", "3")  # the server answers 3 keys a page: 13 objects, 5 pages
    store.fill(shapes, "sets/shapes")
    store.put("sets/shapes-other/stray.png", next(shapes.glob("*.png")).read_bytes())  # beside the prefix
    store.put("sets/shapes/orphan.txt", b"a caption without an image")
    store.put("sets/shapes/readme.md", b"not an image")
    folder = tmp_path / "dl"
    messages = fetch(aws_entry(folder, store))
    expected = {p.relative_to(shapes).as_posix(): p.read_bytes() for p in shapes.rglob("*") if p.is_file()}
    assert files(folder) == expected  # names under the prefix, sub-folders kept; no stray, orphan or readme
    assert "12 files: 12 downloaded, 0 already there, 0 skipped" in messages[-1], messages
    manifest = json.loads((folder / s3.MANIFEST).read_text())
    assert (manifest["type"], manifest["bucket"], manifest["prefix"]) == ("aws", BUCKET, "sets/shapes/")

    stamps = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file() and p.name != s3.MANIFEST}
    assert "0 downloaded, 12 already there" in fetch(aws_entry(folder, store))[-1]  # a second run fetches nothing
    assert stamps == {p: p.stat().st_mtime_ns for p in stamps}

    first = sorted(expected)[0]
    (folder / first).unlink()  # a partial folder, and a part file a killed run left, are completed and cleaned
    (folder / f".{first}.x1{s3.PART_SUFFIX}").write_bytes(b"half")
    changed = next(shapes.glob("*.txt"))
    store.put(f"sets/shapes/{changed.name}", b"a changed caption")  # changed in the bucket: downloaded again
    store.client.delete_object(Bucket=BUCKET, Key="sets/shapes/night/" + sorted((shapes / "night").glob("*.png"))[0]
                               .name)  # gone from the bucket: removed here, with its caption
    messages = fetch(aws_entry(folder, store))
    assert "10 files: 2 downloaded, 8 already there, 0 skipped" in messages[-1] and "2 removed" in messages[-1]
    now = files(folder)
    assert now[first] == expected[first] and now[changed.name] == b"a changed caption"
    assert len(now) == 10 and not list(folder.rglob(f"*{s3.PART_SUFFIX}"))


def test_broken_object_is_reported_and_skipped(tmp_path, store, shapes):
    store.fill(shapes, "sets/shapes")
    store.put("sets/shapes/broken.png", b"<html>not an image</html>")
    folder = tmp_path / "dl"
    messages = fetch(aws_entry(folder, store))
    said = "\n".join(messages)
    assert f"skipped s3://{BUCKET}/sets/shapes/broken.png: not a readable image" in said
    assert "13 files: 12 downloaded, 0 already there, 1 skipped" in messages[-1]
    assert not (folder / "broken.png").exists() and len(files(folder)) == 12
    again = fetch(aws_entry(folder, store))  # not downloaded again while it is unchanged, still reported
    assert "unchanged since the last download" in "\n".join(again) and "0 downloaded" in again[-1]
    store.put("sets/shapes/broken.png", next(shapes.glob("*.png")).read_bytes())  # mended in the bucket
    from difftune.data.discovery import _not_downloaded  # what the data report lists as left out

    assert [(w, r.split(":")[0]) for w, r in _not_downloaded(folder)] == [(f"s3://{BUCKET}/sets/shapes/broken.png",
                                                                        "not a readable image")]
    assert "1 downloaded" in fetch(aws_entry(folder, store))[-1] and (folder / "broken.png").is_file()
    assert _not_downloaded(folder) == []


def test_foreign_folders_are_refused_and_left_alone(tmp_path, store, shapes):
    store.fill(shapes, "sets/shapes")
    other = tmp_path / "other"
    other.mkdir()
    (other / s3.MANIFEST).write_text(json.dumps({"type": "csv", "csv_file": "table.csv", "objects": {}}))
    (other / "mine.png").write_bytes(b"user's file")
    with pytest.raises(SourceError) as info:
        fetch(aws_entry(other, store))
    assert "instance_data_dir" in str(info.value) and "holds another download" in str(info.value)
    assert "csv" in str(info.value) and (other / "mine.png").read_bytes() == b"user's file"
    own = tmp_path / "own"
    make_dataset(own, count=1)
    with pytest.raises(SourceError, match="already holds files that no download put there"):
        fetch(aws_entry(own, store))
    other_prefix = tmp_path / "dl"
    fetch(aws_entry(other_prefix, store))
    with pytest.raises(SourceError, match="holds another download"):
        fetch(aws_entry(other_prefix, store, aws_data_prefix="sets"))


def test_missing_bucket_and_empty_prefix(tmp_path, store, shapes):
    with pytest.raises(SourceError) as info:
        fetch(aws_entry(tmp_path / "dl", store, aws_bucket_name="no-such-bucket"))
    text = str(info.value)
    assert "dataset 'shapes'" in text and "'no-such-bucket' does not exist" in text and "aws_bucket_name" in text
    with pytest.raises(SourceError, match="no images .* under the prefix; check aws_bucket_name and aws_data_prefix"):
        fetch(aws_entry(tmp_path / "dl", store, aws_data_prefix="nothing/here"))
    assert not (tmp_path / "dl").exists()  # nothing is written for a source that cannot be read


def test_bad_or_missing_credentials_are_named_and_masked(tmp_path, store, shapes, monkeypatch):
    store.fill(shapes, "sets/shapes")
    with pytest.raises(SourceError) as info:
        fetch(aws_entry(tmp_path / "dl", store, aws_secret_access_key=WRONG_SECRET))
    text = str(info.value)
    assert "refused the credentials (SignatureDoesNotMatch" in text
    assert "aws_access_key_id and aws_secret_access_key" in text and "AWS_SECRET_ACCESS_KEY" in text
    assert WRONG_SECRET not in text and store.key_id not in text and f"****{store.key_id[-4:]}" in text

    with pytest.raises(SourceError) as info:  # nothing on the entry, nothing in the environment or ~/.aws
        fetch(aws_entry(tmp_path / "dl", aws_endpoint_url=store.url))
    text = str(info.value)
    assert "no AWS credentials were found" in text and "AWS_ACCESS_KEY_ID" in text and "aws_access_key_id" in text

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOBODYKNOWS1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    with pytest.raises(SourceError) as info:
        fetch(aws_entry(tmp_path / "dl", aws_endpoint_url=store.url))
    text = str(info.value)
    assert "InvalidAccessKeyId" in text and "the environment (AWS_ACCESS_KEY_ID" in text
    assert WRONG_SECRET not in text and "AKIANOBODYKNOWS1" not in text


def test_credentials_from_the_environment_and_the_pool_size(tmp_path, store, shapes, monkeypatch):
    store.fill(shapes, "sets/shapes")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", store.key_id)  # boto3's own chain: nothing secret in the config
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", store.secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    one = fetch(aws_entry(tmp_path / "a", aws_endpoint_url=store.url, aws_max_pool_connections=1))
    assert "12 downloaded, 0 already there, 0 skipped (1 download at a time)" in one[-1]
    assert "(8 downloads at a time)" in fetch(aws_entry(tmp_path / "b", aws_endpoint_url=store.url))[-1]
    assert files(tmp_path / "a") == files(tmp_path / "b") == {
        p.relative_to(shapes).as_posix(): p.read_bytes() for p in shapes.rglob("*") if p.is_file()}
    bucket = s3.Bucket(ImageDataset(id="x", **aws_entry(tmp_path / "c", aws_max_pool_connections=3)))
    assert bucket.client.meta.config.max_pool_connections == 3 and bucket.threads == 3
    # what boto3 found in the environment is masked too, in any text a message may quote
    assert bucket.hide(f"key {store.key_id} secret {store.secret}.") == f"key ****{store.key_id[-4:]} secret ****."


def test_caption_strategies_choose_what_is_downloaded(tmp_path, store, shapes):
    store.fill(shapes, "sets/shapes")
    fetch(aws_entry(tmp_path / "a", store, caption_strategy="instanceprompt", instance_prompt="a shape"))
    assert sorted(files(tmp_path / "a")) == sorted(p.relative_to(shapes).as_posix() for p in shapes.rglob("*.png"))
    folder = tmp_path / "b"  # switching to 'filename' later removes the caption files this download wrote
    fetch(aws_entry(folder, store))
    messages = fetch(aws_entry(folder, store, caption_strategy="filename"))
    assert "6 removed" in messages[-1] and not list(folder.rglob("*.txt"))
    # 'parquet': the caption table named by a relative parquet.path comes from the bucket too (and no .txt)
    from difftune.train.plan import caption_table

    rows = [{"filename": p.relative_to(shapes).as_posix(), "caption": f"row {i}"}
            for i, p in enumerate(sorted(shapes.rglob("*.png")))]
    store.put("sets/shapes/meta/captions.jsonl", "\n".join(map(json.dumps, rows)).encode())
    entry = aws_entry(tmp_path / "c", store, caption_strategy="parquet", parquet={"path": "meta/captions.jsonl"})
    fetch(entry)
    assert sorted(files(tmp_path / "c")) == sorted([*(r["filename"] for r in rows), "meta/captions.jsonl"])
    table = caption_table(ImageDataset(id="shapes", **entry))
    image = tmp_path / "c" / rows[5]["filename"]
    assert table.lookup(image, tmp_path / "c").captions == ("row 5",)


def test_clips_are_checked_as_clips(tmp_path, store):
    from difftune.data.video import synthetic_clip

    clip = synthetic_clip(tmp_path / "clip.mp4", width=32, height=32, frames=5, fps=8)
    store.put("sets/shapes/a.mp4", Path(clip).read_bytes())
    store.put("sets/shapes/a.txt", b"a moving shape")
    store.put("sets/shapes/b.mp4", b"not a clip")
    store.put("sets/shapes/c.png", b"an image is not trained on by a video dataset")
    folder = tmp_path / "dl"
    messages = fetch(aws_entry(folder, store, dataset_type="video", video={"num_frames": 5}))
    assert sorted(files(folder)) == ["a.mp4", "a.txt"]
    assert "skipped s3://photos/sets/shapes/b.mp4: not a readable clip" in "\n".join(messages)


# --- end to end --------------------------------------------------------------------------------------------------

def test_training_on_a_bucket(tmp_path, store, shapes, lumina2_dir):
    from difftune.train.loop import train
    from difftune.train.plan import discover_all
    from difftune.train.setup import build_run

    store.fill(shapes, "sets/shapes")
    folder = tmp_path / "downloaded"
    path = write_config(tmp_path, shapes, dataset=aws_entry(folder, store), max_train_steps=2)
    cfg = load_config(path)
    found = discover_all(cfg)  # fetches first
    captions = {s.path.relative_to(folder).as_posix(): s.captions for s in found[0].samples}
    assert captions == {p.relative_to(shapes).as_posix(): (p.with_suffix(".txt").read_text(),)
                        for p in shapes.rglob("*.png")}
    train(build_run(load_config(path)))
    assert (tmp_path / "output" / "pytorch_lora_weights.safetensors").is_file()
    events = [json.loads(line) for line in (tmp_path / "output" / "events.jsonl").read_text().splitlines()]
    assert any("0 downloaded, 12 already there" in e.get("message", "") for e in events)  # process 0 fetched again
    assert sum(e["event"] == "step" for e in events) == 2


def test_fetch_all_skips_local_and_disabled(tmp_path, store, shapes):
    store.fill(shapes, "sets/shapes")
    messages: list[str] = []
    fetch_all([ImageDataset(id="local", instance_data_dir=str(shapes)),
               ImageDataset(id="off", disabled=True, **aws_entry(tmp_path / "off", store)),
               ImageDataset(id="on", **aws_entry(tmp_path / "on", store))], messages.append)
    assert not (tmp_path / "off").exists() and len(files(tmp_path / "on")) == 12
    assert len(messages) == 1 and "dataset 'on'" in messages[0]
