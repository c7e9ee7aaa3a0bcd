"""optimizer adamw_schedulefree (schedulefree.AdamWScheduleFree) and optimizer_config: the config's checks, the
switch to the averaged weights around validation and saves (train/optimizers.py eval_weights) with losses that do
not change, exact resume, and the warm-up through the LR scheduler."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import config_problems as problems
from conftest import write_config
from difftune.config import load_config
from difftune.train import evaluation, loop
from difftune.train.loop import train
from difftune.train.optimizers import build_optimizer, eval_weights, train_mode
from difftune.train.setup import build_run
from test_train import crash_then_resume, losses

BETAS = (0.9, 0.999)
SAMPLE = dict(validation_prompt="a red circle", validation_resolution="32x32", validation_num_inference_steps=1,
              validation_disable_unconditional=True)



# --- config


def test_config_accepts_schedulefree_and_settings(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, optimizer="adamw_schedulefree", lr_warmup_steps=10,
                                   lr_scheduler="constant_with_warmup", optimizer_config="r=0.5, foreach=false,")).train
    assert cfg.optimizer == "adamw_schedulefree"
    assert cfg.optimizer_settings() == {"r": 0.5, "foreach": False}
    plain = load_config(write_config(tmp_path, dataset, optimizer_config="")).train
    assert plain.optimizer_config is None and plain.optimizer_settings() == {}
    prodigy = load_config(write_config(tmp_path, dataset, optimizer="prodigy", learning_rate=1.0,
                                       optimizer_config="d_coef=2,growth_rate=inf,slice_p=2")).train
    assert prodigy.optimizer_settings() == {"d_coef": 2, "growth_rate": float("inf"), "slice_p": 2}


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(optimizer="adamw_schedulefree", lr_scheduler="cosine"),
     "lr_scheduler 'cosine' does not combine with it: set lr_scheduler to 'constant'"),
    (dict(optimizer_config="amsgrad"), "optimizer_config: 'amsgrad' is not key=value"),
    (dict(optimizer_config="amsgrad=true,amsgrad=false"), "optimizer_config sets amsgrad twice"),
    (dict(optimizer_config="d_coef=2"), "optimizer_config d_coef=2: torch.optim.AdamW (optimizer 'adamw') has no "
                                        "setting 'd_coef'; its settings: amsgrad, maximize, foreach"),
    (dict(optimizer_config="lr=0.1"), "optimizer_config lr=0.1: lr is set by learning_rate: use that key instead"),
    (dict(optimizer_config="eps=1e-6"), "eps is set by adam_epsilon"),
    (dict(optimizer_config="weight_decay=0"), "weight_decay is set by adam_weight_decay"),
    (dict(optimizer="adamw_schedulefree", optimizer_config="warmup_steps=100"),
     "warmup_steps is set by lr_warmup_steps"),
    (dict(optimizer_config="amsgrad=yes"), "amsgrad takes true or false, got 'yes'"),
    (dict(optimizer="lion", optimizer_config="eps=1e-6"), "lion_pytorch.Lion (optimizer 'lion') has no setting 'eps'"),
])
def test_config_errors_name_the_key_and_the_fix(tmp_path, dataset, overrides, message):
    assert message in problems(write_config(tmp_path, dataset, **overrides))


def test_setting_checked_against_the_alias_and_on_the_command_line(tmp_path, dataset):
    path = write_config(tmp_path, dataset, optimizer="bnb-adamw8bit")
    assert "always keeps 8-bit state" in problems(path, optimizer_config="optim_bits=32")
    assert load_config(path, {"optimizer_config": "min_8bit_size=16"}).train.optimizer_settings() == {
        "min_8bit_size": 16}


# --- the optimizer alone


def toy() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)


def steps(model, opt, x, y, n: int, scheduler=None) -> None:
    for _ in range(n):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def test_eval_weights_holds_the_average_and_restores_exactly() -> None:
    model, x, y = toy()
    opt = build_optimizer("adamw_schedulefree", model.parameters(), 1e-2, BETAS, 1e-2, 1e-8)
    run = SimpleNamespace(optimizer=opt)
    steps(model, opt, x, y, 5)
    trained = [p.detach().clone() for p in model.parameters()]
    # x = y + (1 - 1/beta1) (z - y): the average the library evaluates at
    expected = [(t.double() + (1 - 1 / BETAS[0]) * (opt.state[p]["z"].double() - t.double())).float()
                for t, p in zip(trained, model.parameters(), strict=True)]
    with eval_weights(run):
        assert not opt.param_groups[0]["train_mode"]
        for p, e, t in zip(model.parameters(), expected, trained, strict=True):
            torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-6)
            assert (p.detach() - t).abs().max() > 1e-4  # far from the training weights
    assert opt.param_groups[0]["train_mode"]
    assert all(torch.equal(p.detach(), t) for p, t in zip(model.parameters(), trained, strict=True))
    # the library's own round trip is not exact (why the copy): after a checkpoint the weights are recomputed
    with eval_weights(run, for_checkpoint=True):
        pass
    assert any(not torch.equal(p.detach(), t) for p, t in zip(model.parameters(), trained, strict=True))
    assert all(torch.allclose(p.detach(), t, rtol=0, atol=1e-6) for p, t in zip(model.parameters(), trained, strict=True))


def test_eval_weights_changes_nothing_for_other_optimizers() -> None:
    model, x, y = toy()
    opt = build_optimizer("adamw", model.parameters(), 1e-2, BETAS, 1e-2, 1e-8)
    steps(model, opt, x, y, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with eval_weights(SimpleNamespace(optimizer=opt)):
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    train_mode(opt)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


def test_bf16_weights_switch_and_restore_exactly() -> None:
    """A bf16 full fine-tune: the state follows the weights' dtype, and the switch restores them bit for bit."""
    model, x, y = toy()
    model = model.to(torch.bfloat16)
    opt = build_optimizer("adamw_schedulefree", model.parameters(), 1e-2, BETAS, 1e-2, 1e-8)
    steps(model, opt, x.bfloat16(), y.bfloat16(), 3)
    assert opt.state[model.weight]["z"].dtype == torch.bfloat16
    trained = [p.detach().clone() for p in model.parameters()]
    with eval_weights(SimpleNamespace(optimizer=opt)):
        assert any(not torch.equal(p.detach(), t) for p, t in zip(model.parameters(), trained, strict=True))
    assert all(torch.equal(p.detach(), t) for p, t in zip(model.parameters(), trained, strict=True))


