"""max_upscale_threshold (SimpleTuner's dataset key): crop_aspect 'closest' / 'random' pick only the buckets that
enlarge an image by at most that fraction, and an image that every bucket would enlarge more is left out."""

from __future__ import annotations

import pytest

from conftest import write_config
from difftune.config import load_config
from difftune.data.buckets import SizeRule, allowed_aspects, bucket_for, upscale, upscale_problem
from difftune.demo import make_dataset
from difftune.train.plan import DataError, discover_all


def rule(**kw):
    base = dict(resolution=1024, resolution_type="pixel", crop=True, crop_aspect="random", multiple=16,
                crop_aspect_buckets=(1.0, 0.5, 2.0))
    return SizeRule(**base | kw)


def test_simpletuners_examples():
    """DATALOADER.md's example: at 1024 px with buckets 1.0, 0.5, 2.0 and a threshold of 0.2, a 256x256 image has no
    bucket (4x). An 860x860 one may take the square bucket (1.19x) but not the 2:1 ones, which it covers only
    enlarged 2.38x (SimpleTuner's page says an 850x850 image keeps every bucket, 1024 / 850 being "about 1.2");
    no threshold: every bucket."""
    limited = rule(max_upscale_threshold=0.2)
    assert allowed_aspects(256, 256, limited) == [] and "enlarged 4.00x at least" in upscale_problem(256, 256, limited)
    assert allowed_aspects(860, 860, limited) == [1.0] and upscale_problem(860, 860, limited) is None
    assert allowed_aspects(850, 850, limited) == []  # 1.205x: just over
    assert allowed_aspects(256, 256, rule()) == [0.5, 1.0, 2.0] and upscale_problem(256, 256, rule()) is None
    # random picks among the allowed ones only: every choice lands on the square bucket
    assert {bucket_for(860, 860, limited, c / 10) for c in range(10)} == {(1024, 1024)}
    assert len({bucket_for(860, 860, rule(), c / 10) for c in range(10)}) == 3
    # closest: the nearest aspect among those allowed (a wide image too small for the wide bucket goes square)
    wide = rule(crop_aspect="closest", max_upscale_threshold=0.2)
    assert bucket_for(1700, 900, wide) == (1024, 1024) and bucket_for(1700, 900, rule(crop_aspect="closest")) == \
        (2048, 1024)
    assert upscale(1700, 900, (1024, 1024)) <= 1.2 < upscale(1700, 900, (2048, 1024))
    # other crops do not pick from the buckets: the threshold does not apply
    assert upscale_problem(256, 256, rule(crop_aspect="square", max_upscale_threshold=0.2)) is None


def test_in_a_dataset_and_its_notes(tmp_path):
    images = tmp_path / "images"
    make_dataset(images, count=4)  # 96x64 and 64x96 pictures
    keys = {"resolution": 64, "resolution_type": "pixel", "crop": True, "crop_aspect": "closest",
            "crop_aspect_buckets": [1.0, 2.0]}
    (found,) = discover_all(load_config(write_config(tmp_path / "a", images, dataset=keys)), write_metadata=False,
                            fetch=False)
    assert len(found.samples) == 4
    cfg = load_config(write_config(tmp_path / "b", images, dataset={**keys, "resolution": 160,
                                                                    "max_upscale_threshold": 0.1}))
    with pytest.raises(DataError, match="more than max_upscale_threshold 0.1 allows"):  # each file's reason
        discover_all(cfg, write_metadata=False, fetch=False)
    # the config-level key is every dataset's default; unused without a pick from the buckets: a note
    cfg = load_config(write_config(tmp_path / "c", images, max_upscale_threshold=0.5))
    assert cfg.datasets.images[0].max_upscale_threshold == 0.5
    assert any("max_upscale_threshold not used" in n for n in cfg.notes())
