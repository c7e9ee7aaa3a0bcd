"""Lumina2 specifics (the generic conformance suite is test_families.py)."""

import torch
from diffusers import Lumina2Pipeline

from difftune.models import get_family

FAMILY = get_family("lumina2")


def load(lumina2_dir):
    return FAMILY.load(str(lumina2_dir), torch.float32)


def test_text_encoding_matches_pipeline(lumina2_dir):
    comps = load(lumina2_dir)
    prompts = ["a red circle", "a much longer prompt about a blue square on green"]
    ours = FAMILY.encode_text(comps, prompts)
    pipe = Lumina2Pipeline.from_pretrained(lumina2_dir)
    embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device="cpu")
    for i, item in enumerate(ours):
        n = int(mask[i].sum())
        assert item["prompt_embeds"].shape[0] == n
        torch.testing.assert_close(item["prompt_embeds"], embeds[i, :n])
    batch = FAMILY.collate_text(ours)
    assert batch["attention_mask"].sum(1).tolist() == mask.sum(1).tolist()
