"""caption_shuffle (config/caption_shuffle_keys.py, data/captions.py): shuffled variants of tag captions."""

from __future__ import annotations

import pytest

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.data.captions import CaptionShuffle, shuffled
from difftune.train.plan import discover_all

DOG = "dog, running, park, sunny day"


def test_simpletuners_example():
    """SimpleTuner's DATALOADER.md example: position_start 1, count 2: 'dog' stays first, the rest in two other
    orders; the same variants every time, whatever else is shuffled before."""
    rule = CaptionShuffle(count=2, seed=42, position_start=1)
    variants = shuffled(DOG, rule)
    assert len(variants) == 2 and len(set(variants)) == 2 and DOG not in variants
    for v in variants:
        assert v.startswith("dog, ") and sorted(v.split(", ")) == sorted(DOG.split(", "))
    shuffled("cat, sofa, window, night", rule)
    assert shuffled(DOG, rule) == variants
    assert shuffled(DOG, CaptionShuffle(count=2, seed=7, position_start=1)) != variants  # another seed


def test_few_tags_few_orders_and_the_separators():
    assert shuffled("dog, park", CaptionShuffle(position_start=1)) == ()  # fewer than position_start + 2 tags
    assert len(shuffled("a, b, c", CaptionShuffle(count=10))) == 5  # 3! orders less its own
    assert len(shuffled("a,b,c", CaptionShuffle(count=10))) == 5  # its own order, joined with ', ', is not a variant
    spaced = shuffled("red blue green", CaptionShuffle(count=2, split_on="space"))
    assert all(sorted(v.split(" ")) == ["blue", "green", "red"] for v in spaced)
    sentences = shuffled("A dog runs. The park is green. It is sunny.", CaptionShuffle(count=2, split_on="period"))
    assert all(v.endswith(".") and sorted(v.rstrip(".").split(". ")) ==
               ["A dog runs", "It is sunny", "The park is green"] for v in sentences)


def shuffle_config(tmp_path, dataset, block, **dataset_keys):
    for i, image in enumerate(sorted(dataset.glob("*.png"))):
        image.with_suffix(".txt").write_text(f"{DOG}, number {i}\nsecond line, b, c")
    return load_config(write_config(tmp_path, dataset, dataset={"caption_shuffle": block, **dataset_keys}))


def captions_of(cfg):
    (found,) = discover_all(cfg, write_metadata=False, fetch=False)
    return {s.path.name: s.captions for s in found.samples}, found


def test_each_caption_is_followed_by_its_variants(tmp_path, dataset):
    cfg = shuffle_config(tmp_path, dataset, {"enable": True, "count": 2, "position_start": 1})
    found, _ = captions_of(cfg)
    for captions in found.values():
        # each line of the caption file as written, then its variants: 2, and the one other order of 'b, c'
        assert len(captions) == 3 + 2 and len(set(captions)) == 5
        assert captions[0].startswith(f"{DOG}, number ") and all(c.startswith("dog, ") for c in captions[:3])
        assert captions[3:] == ("second line, b, c", "second line, c, b")
    # the run's seed chooses the variants; the block's seed wins over it
    block = {"enable": True, "count": 2, "position_start": 1}
    assert captions_of(shuffle_config(tmp_path / "same", dataset, block))[0] == found  # the same on every start
    reseeded = load_config(write_config(tmp_path / "run-seed", dataset, seed=8,
                                        dataset={"caption_shuffle": block}))
    assert captions_of(reseeded)[0] != found
    pinned = [load_config(write_config(tmp_path / f"pin{s}", dataset, seed=s,
                                       dataset={"caption_shuffle": {**block, "seed": 3}})) for s in (1, 2)]
    assert captions_of(pinned[0])[0] == captions_of(pinned[1])[0]


def test_without_the_original_and_with_a_trigger(tmp_path, dataset):
    cfg = shuffle_config(tmp_path, dataset, {"enable": True, "count": 1, "position_start": 3, "include_original": False},
                         instance_prompt="sks", prepend_instance_prompt=True)
    found, discovery = captions_of(cfg)
    for captions in found.values():
        # the first line shuffled (5 tags, 3 kept): its variant only; the second (3 tags) cannot be: kept as written
        assert len(captions) == 2 and captions[1] == "sks second line, b, c"
        assert captions[0].startswith("sks dog, running, park, ") and captions[0] != f"sks {DOG}"
    notes = [note for _, note in discovery.notes if note.startswith("caption_shuffle: ")]
    assert len(notes) == len(found) and "no other order of its tags (fewer than 5 tags split on comma, or all alike)" \
        in notes[0]


def test_config(tmp_path, dataset):
    off = shuffle_config(tmp_path / "off", dataset, {"enable": False, "count": 5})  # SimpleTuner's off block
    assert off.datasets.discovered()[0].caption_shuffle is None
    assert all(len(c) == 2 for c in captions_of(off)[0].values())
    for block, message in (({"enable": True, "split_on": "semicolon"}, "split_on"),
                           ({"enable": True, "count": 0}, "count"),
                           ({"enable": True, "shuffle_all": True}, "shuffle_all")):
        with pytest.raises(ConfigError, match=message):
            shuffle_config(tmp_path / message, dataset, block)


def test_a_note_where_nothing_is_shuffled(tmp_path, dataset):
    block = {"enable": True, "count": 2}
    cfg = shuffle_config(tmp_path, dataset, block, caption_strategy="instanceprompt", instance_prompt="sks")
    assert any("caption_shuffle not used: with caption_strategy 'instanceprompt'" in n for n in cfg.notes())
    assert not any("caption_shuffle" in n for n in shuffle_config(tmp_path / "used", dataset, block).notes())