def test_warmup_through_the_scheduler_equals_the_librarys_own() -> None:
    """lr_warmup_steps warms up through the LR scheduler with the library's formula: the same numbers as its
    warmup_steps, bit for bit, and the optimizer's rate is the one the scheduler reports."""
    import schedulefree

    from difftune.config.schema import TrainConfig
    from difftune.train.lr_schedule import build_lr_scheduler

    model, x, y = toy()
    own = schedulefree.AdamWScheduleFree(model.parameters(), lr=1e-2, betas=BETAS, weight_decay=1e-2,
                                         warmup_steps=3)
    own.train()
    steps(model, own, x, y, 6)
    library = [p.detach().clone() for p in model.parameters()]

    model, x, y = toy()
    opt = build_optimizer("adamw_schedulefree", model.parameters(), 1e-2, BETAS, 1e-2, 1e-8)
    cfg = TrainConfig(model_family="lumina2", optimizer="adamw_schedulefree", learning_rate=1e-2, lr_warmup_steps=3,
                      max_train_steps=6)
    scheduler = build_lr_scheduler(cfg, opt, total_steps=6)
    rates = []
    for _ in range(6):
        rates.append(opt.param_groups[0]["lr"])
        steps(model, opt, x, y, 1, scheduler)
    assert rates == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2, 1e-2, 1e-2, 1e-2])
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), library, strict=True))


# --- training runs on the tiny Lumina2


def spy_sampling(monkeypatch) -> tuple[list[bool], list[bool]]:
    """Record the optimizer's train_mode each time validation samples, and each time CLIP evaluation scores (the
    scorer itself is not loaded: nothing is scored)."""
    modes: list[bool] = []
    scored: list[bool] = []
    real = loop.validate

    def spy(run, label, base=False):
        modes.append(run.optimizer.param_groups[0]["train_mode"])
        return real(run, label, base)

    monkeypatch.setattr(loop, "validate", spy)
    monkeypatch.setattr(evaluation, "score", lambda run, results: scored.append(
        run.optimizer.param_groups[0]["train_mode"]))
    return modes, scored


