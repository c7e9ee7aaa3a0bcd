"""SimpleTuner's other optimizer names (train/optimizer_catalog.py): SimpleTuner's settings reach each constructor,
the planner's state bytes equal what each optimizer really keeps, the config's refusals (muon on non-matrices,
optimizers that cannot step FSDP2's shards, torch-sparseadam), notes of unused adam_* keys, and real training runs
with a resume. (Every name builds, learns and resumes from its state_dict in tests/test_optimizers.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import config_problems as problems
from conftest import write_config
from difftune.config import load_config
from difftune.train.optimizer_catalog import MORE_SPECS, state_bytes
from difftune.train.optimizers import build_optimizer


def group_of(name: str, betas=(None, None), weight_decay=None, eps=None, settings=None, shape=(8, 8)) -> dict:
    p = torch.nn.Parameter(torch.zeros(*shape))
    return build_optimizer(name, [p], 1e-3, betas, weight_decay, eps, settings).param_groups[0]


@pytest.mark.parametrize(("name", "expected"), [
    ("optimi-radam", {"decouple_wd": True, "kahan_sum": True, "weight_decay": 0.0, "eps": 1e-6}),
    ("optimi-ranger", {"decouple_wd": True, "kahan_sum": True, "k": 6, "alpha": 0.5}),
    ("optimi-adam", {"decouple_wd": False, "kahan_sum": True}),
    ("optimi-sgd", {"momentum": 0, "kahan_sum": True}),
    ("muon", {"momentum": 0.95, "nesterov": False, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.1,
              "eps": 1e-7}),
    ("torch-sgd", {"momentum": 0, "weight_decay": 0.0, "nesterov": False}),
    ("torch-adagrad", {"eps": 1e-10, "weight_decay": 0.0}),
    ("torch-nadam", {"betas": (0.9, 0.999), "momentum_decay": 4e-3}),
    ("ao-adamw8bit", {"betas": (0.9, 0.999), "weight_decay": 1e-2, "eps": 1e-6}),
    ("bnb-adamw", {"betas": (0.9, 0.999), "weight_decay": 1e-2, "eps": 1e-6}),
    ("bnb-lion8bit", {"betas": (0.9, 0.99), "weight_decay": 0.0}),
    ("bnb-ademamix", {"betas": (0.9, 0.999, 0.9999), "alpha": 5.0}),
    ("soap", {"betas": (0.95, 0.95), "weight_decay": 1e-2, "precondition_frequency": 10}),
])
def test_simpletuners_settings_for_the_name(name, expected) -> None:
    group = group_of(name)
    if "beta1" in group:  # optimi keeps its betas apart
        group["betas"] = (group["beta1"], group["beta2"])
    for key, value in expected.items():
        assert group[key] == (pytest.approx(value) if isinstance(value, float | tuple) else value), key


def test_adam_keys_set_the_first_two_of_three_betas() -> None:
    assert group_of("bnb-ademamix", betas=(0.8, 0.95))["betas"] == (0.8, 0.95, 0.9999)
    group = group_of("optimi-adan", betas=(0.9, None))
    assert (group["beta1"], group["beta2"], group["beta3"]) == pytest.approx((0.9, 0.92, 0.999))


def test_optimizer_config_reaches_the_new_names() -> None:
    assert group_of("torch-sgd", settings={"momentum": 0.9, "nesterov": True})["momentum"] == 0.9
    with pytest.raises(ValueError, match="optimizer_config optim_bits=32: the name chooses the state's bits"):
        group_of("bnb-lion", settings={"optim_bits": 32})
    with pytest.raises(ValueError, match="has no setting 'bogus'"):  # SOAP takes **kwargs: checked all the same
        group_of("soap", settings={"bogus": 1})


def test_muon_refuses_tensors_that_are_not_matrices() -> None:
    with pytest.raises(ValueError, match=r"'muon' steps 2-D weights only, and 1 of the 2 trained tensors are not "
                                         r"\(shapes \(8,\)\)"):
        build_optimizer("muon", [torch.nn.Parameter(torch.zeros(8, 8)), torch.nn.Parameter(torch.zeros(8))],
                        1e-3, (None, None), None, None)


def _state(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            for t in value if isinstance(value, list) else [value]:
                if not torch.is_tensor(t) or t.dim() == 0:
                    continue  # step counters
                if hasattr(t, "__tensor_flatten__"):  # torchao's quantised states: their inner tensors
                    names, _ = t.__tensor_flatten__()
                    total += sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
                else:
                    total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("name", sorted(MORE_SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_equal_the_real_state(name, dtype) -> None:
    """memory_plan's figure for each name against its real state after two steps (SOAP sets up on the first), on a
    matrix big enough for 8-bit states, one under 4096 elements and a vector."""
    shapes = [(128, 256), (48, 64), (3, 100)] + ([] if name == "muon" else [(64,)])
    params = [torch.nn.Parameter(torch.randn(*s, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = build_optimizer(name, params, 1e-3, (None, None), None, None)
    optimizer.step()
    optimizer.step()
    predicted = sum(state_bytes(name, s, dtype.itemsize) for s in shapes)
    assert abs(predicted - _state(optimizer)) <= 0.01 * predicted + 64 * len(shapes), (predicted, _state(optimizer))


def test_the_planner_counts_momentum_from_optimizer_config() -> None:
    from difftune.memory_plan.predict import optimizer_bytes

    assert optimizer_bytes("torch-sgd", [(64, 64)], 4) == 0
    assert optimizer_bytes("torch-sgd", [(64, 64)], 4, {"momentum": 0.9}) == 64 * 64 * 4
    assert optimizer_bytes("soap", [(16, 3072)], 4) == 2 * 16 * 3072 * 4 + 2 * (16 * 16 + 3072 * 3072) * 4


# --- the config


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(optimizer="muon", model_type="full"), "optimizer 'muon' steps 2-D weights only, and model_type 'full' "
                                                "(norms and biases) trains other tensors too"),
    (dict(optimizer="muon", use_dora=True), "use_dora (magnitude vectors)"),
    (dict(optimizer="adamw8bit", fsdp_enable=True), "optimizer 'adamw8bit' with fsdp_enable: bitsandbytes' kernels "
                                                     "take no sharded tensors"),
    (dict(optimizer="muon", fsdp_enable=True), "Muon orthogonalises each weight matrix: it needs whole matrices"),
    (dict(optimizer="torch-sparseadam"), "SparseAdam takes sparse gradients only"),
    (dict(optimizer="adamw_schedulefree+aggressive"), "the closest here is 'adamw_schedulefree' with "
                                                      "adam_weight_decay 1e-3"),
])
def test_config_refusals(tmp_path, dataset, overrides, message) -> None:
    assert message in problems(write_config(tmp_path, dataset, **overrides))


def test_element_wise_optimizers_shard(tmp_path, dataset) -> None:
    for name in ("torch-adam", "optimi-radam", "ao-adamw8bit"):
        assert load_config(write_config(tmp_path, dataset, optimizer=name, fsdp_enable=True)).train.optimizer == name


def test_unused_adam_keys_are_noted(tmp_path, dataset) -> None:
    from difftune.config.optimizer_keys import optimizer_notes

    cfg = load_config(write_config(tmp_path, dataset, optimizer="torch-sgd", adam_beta1=0.9,
                                   adam_epsilon=1e-8)).train
    notes = optimizer_notes(cfg)
    assert ("adam_beta1 0.9 not used: optimizer 'torch-sgd' has no betas (its momentum is optimizer_config "
            "momentum=...); remove it") in notes
    assert "adam_epsilon 1e-08 not used: optimizer 'torch-sgd' has no epsilon; remove it" in notes
    assert optimizer_notes(load_config(write_config(tmp_path, dataset, optimizer="soap", adam_beta1=0.9)).train) == []


# --- real runs


@pytest.mark.parametrize("name", ["muon", "ao-adamw8bit"])
def test_a_lora_trains_and_resumes_exactly(tmp_path, monkeypatch, name) -> None:
    """The tiny Lumina2's LoRA (every tensor 2-D: muon takes it) trains, and a run killed after its checkpoint resumes
    with the losses of the uninterrupted one (ao-adamw8bit: torchao's quantised state through torch.load with
    weights_only)."""
    from difftune.demo import make_dataset
    from difftune.train.loop import train
    from difftune.train.setup import build_run
    from test_train import crash_then_resume, losses

    images = tmp_path / "images"
    make_dataset(images, count=4)
    common = dict(max_train_steps=4, checkpoint_step_interval=2, train_batch_size=2, optimizer=name,
                  learning_rate=1e-2, resume_from_checkpoint="latest", lr_scheduler="linear")
    train(build_run(load_config(write_config(tmp_path / "a", images, **common))))
    expected = losses(tmp_path / "a" / "output")
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", images, **common), at_step=3)
    assert losses(tmp_path / "b" / "output") == expected

    def rates(out):  # each step's logged rate (the last logged, after a resume): torchao's was "tensor(0.0010)"
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        return {e["step"]: e["lr"] for e in events if e["event"] == "step"}

    assert rates(tmp_path / "b" / "output") == rates(tmp_path / "a" / "output")
    assert all(isinstance(v, float) for v in rates(tmp_path / "a" / "output").values())
    assert all(torch.isfinite(torch.tensor(v)) for v in expected.values()) and len(expected) == 4
    assert (tmp_path / "b" / "output" / "pytorch_lora_weights.safetensors").is_file()


def test_a_missing_package_fails_the_config(tmp_path, dataset, monkeypatch) -> None:
    """bitsandbytes is an optional extra: without it a bnb-* name fails at config time, before any model loads."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    text = problems(write_config(tmp_path, dataset, optimizer="bnb-lion8bit"))
    assert "optimizer 'bnb-lion8bit' needs the package 'bitsandbytes', which is not installed" in text
    assert "pip install 'difftune[bnb]'" in text
    assert load_config(write_config(tmp_path, dataset, optimizer="torch-adam")).train.optimizer == "torch-adam"


