"""Family conformance for Lumina2 on the tiny random-init model (real from_pretrained path)."""

import torch
from diffusers import Lumina2Pipeline

from difftune.config.schema import TrainConfig
from difftune.models import get_family
from difftune.models.base import SampleRequest
from difftune.train import objective
from difftune.train.setup import attach_lora

FAMILY = get_family("lumina2")


def load(lumina2_dir):
    return FAMILY.load(str(lumina2_dir), torch.float32)


def cfg(**kw):
    return TrainConfig(model_family="lumina2", max_train_steps=1, mixed_precision="no", **kw)


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


def test_flow_convention_matches_stock_sampler(lumina2_dir):
    """An oracle network in the family's own convention: training's target and the pipeline agree."""
    comps = load(lumina2_dir)
    torch.manual_seed(0)
    x0 = torch.randn(1, 4, 8, 8)
    noise = torch.randn(1, 4, 8, 8)
    net = comps.transformer

    def oracle(hidden_states, timestep, **kwargs):
        s = (1.0 - timestep).view(-1, 1, 1, 1)
        velocity = (hidden_states - x0) / s  # noise - x0, recovered from x_t
        return (-velocity,)  # Lumina2 predicts x0 - noise

    net.forward = oracle
    # Training side: predict() on the oracle gives exactly the objective's target.
    sigmas = torch.tensor([0.3])
    x_t = objective.noisy_input(x0, noise, sigmas)
    text = {"prompt_embeds": torch.zeros(1, 3, 32), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    torch.testing.assert_close(FAMILY.predict(net, x_t, sigmas, text), objective.velocity_target(x0, noise))
    # Sampling side: the stock pipeline driven by the oracle lands on x0.
    pipe = Lumina2Pipeline(transformer=net, vae=comps.vae, text_encoder=comps.text_encoder,
                           tokenizer=comps.tokenizer, scheduler=comps.scheduler)
    out = pipe("x", height=64, width=64, num_inference_steps=4, guidance_scale=1.0, latents=noise.clone(),
               output_type="latent").images
    torch.testing.assert_close(out, x0, atol=1e-4, rtol=1e-4)


def test_lora_targets_and_one_step_changes_only_adapter(lumina2_dir):
    comps = load(lumina2_dir)
    net = comps.transformer
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = attach_lora(cfg(lora_rank=4), FAMILY, net)
    targets = [n for n, m in net.named_modules() if n.endswith(("to_q", "to_k", "to_v", "to_out.0"))]
    wrapped = [n for n, m in net.named_modules() if hasattr(m, "lora_A")]
    assert targets and sorted(targets) == sorted(wrapped)
    # lora_B starts at zero: turn it on so a step has something to change, then take one step.
    opt = torch.optim.AdamW(params, lr=1e-2)
    x = torch.randn(1, 4, 8, 8)
    text = {"prompt_embeds": torch.randn(1, 5, 32), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    loss = objective.flow_loss(FAMILY.predict(net, x, torch.tensor([0.5]), text), torch.randn_like(x))
    loss.backward()
    opt.step()
    after = {k.replace(".base_layer", ""): v for k, v in net.state_dict().items()}
    assert set(before) <= set(after)
    changed = {k for k in after if k not in before or not torch.equal(after[k], before[k])}
    assert changed and all("lora_" in k for k in changed)
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trainable)


def test_save_reload_identical_and_two_step_pipeline(lumina2_dir, tmp_path):
    comps = load(lumina2_dir)
    net = comps.transformer
    attach_lora(cfg(lora_rank=4, lora_alpha=16), FAMILY, net)  # alpha != rank must survive the round trip
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    from peft.utils import get_peft_model_state_dict

    path = FAMILY.save_lora(tmp_path, get_peft_model_state_dict(net), net.peft_config["default"].to_dict())
    assert path.name == "pytorch_lora_weights.safetensors"
    pipe = Lumina2Pipeline.from_pretrained(lumina2_dir)
    pipe.load_lora_weights(tmp_path)
    x = torch.randn(1, 4, 8, 8)
    text = {"prompt_embeds": torch.randn(1, 5, 32), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    with torch.no_grad():
        ours = FAMILY.predict(net, x, torch.tensor([0.4]), text)
        theirs = FAMILY.predict(pipe.transformer, x, torch.tensor([0.4]), text)
    torch.testing.assert_close(ours, theirs)
    emb = FAMILY.encode_text(comps, ["a cat"])[0]
    neg = FAMILY.encode_text(comps, [""], negative=True)[0]
    image = FAMILY.sample(comps, net, SampleRequest(emb, neg, 64, 48, 2, 4.0, 0))
    assert image.size == (64, 48)
