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
