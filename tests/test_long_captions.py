"""A caption longer than the prompt length is cut at its end, and never changes the other captions of its batch.

diffusers 0.42's Kandinsky 5 pipelines cut every prompt of a batch by what the padded batch is over: one long
caption left the others with no tokens at all (T2I, T2V), or cut the input image's tokens out (I2I: the processor
raised). models/kandinsky5_image.fit_prompts cuts each prompt on its own first.
"""

import pytest
import torch
from PIL import Image

from difftune.models import get_family, tiny_model

LONG = " ".join(f"word{i} red cat" for i in range(900))  # about 3000 tokens: over every pipeline's length


@pytest.mark.parametrize("family,flavour,length", [
    ("kandinsky5-image", "tiny-random", 512),
    ("kandinsky5-image", "tiny-random-i2i", 1024),  # the input image's tokens count
    ("kandinsky5-video", "tiny-random", 512),
    ("lumina2", "tiny-random", 256),
])
def test_a_long_caption_is_cut_and_leaves_its_batch_alone(family, flavour, length):
    fam = get_family(family)
    comps = fam.load(str(tiny_model(family, flavour)), torch.float32)
    image = Image.new("RGB", (64, 64), (200, 10, 10))
    images = (lambda n: [image] * n) if flavour.endswith("i2i") else (lambda n: None)
    together = fam.encode_text(comps, ["a short caption", LONG], images=images(2))
    alone = fam.encode_text(comps, ["a short caption"], images=images(1))
    long_alone = fam.encode_text(comps, [LONG], images=images(1))
    short = together[0]["prompt_embeds"]
    assert short.shape[0] > 0
    torch.testing.assert_close(short, alone[0]["prompt_embeds"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[1]["prompt_embeds"], long_alone[0]["prompt_embeds"], rtol=1e-5, atol=1e-5)
    assert together[1]["prompt_embeds"].shape[0] == length  # cut to the length, not dropped


def test_the_run_names_cut_captions_once_instead_of_diffusers_padded_batch(tmp_path, capfd):
    """diffusers' Lumina2 pipeline warns with the cut-off tail of the whole padded batch (a megabyte of <pad> once):
    the run prints one warning naming the long caption instead, and the short captions are not affected."""
    import json

    from conftest import write_config
    from difftune.config import load_config
    from difftune.demo import make_dataset
    from difftune.train.setup import build_run

    images = tmp_path / "images"
    make_dataset(images, count=4)
    first = sorted(images.glob("*.txt"))[0]
    first.write_text(LONG)
    build_run(load_config(write_config(tmp_path, images, max_train_steps=1, caption_strategy="textfile")))
    err = capfd.readouterr().err
    assert "<pad>" not in err and "truncated because" not in err
    said = [json.loads(line) for line in (tmp_path / "output" / "events.jsonl").read_text().splitlines()]
    warnings = [e["message"] for e in said if e["event"] == "warning" and "prompt length" in e["message"]]
    assert len(warnings) == 1 and "1 caption(s)" in warnings[0] and "'word0 red cat" in warnings[0]