@pytest.mark.slow  # about 90 s on 2 cores (four two-process runs and one single)
@pytest.mark.parametrize("name", ["torch-adam", "optimi-radam", "ao-adamw8bit"])
def test_element_wise_optimizers_train_under_fsdp(tmp_path, name) -> None:
    """The names FSDP2 is not refused with step each process's shards. torch's Adam (element by element, one fp32
    state) gives one process's losses; torchao's 8-bit state quantises each shard's blocks, so it trains without
    matching a single process exactly. The sharded checkpoint is written."""
    from difftune.demo import make_dataset
    from test_distributed import finish, launch
    from test_train import losses

    images = tmp_path / "images"
    make_dataset(images, count=8)
    settings = dict(max_train_steps=2, optimizer=name, learning_rate=1e-2 if name != "torch-adam" else 1e-3)
    finish(launch(write_config(tmp_path / "two", images, train_batch_size=1, fsdp_enable=True, **settings),
                  29701 + ["torch-adam", "optimi-radam", "ao-adamw8bit"].index(name)))
    two = losses(tmp_path / "two" / "output")
    assert two.keys() == {1, 2} and all(torch.isfinite(torch.tensor(v)) for v in two.values())
    assert (tmp_path / "two" / "output" / "checkpoints" / "checkpoint-0000002" / "optimizer_fsdp").is_dir()
    if name == "torch-adam":
        finish(launch(write_config(tmp_path / "one", images, train_batch_size=2, **settings), 0, processes=1))
        one = losses(tmp_path / "one" / "output")
        assert all(one[k] == pytest.approx(two[k], rel=1e-5) for k in one)


