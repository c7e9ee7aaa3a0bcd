"""TREAD token routing (train/tread.py) and scheduled sampling (train/rollout.py) on the tiny models."""

from __future__ import annotations

import math
from contextlib import nullcontext
from types import SimpleNamespace as NS

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.demo import make_dataset
from difftune.models import get_family, tiny_model
from difftune.train import objective, rollout, tread
from difftune.train.loop import train
from difftune.train.setup import build_run
from families import Case
from test_train import crash_then_resume, losses

HALF_OF_LAST = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -1}]}


def routes(*triples):
    return NS(routes=[NS(selection_ratio=r, start_layer_idx=a, end_layer_idx=b) for r, a, b in triples])


def test_routes_count_from_the_end_and_must_fit():
    assert tread.resolve_routes(routes((0.5, 2, -2)).routes, 28) == [tread.Route(2, 26, 0.5)]
    assert tread.resolve_routes(routes((0.5, 0, 3), (0.25, 4, -1)).routes, 8)[1] == tread.Route(4, 7, 0.25)
    with pytest.raises(tread.TreadError, match=r"routes\[0\]\.start_layer_idx 2 is out of range: the model has 2 blocks"):
        tread.resolve_routes(routes((0.5, 2, -2)).routes, 2)
    with pytest.raises(tread.TreadError, match=r"routes\[1\].*overlap"):
        tread.resolve_routes(routes((0.5, 0, 4), (0.5, -4, -1)).routes, 8)
    with pytest.raises(tread.TreadError, match="comes after"):
        tread.resolve_routes(routes((0.5, 5, 2)).routes, 8)


