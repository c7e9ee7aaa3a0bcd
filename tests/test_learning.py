"""The learning test: train a LoRA on one image; the stock pipeline with it samples closer to that image.

Metric: MSE in the model's latent space between a 20-step sample of the stock pipeline (no guidance)
and the training image's latents. Margin: the LoRA sample's error is under 70% of the base model's.
Measured on the tiny models: Lumina2 about 0.59 vs 1.05.
"""

import numpy as np
import pytest
import torch

from conftest import write_config
from difftune.config import load_config
from difftune.data.images import load_rgb, prepare
from difftune.demo import make_dataset
from difftune.models import get_family
from difftune.train.loop import train
from difftune.train.setup import build_run
from families import Case
from test_train import losses

SETTINGS = {
    "lumina2": dict(max_train_steps=300, learning_rate=5e-3, lora_rank=16, flow_schedule_shift=3.0),
    "kandinsky5-image": dict(max_train_steps=300, learning_rate=5e-3, lora_rank=16, flow_schedule_shift=3.0),
}


@pytest.mark.parametrize("case", [Case("lumina2", "tiny-random"), Case("kandinsky5-image", "tiny-random")],
                         ids=lambda c: c.id)
def test_learns_one_image(case, tmp_path):
    images = tmp_path / "one"
    make_dataset(images, count=1)
    path = write_config(tmp_path, images, model_family=case.family, model_flavour=case.flavour,
                        **SETTINGS[case.family])
    run = build_run(load_config(path))
    adapter = train(run)
    family = get_family(case.family)
    comps = family.load(run.comps.source, torch.float32)
    image = next(images.glob("*.png"))
    with torch.no_grad():
        target = family.encode_images(comps, prepare(load_rgb(image), (64, 64), "center", (0.5, 0.5))[None])
    pipe = case.stock(run.comps.source)
    caption = image.with_suffix(".txt").read_text()

    def error():
        out = case.stock_sample(pipe, caption, None, 64, 64, 20, 1.0, 0, output_type="latent")
        out = out if out.dim() == 4 else out[:, 0].permute(0, 3, 1, 2)  # Kandinsky: [B, 1, h, w, C]
        return torch.mean((out - target) ** 2).item()

    base_error = error()
    pipe.load_lora_weights(adapter.parent)
    tuned_error = error()
    print(f"{case.id}: base {base_error:.3f}, tuned {tuned_error:.3f}")
    assert tuned_error < 0.7 * base_error, (tuned_error, base_error)
    history = losses(run.output_dir)
    assert np.mean([history[s] for s in range(251, 301)]) < np.mean([history[s] for s in range(1, 51)])
