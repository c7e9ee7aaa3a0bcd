"""Family conformance, parametrized over every family and flavour, on tiny random-init models
loaded through the real from_pretrained path."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from peft.utils import get_peft_model_state_dict
from PIL import Image

from conftest import write_config
from difftune.adapters.kinds import LoraAdapter
from difftune.config import load_config
from difftune.config.schema import TrainConfig
from difftune.data.images import fit
from difftune.data.video import contact_sheet, decode_frames
from difftune.models import get_family, tiny_model
from difftune.models.base import SampleRequest
from difftune.train import objective
from difftune.train.loop import train
from difftune.train.setup import build_run
from families import CASES, case_data, wake_lora

IMAGE = Image.new("RGB", (64, 48), (200, 40, 40))


@pytest.fixture(params=CASES, ids=lambda c: c.id)
def case(request):
    return request.param


def load_case(case):  # not "setup": pytest 8.0 calls a module-level setup() as the module's xunit setup
    family = get_family(case.family)
    folder = tiny_model(case.family, case.flavour)
    comps = family.load(str(folder), torch.float32)
    return family, folder, comps


def text_for(family, comps, case, prompt="a red square", negative=False):
    return family.encode_text(comps, [prompt], negative=negative, images=[IMAGE] if case.i2i else None)[0]


def test_takes_conditioning_matches_flavour(case):
    family, _, comps = load_case(case)
    assert family.takes_conditioning(comps) == case.input_image == family.facts.takes_input_image(case.flavour)
    assert family.facts.needs_conditioning(case.flavour) == case.i2i and family.facts.first_frame(case.flavour) == case.i2v


def test_flow_convention(case):
    """An oracle network in the family's own convention: predict() returns the objective's target, and
    the stock pipeline driven by the same oracle lands on x0."""
    family, folder, comps = load_case(case)
    torch.manual_seed(0)
    x0 = case.latents(comps.vae.config.latent_channels, 6, 8, frames=6)  # i2v: >= 5 latent frames, see below
    noise = torch.randn_like(x0)
    x0_net = case.to_net(x0)

    def oracle(hidden_states, timestep, return_dict=False, **kwargs):
        out = case.oracle_output(x0_net, hidden_states, timestep)
        return SimpleNamespace(sample=out) if return_dict else (out,)

    comps.transformer.forward = oracle
    sigmas = torch.tensor([0.3])
    text = family.collate_text([text_for(family, comps, case)])
    pred = family.predict(comps.transformer, objective.noisy_input(x0, noise, sigmas), sigmas, text,
                          case.conditioning(x0))
    target = objective.velocity_target(x0, noise)
    if case.i2v:  # frame 0 is the clean input frame: not a velocity, and not trained
        pred, target = pred[:, :, 1:], target[:, :, 1:]
    torch.testing.assert_close(pred, target, atol=1e-5, rtol=1e-5)

    pipe = case.stock(folder)
    pipe.transformer = comps.transformer
    extra = {"num_frames": 21} if case.video else {}  # 6 latent frames
    out = case.stock_sample(pipe, "x", None, 64, 48, 4, 1.0, 0, image=IMAGE if case.input_image else None,
                            latents=case.to_net(noise).clone(), output_type="latent", **extra)
    out = out[..., : x0_net.shape[-1]].reshape(x0_net.shape)
    if case.i2v:  # the stock I2V keeps frame 0 as given and renormalizes frames 0-3 after sampling
        out, x0_net = out[:, 4:], x0_net[:, 4:]
    torch.testing.assert_close(out, x0_net, atol=1e-4, rtol=1e-4)


def test_lora_targets_attention_only_and_step_changes_only_adapter(case):
    family, _, comps = load_case(case)
    net = comps.transformer
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = LoraAdapter(TrainConfig(model_family=case.family, max_train_steps=1, lora_rank=4), family, net).parameters()
    wrapped = [n for n, m in net.named_modules() if hasattr(m, "lora_A")]
    assert wrapped
    for name in wrapped:
        assert "attn" in name or "attention" in name, name
        assert not any(bad in name for bad in ("feed_forward", "modulation", "ff", "embed")), name
    opt = torch.optim.AdamW(params, lr=1e-2)
    x0 = case.latents(comps.vae.config.latent_channels, 4, 4)
    text = family.collate_text([text_for(family, comps, case)])
    cond = torch.randn_like(x0) if case.i2i else case.conditioning(x0)
    loss = objective.flow_loss(family.predict(net, x0, torch.tensor([0.5]), text, cond), torch.randn_like(x0))
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    opt.step()
    after = {k.replace(".base_layer", ""): v for k, v in net.state_dict().items()}
    changed = {k for k in after if k not in before or not torch.equal(after[k], before[k])}
    assert changed and all("lora_" in k for k in changed)


def test_save_reload_identical_and_pipeline_runs(case, tmp_path):
    family, folder, comps = load_case(case)
    net = comps.transformer
    LoraAdapter(TrainConfig(model_family=case.family, max_train_steps=1, lora_rank=4, lora_alpha=16), family, net).parameters()
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    path = family.save_lora(tmp_path, get_peft_model_state_dict(net), net.peft_config["default"].to_dict())
    assert path.name == "pytorch_lora_weights.safetensors"
    pipe = case.stock(folder)
    pipe.load_lora_weights(tmp_path)
    x = case.latents(comps.vae.config.latent_channels, 4, 4)
    text = family.collate_text([text_for(family, comps, case)])
    cond = torch.randn_like(x) if case.i2i else case.conditioning(x)
    with torch.no_grad():
        ours = family.predict(net, x, torch.tensor([0.4]), text, cond)
        theirs = family.predict(pipe.transformer, x, torch.tensor([0.4]), text, cond)
    torch.testing.assert_close(ours, theirs)
    frames = 17 if case.video else 0  # the stock I2V renormalizes 4 latent frames against the next ones
    request = SampleRequest(text_for(family, comps, case), text_for(family, comps, case, "", negative=True),
                            64, 48, 2, 4.0, 0, IMAGE if case.input_image else None, frames=frames, fps=24.0)
    result = family.sample(comps, net, request)
    if case.video:
        assert len(result) == frames and {f.size for f in result} == {(64, 48)}
    else:
        assert result.size == (64, 48)


def test_train_and_validation_equal_stock_pipeline(case, tmp_path, dataset):
    dataset, extra = case_data(case, tmp_path, dataset)
    path = write_config(tmp_path, dataset, model_family=case.family, model_flavour=case.flavour,
                        max_train_steps=3, validation_prompt="a red circle", validation_negative_prompt="blurry",
                        validation_resolution="64x48", validation_num_inference_steps=3, validation_guidance=4.0,
                        validation_seed=11, **extra)
    run = build_run(load_config(path))
    wake_lora(run.transformer)
    train(run)
    frames = f"@{extra['validation_num_video_frames']}" if case.video else ""
    ours = np.asarray(Image.open(run.output_dir / "validation" / f"final-step-000003-64x48{frames}.png"))
    pipe = case.stock(run.comps.source)
    pipe.load_lora_weights(run.output_dir)
    image = Image.open(sorted((tmp_path / "inputs").glob("*.png"))[0]).convert("RGB") if case.i2i else None
    if case.i2i:  # the first pair's input image, fitted (not stretched) to 64x48 as a training input is
        image = fit(image, (64, 48), "center", (0.5, 0.5))
    if case.i2v:  # by default the first frame of the first training clip, fitted (not stretched) to 64x48
        image = fit(decode_frames(sorted(dataset.glob("*.mp4"))[0], [0.0])[0], (64, 48), "center", (0.5, 0.5))
    kw = {"num_frames": extra["validation_num_video_frames"]} if case.video else {}
    theirs = case.stock_sample(pipe, "a red circle", "blurry", 64, 48, 3, 4.0, 11, image=image,
                               device=run.accelerator.device, **kw)[0]
    if case.video:  # the PNG is the contact sheet of the video (the MP4 beside it is lossy)
        assert (run.output_dir / "validation" / f"final-step-000003-64x48{frames}.mp4").is_file()
        theirs = contact_sheet(theirs)
        assert ours.shape == np.asarray(theirs).shape
    else:
        assert ours.shape == (48, 64, 3)
    assert np.abs(ours.astype(int) - np.asarray(theirs).astype(int)).max() <= 1