def test_config_keys_are_checked(tmp_path, dataset):
    ok = load_config(write_config(tmp_path, dataset, tread_config=HALF_OF_LAST, scheduled_sampling_max_step_offset=3,
                                  scheduled_sampling_probability=0.5)).train
    assert ok.tread_config.routes[0].end_layer_idx == -1 and ok.scheduled_sampling_sampler == "euler"
    bad = {
        "selection_ratio": dict(tread_config={"routes": [{"selection_ratio": 1.0, "start_layer_idx": 0,
                                                          "end_layer_idx": 1}]}),
        "scheduled_sampling_sampler": dict(scheduled_sampling_max_step_offset=3, scheduled_sampling_sampler="unipc"),
        "acts on rolled-out samples only": dict(scheduled_sampling_reflexflow=True),
        "_beta2 are both 0": dict(scheduled_sampling_max_step_offset=3, scheduled_sampling_probability=0.5,
                                  scheduled_sampling_reflexflow=True, scheduled_sampling_reflexflow_beta1=0.0,
                                  scheduled_sampling_reflexflow_beta2=0.0),
        "scheduled_sampling_strategy": dict(scheduled_sampling_strategy="biased_middle"),
        # told before any model loads when the indices count from the same end (else once the blocks are known)
        r"routes\[0\] and routes\[1\] overlap \(blocks 0 to 1 and 1 to 1\)": dict(tread_config={"routes": [
            {"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1},
            {"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 1}]}),
        r"routes\[0\] and routes\[1\] overlap \(blocks -3 to -1 and -4 to -3\)": dict(tread_config={"routes": [
            {"selection_ratio": 0.5, "start_layer_idx": -3, "end_layer_idx": -1},
            {"selection_ratio": 0.5, "start_layer_idx": -4, "end_layer_idx": -3}]}),
        r"routes\[0\]: start_layer_idx 3 comes after end_layer_idx 1": dict(tread_config={"routes": [
            {"selection_ratio": 0.5, "start_layer_idx": 3, "end_layer_idx": 1}]}),
        "replaces scheduled_sampling_probability": dict(scheduled_sampling_max_step_offset=3, scheduled_sampling_ramp_steps=5,
                                                        scheduled_sampling_probability=0.5),
    }
    for expected, keys in bad.items():
        with pytest.raises(ConfigError, match=expected):
            load_config(write_config(tmp_path / expected, dataset, **keys))
    text = '{"routes": [{"selection_ratio": 0.25, "start_layer_idx": 0, "end_layer_idx": 1}]}'
    cli = load_config(write_config(tmp_path / "cli", dataset), {"tread_config": text}).train  # --tread_config '{...}'
    assert cli.tread_config.routes[0].selection_ratio == 0.25
    # ReflexFlow's own settings are accepted while it is off, as the spec's defaults
    load_config(write_config(tmp_path / "rf", dataset, scheduled_sampling_reflexflow_beta1=10.0))
    on = load_config(write_config(tmp_path / "on", dataset, scheduled_sampling_max_step_offset=3,
                                  scheduled_sampling_probability=0.5))
    assert any("ReflexFlow is off" in note for note in on.notes())  # SimpleTuner would have turned it on
    chosen = load_config(write_config(tmp_path / "chosen", dataset, scheduled_sampling_max_step_offset=3,
                                      scheduled_sampling_probability=0.5, scheduled_sampling_reflexflow=False))
    assert not any("ReflexFlow" in note for note in chosen.notes())
    idle = load_config(write_config(tmp_path / "idle", dataset, tread_config={"routes": [
        {"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 0},
        {"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": -1}]}))
    assert [n for n in idle.notes() if "selection_ratio 0" in n] == [
        "tread_config route 1 (counting from 0): selection_ratio 0 routes no token past the blocks, so training runs "
        "as without it; set a share such as 0.5, or remove the route"]
    half = load_config(write_config(tmp_path / "half", dataset, tread_config=HALF_OF_LAST))
    assert not any("selection_ratio" in note for note in half.notes())


def _inputs(case: Case, transformer):
    torch.manual_seed(0)
    if case.family == "lumina2":  # two captions of different lengths: the joint sequence has a mask
        text = {"prompt_embeds": torch.randn(2, 5, 32), "attention_mask": torch.tensor([[1] * 5, [1] * 3 + [0] * 2])}
        return torch.randn(2, 4, 8, 8), text, None
    cfg = transformer.config
    text = {"prompt_embeds": torch.randn(1, 5, cfg.in_text_dim), "pooled": torch.randn(1, cfg.in_text_dim2)}
    x = torch.randn(1, 16, 3, 8, 8)
    return x, text, x[:, :, :1]


@pytest.mark.parametrize("case", [Case("lumina2", "tiny-random"), Case("kandinsky5-video", "tiny-random-i2v")],
                         ids=lambda c: c.id)
def test_routed_blocks_see_fewer_tokens(case):
    family = get_family(case.family)
    transformer = family.load(str(tiny_model(case.family, case.flavour)), torch.float32).transformer.train()
    x, text, cond = _inputs(case, transformer)
    sigmas = torch.full((x.shape[0],), 0.6)
    blocks = tread.LAYOUTS[family.tread_layout].blocks(transformer)

    def forward_backward():
        transformer.zero_grad()
        out = family.predict(transformer, x, sigmas, text, cond)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in transformer.parameters() if p.grad is not None]

    plain, plain_grads = forward_backward()
    last = len(blocks) - 1
    router = tread.attach(routes((0.0, 1, -1)), family, transformer, torch.Generator().manual_seed(0), case.i2v)
    same, same_grads = forward_backward()  # ratio 0: bit for bit the model without TREAD
    assert torch.equal(same, plain) and all(torch.equal(a, b) for a, b in zip(same_grads, plain_grads, strict=True))
    router.detach()

    router = tread.attach(routes((0.5, 1, -1)), family, transformer, torch.Generator().manual_seed(0), case.i2v)
    seen: list[int] = []
    for block in blocks:  # registered after the router's hooks: sees what the block sees
        block.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    routed, _ = forward_backward()
    if case.family == "lumina2":
        full, image = 5 + 16, 16  # longest caption + 4x4 patches
    else:
        full, image = 3 * 16, 2 * 16  # three latent frames of 4x4 patches; frame 0 (the input image) stays
    assert seen == [full] + [full - image // 2] * last
    assert not torch.allclose(routed, plain)
    keep = router.plans[0].keep
    if case.family == "lumina2":  # every caption token stays, at its place, in both samples
        assert keep[0, :5].tolist() == list(range(5)) and keep[1, :3].tolist() == list(range(3))
    else:
        assert keep[0, :16].tolist() == list(range(16))
    seen.clear()
    with torch.no_grad():  # sampling (and the rollouts) see every token
        assert torch.equal(family.predict(transformer, x, sigmas, text, cond), plain)
    transformer.eval()
    family.predict(transformer, x, sigmas, text, cond).sum().backward()
    assert seen == [full] * (2 * len(blocks))


def test_gradient_checkpointing_recomputes_the_same_route():
    case = Case("kandinsky5-image", "tiny-random")
    family = get_family(case.family)
    transformer = family.load(str(tiny_model(case.family, case.flavour)), torch.float32).transformer.train()
    torch.manual_seed(0)
    x = torch.randn(1, 16, 8, 8)
    text = {"prompt_embeds": torch.randn(1, 5, transformer.config.in_text_dim),
            "pooled": torch.randn(1, transformer.config.in_text_dim2)}
    tread.attach(routes((0.5, 1, 2)), family, transformer, generator := torch.Generator(), False)
    grads = []
    for checkpointing in (False, True):
        (transformer.enable_gradient_checkpointing if checkpointing else transformer.disable_gradient_checkpointing)()
        transformer.zero_grad()
        generator.manual_seed(3)
        family.predict(transformer, x, torch.tensor([0.4]), text).square().mean().backward()
        grads.append([p.grad for p in transformer.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_zero_ratio_and_zero_chance_train_exactly_as_without(tmp_path, dataset):
    common = dict(max_train_steps=2, train_batch_size=2)
    plain = build_run(load_config(write_config(tmp_path / "a", dataset, **common)))
    train(plain)
    off = build_run(load_config(write_config(
        tmp_path / "b", dataset, tread_config={"routes": [{"selection_ratio": 0.0, "start_layer_idx": 0,
                                                             "end_layer_idx": -1}]},
        scheduled_sampling_max_step_offset=4, scheduled_sampling_probability=0.0, **common)))
    train(off)
    assert losses(plain.output_dir) == losses(off.output_dir)
    a, b = (load_file(r.output_dir / "pytorch_lora_weights.safetensors") for r in (plain, off))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_tread_trains_validates_and_saves_a_loadable_adapter(tmp_path, dataset):
    case = Case("kandinsky5-image", "tiny-random")
    common = dict(model_family=case.family, model_flavour=case.flavour, max_train_steps=3,
                  validation_prompt="a red circle", validation_resolution="32x32", validation_num_inference_steps=2)
    base = build_run(load_config(write_config(tmp_path / "a", dataset, **common)))
    train(base)
    run = build_run(load_config(write_config(tmp_path / "b", dataset, tread_config={"routes": [
        {"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}, **common)))
    adapter = train(run)
    assert losses(run.output_dir) != losses(base.output_dir)
    assert list((run.output_dir / "validation").glob("final-step-000003*.png"))
    pipe = case.stock(run.comps.source)
    pipe.load_lora_weights(adapter.parent)
    assert any("lora" in name for name, _ in pipe.transformer.named_parameters())


@pytest.mark.slow
def test_resume_is_exact_with_tread_and_rollouts(tmp_path, monkeypatch):
    images = tmp_path / "images"
    make_dataset(images, count=4)
    common = dict(max_train_steps=4, checkpoint_step_interval=2, train_batch_size=2, resume_from_checkpoint="latest",
                  tread_config=HALF_OF_LAST, scheduled_sampling_max_step_offset=2, scheduled_sampling_ramp_steps=2,
                  scheduled_sampling_prob_start=0.5, scheduled_sampling_prob_end=1.0, validation_num_inference_steps=8,
                  scheduled_sampling_ramp_shape="cosine", scheduled_sampling_strategy="biased_late",
                  scheduled_sampling_reflexflow=True)
    full = write_config(tmp_path / "a", images, **common)
    train(build_run(load_config(full)))
    cut = write_config(tmp_path / "b", images, **common)
    crash_then_resume(monkeypatch, cut, at_step=3)  # dies after step 3, resumes from the checkpoint of step 2
    assert losses(tmp_path / "b" / "output") == losses(tmp_path / "a" / "output")


def _fake_run(bias: float, chance: float = 1.0, offset: int = 4, steps_done: int = 0):
    """A run whose model predicts the true velocity (noise - x0) plus `bias`."""
    x0, noise = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    family = NS(predict=lambda model, x, s, text, cond: (noise - x0) + bias)
    cfg = NS(scheduled_sampling_max_step_offset=offset, scheduled_sampling_ramp_steps=0, scheduled_sampling_start_step=0,
             scheduled_sampling_probability=chance, scheduled_sampling_strategy="uniform",
             validation_num_inference_steps=10)
    accelerator = NS(device=torch.device("cpu"), autocast=nullcontext, unwrap_model=lambda m: m)
    run = NS(cfg=cfg, state=NS(step=steps_done), generator=torch.Generator().manual_seed(1), family=family,
             accelerator=accelerator, comps=NS(transformer=NS(dtype=torch.float32)), transformer=None)
    return run, NS(global_size=3, offset=0, text={}, conditioning=None), x0, noise


def test_rollout_follows_the_flow_convention():
    sigmas = torch.tensor([0.2, 0.5, 0.9])
    run, batch, x0, noise = _fake_run(bias=0.0)
    x_t, implied, rolled, drift = rollout.noisy_input(run, batch, x0, noise, sigmas, shift=3.0)
    assert rolled is not None and rolled.any()
    torch.testing.assert_close(drift, torch.zeros_like(drift))
    # a perfect model's Euler steps stay on the straight path: the same latent and the same noise
    torch.testing.assert_close(x_t, objective.noisy_input(x0, noise, sigmas))
    torch.testing.assert_close(implied, noise)

    run, batch, x0, noise = _fake_run(bias=0.1)
    x_t, implied, rolled, drift = rollout.noisy_input(run, batch, x0, noise, sigmas, shift=3.0)
    truth = objective.noisy_input(x0, noise, sigmas)
    torch.testing.assert_close(drift, x_t - truth)
    assert torch.equal(drift.flatten(1).abs().amax(dim=1) > 0, rolled)  # only rolled-out samples drift
    drift = (x_t - truth).flatten(1).mean(dim=1)
    assert (drift < 0).any() and torch.all(drift <= 1e-6)  # the biased model drifted (downwards: s decreases)
    s = sigmas.view(-1, 1, 1, 1)
    torch.testing.assert_close((1 - s) * x0 + s * implied, x_t)  # the target leads from x~ to x0
    run, batch, x0, noise = _fake_run(bias=0.1, chance=0.0)
    state = run.generator.get_state()
    assert torch.equal(rollout.noisy_input(run, batch, x0, noise, sigmas, shift=3.0).x,
                       objective.noisy_input(x0, noise, sigmas))
    assert torch.equal(run.generator.get_state(), state)  # chance 0 draws nothing


def test_rollout_chance_ramps():
    cfg = NS(scheduled_sampling_max_step_offset=2, scheduled_sampling_ramp_steps=10, scheduled_sampling_prob_start=0.1,
             scheduled_sampling_prob_end=0.5, scheduled_sampling_probability=0.0, scheduled_sampling_start_step=0,
             scheduled_sampling_ramp_shape="linear")
    assert [rollout.chance(cfg, s) for s in (0, 5, 10, 50)] == pytest.approx([0.1, 0.3, 0.5, 0.5])
    cfg.scheduled_sampling_ramp_shape = "cosine"  # slow at both ends, the same middle
    assert [rollout.chance(cfg, s) for s in (0, 1, 5, 9, 10)] == pytest.approx(
        [0.1, 0.1 + 0.4 * (0.5 - 0.5 * math.cos(math.pi / 10)), 0.3, 0.5 - 0.4 * (0.5 - 0.5 * math.cos(math.pi / 10)), 0.5])
    cfg.scheduled_sampling_start_step = 4  # nothing before it; the ramp starts there
    assert [rollout.chance(cfg, s) for s in (0, 3, 4, 9, 14)] == pytest.approx([0.0, 0.0, 0.1, 0.3, 0.5])
    cfg.scheduled_sampling_ramp_steps, cfg.scheduled_sampling_probability = 0, 0.7
    assert [rollout.chance(cfg, s) for s in (3, 4)] == [0.0, 0.7]
    cfg.scheduled_sampling_max_step_offset = 0
    assert rollout.chance(cfg, 5) == 0.0


@pytest.mark.parametrize("strategy", ["uniform", "biased_early", "biased_late"])
def test_rollout_lengths_follow_the_strategy(strategy):
    cfg = NS(scheduled_sampling_max_step_offset=4, scheduled_sampling_strategy=strategy)
    k = rollout.rollout_steps(cfg, 40000, torch.Generator().manual_seed(0))
    share = torch.bincount(k, minlength=5).float() / k.numel()
    expected = {"uniform": [0.2] * 5, "biased_early": [0, 0.4, 0.3, 0.2, 0.1], "biased_late": [0, 0.1, 0.2, 0.3, 0.4]}
    torch.testing.assert_close(share, torch.tensor(expected[strategy]), atol=0.01, rtol=0)
    again = rollout.rollout_steps(cfg, 40000, torch.Generator().manual_seed(0))
    assert torch.equal(k, again)  # the run's generator decides: a resumed run draws the same lengths


def _reflex_cfg(on=True, alpha=1.0, beta1=10.0, beta2=1.0):
    return NS(scheduled_sampling_reflexflow=on, scheduled_sampling_reflexflow_alpha=alpha,
              scheduled_sampling_reflexflow_beta1=beta1, scheduled_sampling_reflexflow_beta2=beta2)


def drifted_batch():
    """Prediction, target and a Rolled of 3 video samples; sample 1 alone rolled out, drifted in its top half."""
    torch.manual_seed(0)
    pred, target = torch.randn(3, 4, 2, 6, 6), torch.randn(3, 4, 2, 6, 6)
    drift = torch.zeros(3, 4, 2, 6, 6)
    drift[1, :, :, :3] = 0.5  # sample 1 drifted in its top half only
    return pred, target, rollout.Rolled(torch.zeros(1), torch.zeros(1), torch.tensor([False, True, False]), drift)


def test_reflexflow_loss_terms():
    pred, target, rolled = drifted_batch()
    weights = torch.tensor([1.0, 2.0, 0.5])
    plain = objective.flow_loss(pred, target, weights)
    # off, or nothing rolled out: the plain flow loss, bit for bit
    assert torch.equal(rollout.loss(_reflex_cfg(on=False), pred, target, weights, rolled), plain)
    assert torch.equal(rollout.loss(_reflex_cfg(), pred, target, weights, rollout.Rolled(pred, pred)), plain)
    # alpha 0, beta1 0, beta2 1: the plain loss again (the weights are all 1)
    torch.testing.assert_close(rollout.loss(_reflex_cfg(alpha=0.0, beta1=0.0), pred, target, weights, rolled), plain)
    # by hand: sample 1's error weighted (1 + a |d| / mean|d|) / (1 + a) = 1.5 on the top half, 0.5 below
    error = (pred - target) ** 2
    w = torch.full((2, 6, 6), 0.5)
    w[:, :3] = 1.5
    compensated = (w * error[1]).mean()
    cosine = torch.nn.functional.cosine_similarity(pred[1].flatten(), target[1].flatten(), dim=0)
    per_sample = error.flatten(1).mean(dim=1)
    per_sample[1] = 0.7 * compensated + 3.0 * (2 - 2 * cosine)
    expected = (per_sample * weights).mean()
    got = rollout.loss(_reflex_cfg(alpha=1.0, beta1=3.0, beta2=0.7), pred, target, weights, rolled)
    torch.testing.assert_close(got, expected)
    # the input frame of image-to-video is left out of the drift as it is out of pred and target
    cut = rollout.loss(_reflex_cfg(), pred[:, :, 1:], target[:, :, 1:], None, rolled, first=1)
    assert torch.isfinite(cut)
    # the direction term is blind to the prediction's length, the weighted error is not
    direction_only = _reflex_cfg(beta1=1.0, beta2=0.0)
    torch.testing.assert_close(rollout.loss(direction_only, 2 * target, target, None, rolled),
                               objective.flow_loss(2 * target[[0, 2]], target[[0, 2]]) * 2 / 3)


def test_a_route_past_the_last_block_fails_before_any_model_loads(tmp_path, dataset, lumina2_dir, capsys):
    """`difftune check` said OK to a route past the transformer's last block, and `train` found it only once the
    model had loaded. The model folder's config.json (here the tiny model's 2 layers) says how many there are."""
    from difftune.cli import main
    from difftune.train.tread import TreadError, check_before_load

    route = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 5}]}
    config = write_config(tmp_path, dataset, model_flavour=None, pretrained_model_name_or_path=str(lumina2_dir),
                          tread_config=route)
    cfg = load_config(config).train
    with pytest.raises(TreadError, match=r"end_layer_idx 5 is out of range: the model has 2 blocks"):
        check_before_load(cfg)
    assert main(["check", "--config", str(config)]) != 0
    assert "end_layer_idx 5 is out of range" in capsys.readouterr().err
    fits = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -1}]}
    check_before_load(load_config(write_config(tmp_path, dataset, model_flavour=None, tread_config=fits,
                                               pretrained_model_name_or_path=str(lumina2_dir))).train)
    # the tiny flavour, a dry run's stand-in (SimpleTuner's TREAD preset copied: start 2, end -2), by check too
    copied = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}
    tiny = write_config(tmp_path, dataset, model_flavour="tiny-random", tread_config=copied)
    assert main(["check", "--config", str(tiny)]) != 0
    assert "start_layer_idx 2 is out of range: the model has 2 blocks" in (err := capsys.readouterr().err) and \
        "model_flavour 'tiny-random' is a tiny stand-in of 2 blocks" in err, err
