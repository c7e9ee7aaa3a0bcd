"""What every remote dataset type shares (data/sources): the default download folder, caption strategies that belong
to a type, and the web UI's refusal (it trains local folders only and never downloads)."""

from __future__ import annotations

import json

from conftest import config_problems, write_config
from difftune.config import load_config
from difftune.demo import make_dataset


def test_download_folder_defaults_and_caption_strategies_of_a_type(tmp_path):
    images = tmp_path / "images"
    make_dataset(images, count=2)
    hub = {"id": "hub", "type": "huggingface", "dataset_name": str(tmp_path / "nowhere"),
           "caption_strategy": "huggingface", "resolution": 64}
    path = write_config(tmp_path, images, extra_datasets=[hub])
    raw = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    from difftune.config.datasets import ImageDataset

    entry = ImageDataset.model_validate(next(e for e in raw if e["id"] == "hub"))
    assert entry.instance_data_dir == "cache/sources/hub"  # not checked for existence: the download makes it
    assert [ds.instance_data_dir for ds in load_config(path).datasets.images][1] == "cache/sources/hub"
    text = config_problems(write_config(tmp_path, images, dataset={"caption_strategy": "csv"}))
    assert "caption_strategy 'csv' reads the captions of a type 'csv' dataset; this one is type 'local'" in text


def test_the_web_ui_refuses_remote_types_and_never_downloads(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from difftune.ui.server import create_app

    root = tmp_path / "root"
    make_dataset(root / "images", count=2)
    table = root / "table.csv"
    table.write_text("url,caption\nhttp://127.0.0.1:9/never.png,a shape\n")
    csv_entry = {"id": "web", "type": "csv", "csv_file": str(table), "csv_caption_column": "caption",
                 "caption_strategy": "csv", "resolution": 64, "instance_data_dir": str(root / "downloads"),
                 "cache_dir_vae": str(root / "cache" / "web")}
    write_config(root, root / "images", max_train_steps=2, extra_datasets=[csv_entry])
    monkeypatch.chdir(root)
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")
    body = {"path": str(root / "config" / "config.json"),
            "config": json.loads((root / "config" / "config.json").read_text()),
            "datasets": json.loads((root / "config" / "multidatabackend.json").read_text()),
            "overwrite": True}  # a save replaces the files write_config wrote
    answer = client.post("/api/config/check", json=body).json()
    assert any("type 'csv': the web UI trains local folders only" in p["message"] for p in answer["problems"])
    assert client.put("/api/config", json=body).status_code == 200
    assert client.post("/api/runs", json={"path": body["path"]}).status_code == 422
    assert not (root / "downloads").exists()  # nothing fetched, no folder claimed
    run_cfg = load_config(root / "config" / "config.json")  # the command line accepts the same config
    assert [ds.type for ds in run_cfg.datasets.images] == ["local", "csv"]


def test_a_text_cache_or_conditioning_entry_of_a_remote_type_is_refused_by_name(tmp_path):
    """SimpleTuner's first dataset-list example keeps its text cache in S3: one clear problem, not one per aws key."""
    images = tmp_path / "images"
    make_dataset(images, count=2)
    text = {"id": "text", "dataset_type": "text_embeds", "default": True, "type": "aws", "aws_bucket_name": "b",
            "aws_region_name": None, "aws_data_prefix": "", "cache_dir": ""}
    inputs = {"id": "inputs", "dataset_type": "conditioning", "type": "huggingface", "dataset_name": "x/y"}
    problems = config_problems(write_config(tmp_path, images, extra_datasets=[text, inputs])).splitlines()
    assert [p.split(": ", 2)[1:] for p in problems if "type '" in p] == [
        ["dataset 'text'", "type 'aws': not implemented yet for a text_embeds entry (only image, video and eval "
         "datasets are downloaded); set type 'local' with a local cache_dir, and remove its aws keys"],
        ["dataset 'inputs'", "type 'huggingface': not implemented yet for a conditioning entry (only image, video "
         "and eval datasets are downloaded); set type 'local' with a local instance_data_dir, and remove its "
         "huggingface keys"]]
    assert not any("unknown key" in p for p in problems)


def test_every_kind_of_entry_validates_again_from_its_dump():
    """A validated entry dumped whole (defaults included, as conditioning_keys and tools that save entries do)
    validates again to the same entry: a key of another type at its default is not 'given'."""
    from difftune.config.datasets import ImageDataset

    for raw in [{"id": "x", "instance_data_dir": "/tmp"},
                {"id": "v", "instance_data_dir": "/tmp", "dataset_type": "video"},
                {"id": "h", "type": "huggingface", "dataset_name": "a/b"},
                {"id": "hv", "type": "huggingface", "dataset_name": "a/b", "dataset_type": "video"},
                {"id": "hb", "type": "huggingface", "huggingface": {"dataset_name": "a/b", "split": "test"}},
                {"id": "c", "type": "csv", "csv_file": "/tmp/x.csv", "csv_caption_column": "caption"},
                {"id": "s", "type": "aws", "aws_bucket_name": "b", "aws_data_prefix": "p/"}]:
        entry = ImageDataset.model_validate(raw)
        assert ImageDataset.model_validate(entry.model_dump()) == entry, raw["id"]
