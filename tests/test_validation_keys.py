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
from difftune.config.validation_triggers import samples_base_model
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


# --- base-model samples (disable_benchmark: false, validation_on_startup) and num_validation_images ------------

ONE = BASE | dict(validation_disable_unconditional=True)


def problems(path) -> str:
    from difftune.config.load import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(path)
    return "\n".join(info.value.problems)


def events(output) -> list[dict]:
    return [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()]


def pixels(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB")).astype(int)


def test_startup_and_image_count_keys_validate(tmp_path, dataset):
    images = dataset / "images"
    cfg = load_config(write_config(tmp_path, images, **BASE, validation_on_startup="true",
                                   disable_benchmark="false", num_validation_images=None)).train
    assert cfg.validation_on_startup and cfg.disable_benchmark is False and cfg.num_validation_images == 1
    assert load_config(write_config(tmp_path, images, max_train_steps=1)).train.disable_benchmark is True
    for key, value in [("validation_on_startup", True), ("num_validation_images", 3),
                       ("validation_epoch_interval", 2)]:
        text = problems(write_config(tmp_path / key, images, max_train_steps=1, **{key: value}))
        assert key in text and "validation_prompt" in text, text
    # SimpleTuner's config.json.example writes disable_benchmark "false": without a prompt it samples nothing, as
    # there (a user who removed the prompt was refused)
    quiet = load_config(write_config(tmp_path / "d", images, max_train_steps=1, disable_benchmark="false"))
    assert not samples_base_model(quiet.train)
    assert any(n.startswith("disable_benchmark false not used: no validation prompt") for n in quiet.notes())


def test_validation_disable_samples_nothing(tmp_path, dataset):
    """SimpleTuner's validation_disable (its LTX-2 quickstart sets it beside prompts) was refused."""
    images = dataset / "images"
    off = load_config(write_config(tmp_path, images, **BASE, validation_on_startup=True, disable_benchmark=False,
                                   num_validation_images=3, validation_epoch_interval=2, validation_prompt_library=True,
                                   validation_disable="true"))
    assert off.train.validation_prompts() == [] and not samples_base_model(off.train)
    assert off.train.num_validation_images == 1 and not off.train.validation_epoch_interval
    assert any(n.startswith("validation_disable: nothing is sampled") for n in off.notes())
    assert not any("no validation prompt is set" in n for n in off.notes())  # it is set; validation_disable won
    kept = load_config(write_config(tmp_path, images, **BASE, validation_disable=False)).train
    assert kept.validation_prompts() and not any("validation_disable" in n for n in load_config(
        write_config(tmp_path, images, **BASE)).notes())
    assert "num_validation_images" in problems(write_config(tmp_path / "n", images, **BASE, num_validation_images=0))


def test_base_model_samples_switch_the_adapter_off(tmp_path, dataset, lumina2):
    """validation_on_startup samples the base model even when the adapter starts from a trained LoRA (init_lora),
    num_validation_images seeds its images validation_seed, +1; sampling first changes no training loss."""
    images = dataset / "images"
    train(build_run(load_config(write_config(tmp_path / "lora", images, max_train_steps=2, learning_rate=5e-2))))
    start = dict(ONE, init_lora=str(tmp_path / "lora" / "output"))
    train(build_run(load_config(write_config(tmp_path / "on", images, **start, validation_on_startup=True,
                                             num_validation_images=2))))
    folder = tmp_path / "on" / "output" / "validation"
    assert sorted(p.name for p in folder.glob("*.png")) == [  # no comparison images: that is disable_benchmark's
        "base-model-64x48-1of2.png", "base-model-64x48-2of2.png",
        "final-step-000001-64x48-1of2.png", "final-step-000001-64x48-2of2.png"]
    plain = lumina2(validation_disable_unconditional=True)["main-64x48"]
    assert (pixels(folder / "base-model-64x48-1of2.png") == plain).all()
    assert (pixels(folder / "base-model-64x48-2of2.png") ==
            lumina2(validation_disable_unconditional=True, validation_seed=12)["main-64x48"]).all()
    assert np.abs(pixels(folder / "final-step-000001-64x48-1of2.png") - plain).max() > 0  # the LoRA is on after
    log = events(tmp_path / "on" / "output")
    base = [(e["step"], e["image"], e["seed"]) for e in log if e["event"] == "sample" and "base-model" in e["path"]]
    assert base == [(0, "1of2", 11), (0, "2of2", 12)]
    train(build_run(load_config(write_config(tmp_path / "off", images, **start))))
    losses = [[e["loss"] for e in events(tmp_path / name / "output") if e["event"] == "step"] for name in ("on", "off")]
    assert losses[0] == losses[1]


@pytest.mark.parametrize("kind", ["full", "lycoris"])
def test_base_model_samples_of_full_and_lycoris(tmp_path, dataset, lumina2, kind):
    extra = {"model_type": "full"}
    if kind == "lycoris":
        (tmp_path / "lycoris.json").write_text(json.dumps({"algo": "lokr", "linear_dim": 8, "linear_alpha": 4,
                                                           "factor": 4}))
        extra = {"lora_type": "lycoris", "lycoris_config": str(tmp_path / "lycoris.json")}
    train(build_run(load_config(write_config(tmp_path, dataset / "images", **ONE, **extra,
                                             validation_on_startup=True))))
    base = pixels(tmp_path / "output" / "validation" / "base-model-64x48.png")
    assert (base == lumina2(validation_disable_unconditional=True)["main-64x48"]).all()


def test_disable_benchmark_false_compares_with_the_base_model_once(tmp_path, dataset):
    """The base samples come before step 1 and not again after a resume; later images get a side-by-side."""
    images = dataset / "images"
    common = dict(ONE, disable_benchmark=False, resume_from_checkpoint="latest")
    train(build_run(load_config(write_config(tmp_path, images, **dict(common, max_train_steps=2,
                                                                      validation_step_interval=1)))))
    folder = tmp_path / "output" / "validation"
    assert sorted(p.name for p in folder.glob("*.png")) == [
        "base-model-64x48.png", "final-step-000002-64x48-vs-base.png", "final-step-000002-64x48.png",
        "step-000001-64x48-vs-base.png", "step-000001-64x48.png"]
    both = pixels(folder / "step-000001-64x48-vs-base.png")
    assert both.shape == (48, 128, 3)
    assert (both[:, :64] == pixels(folder / "base-model-64x48.png")).all()
    assert (both[:, 64:] == pixels(folder / "step-000001-64x48.png")).all()
    stamp = (folder / "base-model-64x48.png").stat().st_mtime_ns
    train(build_run(load_config(write_config(tmp_path, images, **dict(common, max_train_steps=3)))))
    log = events(tmp_path / "output")
    resumed = [i for i, e in enumerate(log) if e["event"] == "start"][-1]
    assert log[resumed]["step"] == 2
    assert not [e for e in log[resumed:] if e["event"] == "sample" and e["step"] == 0]
    assert (folder / "base-model-64x48.png").stat().st_mtime_ns == stamp
    assert (folder / "final-step-000003-64x48-vs-base.png").is_file()


def test_clip_scores_the_first_image_of_each_prompt(tmp_path, dataset):
    """With num_validation_images 2, a validation's CLIP score is the score of its first images (validation_seed),
    the same as with 1, so scores compare across settings."""
    from difftune.models.tiny_clip import tiny_clip

    clip = dict(ONE, evaluation_type="clip", evaluation_clip_model=str(tiny_clip()))
    scores = []
    for count in (1, 2):
        root = tmp_path / str(count)
        train(build_run(load_config(write_config(root, dataset / "images", **clip, num_validation_images=count))))
        (evaluated,) = [e for e in events(root / "output") if e["event"] == "evaluation"]
        scores.append(evaluated["scores"])
    assert scores[0] == scores[1] and len(scores[0]) == 1


def test_trackers_tag_each_image_of_a_prompt_apart(tmp_path):
    from PIL import Image

    from difftune.config.schema import TrainConfig
    from difftune.train.trackers import TrackerForwarder

    class Tracker:
        name, images = "tensorboard", []

        def log_images(self, values, step=None, **kwargs):
            self.images.append((step, sorted(values)))

    class Accelerator:
        trackers = [Tracker()]

        def init_trackers(self, *a, **k):
            pass

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    forward = TrackerForwarder(TrainConfig(model_family="lumina2", max_train_steps=1), Accelerator(), tmp_path)
    for image in ("1of2", "2of2"):
        forward("sample", {"step": 0, "prompt": "validation", "size": "8x8", "ema": False, "image": image,
                           "path": str(tmp_path / "a.png")})
    forward("sample", {"step": 0, "prompt": "validation", "size": "8x8", "ema": False, "path": str(tmp_path / "a.png")})
    assert Accelerator.trackers[0].images == [(0, ["validation/8x8/1of2"]),
                                              (0, ["validation/8x8/2of2"]), (0, ["validation/8x8"])]