def test_changed_betas_of_a_three_beta_optimizer_take_effect_on_resume(tmp_path, dataset) -> None:
    """AdEMAMix keeps three betas in its group; a resume with a changed adam_beta1 compared two names with three
    values (zip strict: a ValueError)."""
    from test_resume_changes import messages, run_with

    run_with(tmp_path, dataset, max_train_steps=2, optimizer="bnb-ademamix")
    run_with(tmp_path, dataset, max_train_steps=3, optimizer="bnb-ademamix", adam_beta1=0.8)
    out = tmp_path / "output"
    (group,) = torch.load(out / "checkpoints" / "checkpoint-0000003" / "optimizer.pt")["param_groups"]
    assert tuple(group["betas"]) == pytest.approx((0.8, 0.999, 0.9999))
    (info,) = [m for m in messages(out, "info") if "changed since it was saved" in m]
    assert "adam_beta1 0.9 -> 0.8" in info


def test_prodigy_steps_keeps_the_step_size_after_n_steps() -> None:
    """prodigy_steps 3: d adapts during steps 1-3, then stays exactly; the state_dict carries it into a resumed
    optimizer (built again with the same setting), which continues the same steps."""
    from test_optimizers import roundtrip, toy_data, toy_model, train_step, weights

    def run(steps, split=None):
        model, x_y = toy_model(), toy_data()
        build = lambda m: build_optimizer("prodigy", list(m.parameters()), 1.0, (None, None), None, None,  # noqa: E731
                                          prodigy_steps=steps)
        opt, ds = build(model), []
        for k in range(8):
            if k == split:  # a resume: weights and state through torch.save, into a fresh model and optimizer
                saved_w, saved_o = roundtrip(weights(model)), roundtrip(opt.state_dict())
                model = toy_model()
                with torch.no_grad():
                    for p, w in zip(model.parameters(), saved_w, strict=True):
                        p.copy_(w)
                opt = build(model)
                opt.load_state_dict(saved_o)
            train_step(model, opt, *x_y)
            ds.append(opt.param_groups[0]["d"])
        return ds, weights(model)

    free, _ = run(None)
    held, final = run(3)
    assert held[:3] == free[:3] and len(set(free[2:])) > 1
    assert set(held[2:]) == {held[2]}  # d after step 3, kept through step 8
    resumed, final_resumed = run(3, split=5)
    assert resumed == held and all(torch.equal(a, b) for a, b in zip(final, final_resumed, strict=True))


