"""Shared fixtures: a tiny Lumina2 built once per session (offline, hub layout), generated datasets,
and config files written the way a user writes them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from difftune.demo import make_dataset


def _share_cores() -> None:
    """Under pytest-xdist, each worker takes its share of the cores for torch's threads (and the runs it launches
    as subprocesses, through OMP_NUM_THREADS): workers that each spin as many threads as there are cores slow each
    other down 2-6x (measured on 2 cores)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


_share_cores()


@pytest.fixture(scope="session", autouse=True)
def tiny_home(tmp_path_factory) -> Path:
    """Tiny models are built under a per-session DIFFTUNE_HOME (reuses DIFFTUNE_TEST_HOME if set)."""
    home = Path(os.environ.get("DIFFTUNE_TEST_HOME") or tmp_path_factory.mktemp("difftune-home"))
    os.environ["DIFFTUNE_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def lumina2_dir(tiny_home) -> Path:
    from difftune.models import tiny_model

    return tiny_model("lumina2", "tiny-random")


@pytest.fixture(scope="session")
def dino(tmp_path_factory) -> str:
    """A tiny random DINOv2 saved offline: the CREPA / REPA encoder of the tests (crepa_encoder)."""
    import torch
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("dino")
    Dinov2Model(Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                             patch_size=14, image_size=28)).save_pretrained(folder)
    return str(folder)


def write_config(root: Path, dataset_dir: Path, **overrides) -> Path:
    """config.json + multidatabackend.json under root/config; returns the config path. `dataset`: keys of the
    training entry; `extra_datasets`: more entries of the dataset list; the rest: config keys."""
    (root / "config").mkdir(parents=True, exist_ok=True)
    datasets = [
        {"id": "train", "type": "local", "dataset_type": "image", "instance_data_dir": str(dataset_dir),
         "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel_area",
         "cache_dir_vae": str(root / "cache" / "vae")},
        {"id": "text-embeds", "type": "local", "dataset_type": "text_embeds", "default": True,
         "cache_dir": str(root / "cache" / "text")},
    ]
    datasets[0].update(overrides.pop("dataset", {}))
    datasets[1:1] = overrides.pop("extra_datasets", [])  # more entries, after the training one
    conditioning_dir = overrides.pop("conditioning_dir", None)
    if conditioning_dir is not None:
        datasets.append({"id": "inputs", "type": "local", "dataset_type": "conditioning",
                         "instance_data_dir": str(conditioning_dir)})
    backend = root / "config" / "multidatabackend.json"
    backend.write_text(json.dumps(datasets))
    config = {
        "model_family": "lumina2", "model_flavour": "tiny-random", "output_dir": str(root / "output"),
        "data_backend_config": str(backend), "mixed_precision": "no", "train_batch_size": 1,
        "learning_rate": 1e-3, "lora_rank": 4, "max_train_steps": 4, "seed": 7,
    }
    config.update(overrides)
    path = root / "config" / "config.json"
    path.write_text(json.dumps(config))
    return path


def step_draws(run, batch):
    """(x0, noise, sigmas, noisy input) of a batch, drawn from the run's generator as `loop.micro_step` draws them
    for a one-process step without rollouts or input perturbation: for losses computed by hand."""
    from difftune.train import objective

    x0, g = batch.latents, run.generator
    shift = run.family.auto_shift(run.comps, tuple(x0.shape[2:])) if run.cfg.flow_schedule_auto_shift \
        else run.cfg.flow_schedule_shift
    noise = torch.randn(x0.shape, generator=g, device=g.device)
    sigmas = objective.sample_sigmas(x0.shape[0], shift, g, run.sampling)
    return x0, noise, sigmas, objective.noisy_input(x0, noise, sigmas)


def config_problems(path: Path, **overrides) -> str:
    """The problems `load_config` reports for a config that must be refused, one per line."""
    from difftune.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return "\n".join(info.value.problems)


@pytest.fixture
def dataset(tmp_path) -> Path:
    folder = tmp_path / "images"
    make_dataset(folder, count=4)
    return folder


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails the test if a Lumina2 model is loaded or built: for errors that must come before any model loads."""
    from difftune.models.lumina2 import Lumina2Family

    def boom(*a, **k):
        raise AssertionError("a model was loaded, but this error must come before any model loads")

    monkeypatch.setattr(Lumina2Family, "load", boom)
    monkeypatch.setattr(Lumina2Family, "build_tiny", boom)


# --- the memory planner's configs (tests/test_memory_plan*.py) ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_cfg(tmp_path_factory):
    """The tiny Lumina2 run config, bf16, with a generated dataset: what the planner is checked against."""
    from difftune.config import load_config

    root = tmp_path_factory.mktemp("plan")
    make_dataset(root / "images", count=2)
    return load_config(write_config(root, root / "images", mixed_precision="bf16", validation_resolution="64x64"))


@pytest.fixture(scope="module")
def real_cfg(tiny_cfg):
    """Lumina2 2.0 at real size (meta models), 1024 px, checkpointing, a validation prompt: the planner's numbers
    without weights."""
    return tiny_cfg.train.model_copy(update={"model_flavour": "2.0", "validation_resolution": "1024x1024",
                                             "validation_prompt": "a cat", "gradient_checkpointing": True,
                                             "lora_rank": 16})


def tensor_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
