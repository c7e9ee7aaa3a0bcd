"""enable_model_cpu_offload: while the VAE decodes a validation sample the transformer is in CPU memory,
both go back afterwards, and the samples are the ones a run without it makes."""

from __future__ import annotations

import pytest
import torch

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.train.loop import train
from difftune.train.model_offload import model_cpu_offload
from difftune.train.setup import build_run


class Recorded(torch.nn.Linear):
    """A module that logs where it is sent."""

    def __init__(self, name: str, log: list) -> None:
        super().__init__(2, 2)
        self.name, self.log = name, log

    def to(self, *args, **kwargs):
        self.log.append((self.name, str(args[0])))
        return super().to(*args, **kwargs)


class Vae(Recorded):
    def decode(self, latents):
        self.log.append(("decode", str(latents.device)))
        return latents * 2


def test_transformer_leaves_while_the_vae_decodes():
    log: list = []
    transformer, vae = Recorded("transformer", log), Vae("vae", log)
    device = torch.device("cpu")  # the moves are what is checked; here they stay on the CPU
    with model_cpu_offload(True, transformer, vae, device):
        log.clear()
        out = vae.decode(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))
    assert log == [("transformer", "cpu"), ("vae", "cpu"), ("decode", "cpu"), ("vae", "cpu"), ("transformer", "cpu")]
    assert "decode" not in vae.__dict__  # the class's decode again
    log.clear()
    with model_cpu_offload(False, transformer, vae, device):
        vae.decode(torch.ones(2))
    assert log == [("vae", "cpu"), ("decode", "cpu")]  # off: the VAE goes to the accelerator once, as before


def test_samples_equal_those_without_offload(tmp_path, dataset):
    common = dict(max_train_steps=1, lora_rank=4, validation_prompt="a red circle", validation_resolution="32x32",
                  validation_num_inference_steps=2)
    images = {}
    for name, on in (("plain", False), ("offload", True)):
        run = build_run(load_config(write_config(tmp_path / name, dataset, enable_model_cpu_offload=on, **common)))
        train(run)
        folder = run.output_dir / "validation"
        images[name] = {p.name: p.read_bytes() for p in folder.glob("*.png")}
    assert images["plain"] and images["offload"] == images["plain"]


def test_not_with_block_streaming(tmp_path, dataset):
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, enable_model_cpu_offload=True, enable_group_offload=True))
    text = "\n".join(info.value.problems)
    assert "enable_model_cpu_offload" in text and "enable_group_offload" in text
