"""Every validation key changes the samples when it should (no key is silently ignored).

A config goes the way a run takes it: `load_config`, then `encode_validation` (what setup does while
the text encoder is loaded) to sample requests, then the family's stock-pipeline `sample`. The tiny
model is loaded once per family; each key is compared against the same base config.
"""

import json

import numpy as np
import pytest
import torch

from conftest import write_config
from difftune.config import load_config
from difftune.data.cache import TensorCache
from difftune.models import get_family, tiny_model
from difftune.train.caching import encode_validation
from difftune.train.loop import train
from difftune.train.setup import build_run

BASE = dict(max_train_steps=1, validation_prompt="a red circle", validation_negative_prompt="blurry",
            validation_resolution="64x48", validation_num_inference_steps=2, validation_guidance=4.0,
            validation_seed=11)


class Sampler:
    """Samples of a config with `changes` over BASE: {request name and size: pixels}."""

    def __init__(self, family: str, root, dataset):
        self.name, self.root, self.dataset = family, root, dataset
        self.family = get_family(family)
        self.comps = self.family.load(str(tiny_model(family, "tiny-random")), torch.float32)
        self.cache = TensorCache(root / "text", self.family.identity(self.comps)["text"])
        self.count = 0

    def __call__(self, **changes) -> dict[str, np.ndarray]:
        self.count += 1
        config = write_config(self.root / str(self.count), self.dataset, model_family=self.name, **(BASE | changes))
        requests = encode_validation(load_config(config), self.family, self.comps, self.cache, [])
        out = {}
        for r in requests:
            image = self.family.sample(self.comps, self.comps.transformer, r)
            out[f"{r.name or 'main'}-{r.width}x{r.height}"] = np.asarray(image).astype(int)
        return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from difftune.demo import make_dataset

    root = tmp_path_factory.mktemp("validation-keys")
    make_dataset(root / "images", count=2)
    return root


@pytest.fixture(scope="module")
def lumina2(dataset):
    return Sampler("lumina2", dataset / "lumina2", dataset / "images")


@pytest.fixture(scope="module")
def kandinsky5(dataset):
    return Sampler("kandinsky5-image", dataset / "k5", dataset / "images")


def differs(a: dict, b: dict, name: str = "main-64x48") -> bool:
    assert a[name].shape == b[name].shape
    return bool(np.abs(a[name] - b[name]).max() > 0)


@pytest.mark.parametrize("key,value", [
    ("validation_prompt", "a blue square"),
    ("validation_negative_prompt", "sharp, bright"),
    ("validation_guidance", 1.5),
    ("validation_num_inference_steps", 3),
    ("validation_seed", 12),
])
def test_key_changes_the_sample(lumina2, key, value):
    assert differs(lumina2(), lumina2(**{key: value})), f"{key}={value!r} changed nothing"


def test_disable_unconditional_skips_only_the_empty_prompt_sample(lumina2):
    """SimpleTuner's meaning: the key skips the extra unconditional sample; guidance stays on."""
    on = lumina2()
    assert sorted(on) == ["main-64x48", "unconditional-64x48"]
    assert differs(on, {"main-64x48": on["unconditional-64x48"]})
    off = lumina2(validation_disable_unconditional=True)
    assert sorted(off) == ["main-64x48"] and not differs(on, off)
    # guidance and the negative prompt still take effect with the key set
    assert differs(off, lumina2(validation_disable_unconditional=True, validation_guidance=1.0))
    assert differs(off, lumina2(validation_disable_unconditional=True, validation_negative_prompt="x"))


def test_resolution_and_library_add_samples(lumina2, tmp_path):
    library = tmp_path / "prompts.json"
    library.write_text(json.dumps({"dog": "a dog"}))
    found = lumina2(validation_resolution="64x48,32x32", user_prompt_library=str(library),
                    validation_disable_unconditional=True)
    assert sorted(found) == ["dog-32x32", "dog-64x48", "main-32x32", "main-64x48"]
    assert found["main-32x32"].shape == (32, 32, 3)
    assert differs(found, {"main-64x48": found["dog-64x48"]})


@pytest.mark.parametrize("key,value", [("validation_guidance", 1.0), ("validation_negative_prompt", "sharp"),
                                       ("validation_seed", 12)])
def test_kandinsky5_keys_change_the_sample(kandinsky5, key, value):
    base = kandinsky5(validation_disable_unconditional=True)
    assert differs(base, kandinsky5(validation_disable_unconditional=True, **{key: value}))


def test_a_run_writes_the_unconditional_sample_beside_the_prompted_one(tmp_path, dataset):
    config = write_config(tmp_path, dataset / "images", **BASE)
    train(build_run(load_config(config)))
    names = sorted(p.name for p in (tmp_path / "output" / "validation").glob("*.png"))
    assert names == ["final-step-000001-64x48.png", "final-step-000001-unconditional-64x48.png"]
