"""A tiny random CLIP (model + processor) saved in the hub folder layout, offline: what tests and the
spec fixtures point `evaluation_clip_model` at, since the hub's CLIP models cannot be downloaded there."""

from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_clip(folder: Path, seed: int = 0) -> Path:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from difftune.models.tiny_kandinsky5 import clip_tokenizer

    if (folder / "config.json").exists():
        return folder
    tokenizer = clip_tokenizer()
    vocab = len(tokenizer)
    config = CLIPConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, bos_token_id=vocab - 2,
                         eos_token_id=vocab - 1, pad_token_id=vocab - 1),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    model = CLIPModel(config)
    # Random towers give cosines around 0, which the score clamps to 0 for half of the samples. A real CLIP's
    # image and text embeddings share a common direction (scores of 15-35); here the two final norms share a
    # bias and the two projections a matrix, so scores land above 0 and still depend on image and text.
    with torch.no_grad():
        model.vision_model.post_layernorm.bias.fill_(1.0)
        model.text_model.final_layer_norm.bias.fill_(1.0)
        model.text_projection.weight.copy_(model.visual_projection.weight)
    model.save_pretrained(folder)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return folder


def tiny_clip() -> Path:
    """The tiny CLIP under DIFFTUNE_HOME/tiny, built once (in a temporary folder, then renamed)."""
    from difftune.models.tiny import ensure_built

    return ensure_built("clip-v1", build_tiny_clip, marker="config.json")