def test_validation_and_saves_use_the_averaged_weights_and_change_no_loss(tmp_path, dataset, monkeypatch):
    from difftune.models.tiny_clip import tiny_clip

    common = dict(optimizer="adamw_schedulefree", max_train_steps=4, checkpoint_step_interval=2, lr_warmup_steps=2)
    modes, scored = spy_sampling(monkeypatch)
    # samples at step 3, between the checkpoints (whose switch recomputes the training weights in both runs)
    run = build_run(load_config(write_config(tmp_path / "a", dataset, validation_step_interval=3, **SAMPLE,
                                             evaluation_type="clip", eval_steps_interval=3,
                                             evaluation_clip_model=str(tiny_clip()), **common)))
    train(run)
    out = tmp_path / "a" / "output"
    assert modes == [False, False]  # step 3, and the final samples (step 4): eval mode
    assert scored == [False]  # CLIP evaluation at step 3
    assert {p.name for p in (out / "validation").glob("*.png")} == {"step-000003-32x32.png",
                                                                   "final-step-000004-32x32.png"}
    plain = build_run(load_config(write_config(tmp_path / "b", dataset, **common)))
    train(plain)
    assert losses(out) == losses(plain.output_dir)  # sampling in eval mode changed no training weight
    assert len(losses(out)) == 4
    trained, trained_plain = run.adapter.state_dict(), plain.adapter.state_dict()
    assert all(torch.equal(trained[k], trained_plain[k]) for k in trained)  # bit for bit

    # The checkpoint holds the averaged weights x (and eval-mode optimizer state) ...
    opt = run.optimizer
    assert opt.param_groups[0]["train_mode"]
    named = {n: p for n, p in run.comps.transformer.named_parameters() if p.requires_grad}
    saved = load_file(out / "checkpoints" / "checkpoint-0000004" / "trainable.safetensors")
    state = torch.load(out / "checkpoints" / "checkpoint-0000004" / "optimizer.pt", weights_only=True)
    assert state["param_groups"][0]["train_mode"] is False
    assert saved.keys() == named.keys()
    far = 0.0
    for name, p in named.items():
        y, z = p.detach().double(), opt.state[p]["z"].double()
        torch.testing.assert_close(saved[name].double(), y + (1 - 1 / BETAS[0]) * (z - y), rtol=0, atol=1e-6)
        far = max(far, float((saved[name].double() - y).abs().max()))
    assert far > 1e-5  # ... not the training weights y
    # ... and the saved adapters are x too: the final result as the checkpoint's, not the LoRA of y
    result = load_file(out / "pytorch_lora_weights.safetensors")
    in_checkpoint = load_file(out / "checkpoints" / "checkpoint-0000004" / "pytorch_lora_weights.safetensors")
    training = load_file(run.adapter.save(tmp_path / "y"))  # train mode: the LoRA of y
    assert result.keys() == in_checkpoint.keys() == training.keys()
    for key in result:
        torch.testing.assert_close(result[key], in_checkpoint[key], rtol=0, atol=1e-6)
    assert max(float((result[k] - training[k]).abs().max()) for k in result) > 1e-5