def test_prodigy_steps_is_prodigys(tmp_path, dataset) -> None:
    assert "prodigy_steps applies to optimizer 'prodigy', and optimizer is 'adamw'" in problems(
        write_config(tmp_path, dataset, prodigy_steps=100))
    cfg = load_config(write_config(tmp_path, dataset, optimizer="prodigy", learning_rate=1.0, prodigy_steps=100)).train
    assert cfg.prodigy_steps == 100
    assert load_config(write_config(tmp_path, dataset, prodigy_steps=0)).train.prodigy_steps == 0  # off: any optimizer


def test_amsgrad_is_refused_for_bitsandbytes() -> None:
    for name in ("bnb-adamw", "bnb-adam8bit"):
        with pytest.raises(ValueError, match="bitsandbytes' Adam and AdamW have no AMSGrad"):
            group_of(name, settings={"amsgrad": True})


@pytest.mark.parametrize(("settings", "advice"), [
    ("", "optimizer_config bf16_stochastic_round=true"), ("bf16_stochastic_round=true", None)])
def test_torchaos_stochastic_rounding_keeps_small_updates(tmp_path, dataset, settings, advice) -> None:
    from difftune.memory_plan.levers import lossless_optimizer
    from difftune.train.optimizers import small_update_advice

    cfg = load_config(write_config(tmp_path, dataset, optimizer="ao-adamw8bit", model_type="full",
                                   mixed_precision="bf16", optimizer_config=settings or None)).train
    got = small_update_advice(cfg)
    assert (got is None) if advice is None else got.startswith(advice)
    assert lossless_optimizer(cfg) == {}  # never swapped for adamw_bf16's 4x larger state
