"""The shipped example configs, and the spec's Lumina2 dataset list, validate through `load_config`.

The examples point at folders of a real machine (/datasets/training), which do not exist here, so each
test writes a copy of the dataset list with instance_data_dir moved to a temporary folder; every other
key is checked exactly as written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from difftune.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "config"
SPEC_DATASETS = Path(__file__).parent / "data" / "spec_lumina2_multidatabackend.json"
EXAMPLES = sorted(CONFIG_DIR.glob("*.example"))


def relocated_datasets(source: Path, tmp_path: Path) -> tuple[Path, list[dict]]:
    """A copy of the dataset list `source` whose image folders are empty temporary folders."""
    entries = json.loads(source.read_text(encoding="utf-8"))
    for index, entry in enumerate(entries):
        if "instance_data_dir" in entry:
            folder = tmp_path / f"images-{index}"
            folder.mkdir()
            entry["instance_data_dir"] = str(folder)
    copy = tmp_path / source.name.removesuffix(".example")
    copy.write_text(json.dumps(entries), encoding="utf-8")
    return copy, entries


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"config.json.example", "multidatabackend.json.example"} <= names


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(example: Path, tmp_path):
    """A config example (a JSON object) with the dataset example; a dataset list (a JSON list) alone."""
    raw = json.loads(example.read_text(encoding="utf-8"))
    datasets_source = example if isinstance(raw, list) else CONFIG_DIR / "multidatabackend.json.example"
    datasets, _ = relocated_datasets(datasets_source, tmp_path)
    settings = raw if isinstance(raw, dict) else {"model_family": "lumina2", "max_train_steps": 1}
    run_cfg = load_config(None, {**settings, "data_backend_config": str(datasets)})
    assert run_cfg.datasets.images


def test_config_example_validates(tmp_path):
    datasets, _ = relocated_datasets(CONFIG_DIR / "multidatabackend.json.example", tmp_path)
    raw = json.loads((CONFIG_DIR / "config.json.example").read_text(encoding="utf-8"))
    # The example names the default location of the dataset list; only that one key is redirected.
    assert raw["data_backend_config"] == "config/multidatabackend.json"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**raw, "data_backend_config": str(datasets)}), encoding="utf-8")

    run_cfg = load_config(config)

    train = run_cfg.train
    assert (train.model_family, train.model_type) == ("lumina2", "lora")
    assert train.model_source() == "Alpha-VLLM/Lumina-Image-2.0"
    # Every key of the example reached the schema unchanged (nothing silently dropped or coerced).
    for key, value in raw.items():
        if key != "data_backend_config":
            assert getattr(train, key) == value, key
    assert train.validation_sizes() == [(1024, 1024)]
    assert train.guidance() == 4.0


def test_dataset_example_validates(tmp_path):
    datasets, entries = relocated_datasets(CONFIG_DIR / "multidatabackend.json.example", tmp_path)
    plan = load_config(None, {"model_family": "lumina2", "max_train_steps": 1,
                              "data_backend_config": str(datasets)}).datasets
    assert_plan_matches(plan, entries)


def test_spec_lumina2_dataset_list_validates(tmp_path):
    datasets, entries = relocated_datasets(SPEC_DATASETS, tmp_path)
    plan = load_config(None, {"model_family": "lumina2", "max_train_steps": 1,
                              "data_backend_config": str(datasets)}).datasets
    assert_plan_matches(plan, entries)


def assert_plan_matches(plan, entries: list[dict]) -> None:
    images = [e for e in entries if e.get("dataset_type", "image") == "image"]
    embeds = [e for e in entries if e.get("dataset_type") == "text_embeds"]
    assert [d.id for d in plan.images] == [e["id"] for e in images]
    for dataset, entry in zip(plan.images, images, strict=True):
        for key, value in entry.items():
            assert getattr(dataset, key) == value, key
    assert plan.text_embeds is not None and plan.text_embeds.id == embeds[0]["id"]
    for key, value in embeds[0].items():
        assert getattr(plan.text_embeds, key) == value, key


def test_example_fails_only_on_the_missing_folder(tmp_path):
    """Unchanged, the dataset example's one problem is the absent /datasets/training folder."""
    if Path("/datasets/training").is_dir():
        pytest.skip("/datasets/training exists on this machine")
    raw = json.loads((CONFIG_DIR / "config.json.example").read_text(encoding="utf-8"))
    datasets = CONFIG_DIR / "multidatabackend.json.example"
    with pytest.raises(ConfigError) as info:
        load_config(None, {**raw, "data_backend_config": str(datasets)})
    problems = info.value.problems
    assert len(problems) == 1 and "instance_data_dir" in problems[0], problems


def test_spec_kandinsky5_video_guide_validates(tmp_path):
    """The Kandinsky 5.0 Video guide's dataset list and settings, as written; its group-offload block is
    refused as not implemented (not ignored)."""
    datasets, _ = relocated_datasets(Path(__file__).parent / "data" / "spec_kandinsky5_video_multidatabackend.json",
                                     tmp_path)
    settings = {"model_family": "kandinsky5-video", "model_flavour": "t2v-lite-sft-5s", "train_batch_size": 1,
                "validation_resolution": "512x768", "validation_num_video_frames": 61, "validation_guidance": 5.0,
                "frame_rate": 24, "offload_during_startup": True, "vae_enable_patch_conv": True,
                "max_train_steps": 1, "data_backend_config": str(datasets)}
    run_cfg = load_config(None, settings)
    video = run_cfg.datasets.images[0].video
    assert (video.num_frames, video.min_frames, video.frame_rate, video.bucket_strategy) == (61, 61, 24, "aspect_ratio")
    assert run_cfg.train.model_source() == "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers"
    streamed = load_config(None, settings | {"enable_group_offload": True, "group_offload_type": "block_level"})
    assert streamed.train.enable_group_offload and streamed.train.group_offload_type == "block_level"