def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path, dataset, monkeypatch):
    common = dict(optimizer="adamw_schedulefree", max_train_steps=5, checkpoint_step_interval=2, lr_warmup_steps=2,
                  resume_from_checkpoint="latest")
    train(build_run(load_config(write_config(tmp_path / "a", dataset, **common))))
    expected = losses(tmp_path / "a" / "output")
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", dataset, **common), at_step=3)  # resumes at 2
    out = tmp_path / "b" / "output"
    assert any(json.loads(line).get("message", "").startswith("resumed from")
               for line in (out / "events.jsonl").read_text().splitlines())
    assert losses(out) == expected  # bit for bit
    a = load_file(tmp_path / "a" / "output" / "pytorch_lora_weights.safetensors")
    b = load_file(out / "pytorch_lora_weights.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # about 60 s on 2 cores
def test_fsdp_two_processes_equal_one(tmp_path):
    """FSDP2: every process switches its own shards to the averaged weights before they are gathered, for the
    mid-run samples and the checkpoint: the same losses, samples and files as one process with the global batch."""
    import numpy as np
    from PIL import Image

    from difftune.demo import make_dataset
    from test_distributed import finish, launch

    images = tmp_path / "images"
    make_dataset(images, count=8)
    settings = dict(optimizer="adamw_schedulefree", max_train_steps=3, lr_warmup_steps=1, validation_step_interval=1,
                    checkpoint_step_interval=2, **SAMPLE)
    finish(launch(write_config(tmp_path / "two", images, train_batch_size=1, fsdp_enable=True, **settings), 29671))
    finish(launch(write_config(tmp_path / "one", images, train_batch_size=2, **settings), 0, processes=1))
    one, two = tmp_path / "one" / "output", tmp_path / "two" / "output"
    la, lb = losses(one), losses(two)
    assert la.keys() == lb.keys() == {1, 2, 3} and all(la[k] == pytest.approx(lb[k], rel=1e-5) for k in la)
    for name in ("pytorch_lora_weights.safetensors", "checkpoints/checkpoint-0000002/trainable.safetensors"):
        a, b = load_file(one / name), load_file(two / name)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)
    for label in ("step-000001", "step-000002", "final-step-000003"):
        a = np.asarray(Image.open(one / "validation" / f"{label}-32x32.png")).astype(int)
        b = np.asarray(Image.open(two / "validation" / f"{label}-32x32.png")).astype(int)
        assert np.abs(a - b).max() <= 1, label


def test_a_fresh_optimizer_has_no_state() -> None:
    """train() at construction touched every parameter's state entry: torch.distributed.checkpoint then took the
    state for initialised and read no tensor into it when an FSDP run resumed (the slow test below)."""
    p = torch.nn.Parameter(torch.ones(4))
    assert len(build_optimizer("adamw_schedulefree", [p], 1e-3, BETAS, 0.0, 1e-8).state) == 0


@pytest.mark.slow  # 35-50 s each on 2 cores (three two-process runs)
@pytest.mark.parametrize("layout", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_fsdp_resume_repeats_the_uninterrupted_run(tmp_path, layout):
    """Killed at a checkpoint and resumed under FSDP2: the same losses bit for bit. Before, z was never read back
    (SHARDED: step 5 was 5e-4 off; FULL: the resume failed with "Expected device to be set")."""
    from difftune.demo import make_dataset
    from test_distributed import finish, launch

    images = tmp_path / "images"
    make_dataset(images, count=8)
    common = dict(optimizer="adamw_schedulefree", train_batch_size=1, fsdp_enable=True, fsdp_state_dict_type=layout,
                  checkpoint_step_interval=2, resume_from_checkpoint="latest")
    finish(launch(write_config(tmp_path / "ref", images, max_train_steps=6, **common), 29751))
    finish(launch(write_config(tmp_path / "cut", images, max_train_steps=4, **common), 29752))
    finish(launch(write_config(tmp_path / "cut", images, max_train_steps=6, **common), 29753))
    log = [json.loads(line) for line in (tmp_path / "cut" / "output" / "events.jsonl").read_text().splitlines()]
    assert [e["message"] for e in log if e["event"] == "info" and "resumed" in e["message"]][-1].endswith("at step 4")
    assert losses(tmp_path / "ref" / "output") == losses(tmp_path / "cut" / "output")


def test_bf16_full_finetune_samples_without_changing_the_losses(tmp_path, dataset):
    """A full fine-tune of bf16 weights: the switch restores them bit for bit, and setup warns that small updates
    round away (no Kahan summation)."""
    common = dict(optimizer="adamw_schedulefree", model_type="full", mixed_precision="bf16", max_train_steps=3,
                  learning_rate=1e-4)
    run = build_run(load_config(write_config(tmp_path / "a", dataset, validation_step_interval=1, **SAMPLE,
                                             **common)))
    train(run)
    plain = build_run(load_config(write_config(tmp_path / "b", dataset, **common)))
    train(plain)
    assert run.params[0].dtype == torch.bfloat16
    assert losses(run.output_dir) == losses(plain.output_dir) and len(losses(plain.output_dir)) == 3
    a, b = run.adapter.state_dict(), plain.adapter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    events = [json.loads(line) for line in (run.output_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "warning" and "optimizer 'adamw_schedulefree' loses small updates" in e["message"]
               for e in events)
