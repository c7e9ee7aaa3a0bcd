"""Every optimizer name builds, steps, learns, and resumes exactly from its state_dict (CPU)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from difftune.train.optimizers import OPTIMIZERS, build_optimizer, optimizer_support, supported_optimizers

NAMES = list(OPTIMIZERS)
# A learning rate that suits each optimizer on the toy problem (Lion wants ~10x less, Prodigy 1.0).
# SGD's kinds and RAdam's (SGD for its first steps) want more on this toy problem, Adadelta far more.
LR = {"lion": 1e-3, "optimi-lion": 1e-3, "prodigy": 1.0, "torch-adadelta": 10.0, "bnb-lion": 1e-3, "bnb-lion8bit": 1e-3,
      "bnb-lion-paged": 1e-3, "bnb-lion8bit-paged": 1e-3, "torch-sgd": 1.0, "optimi-sgd": 1.0, "torch-asgd": 1.0,
      "torch-radam": 0.1, "optimi-radam": 0.1, "optimi-ranger": 0.1, "torch-adafactor": 0.1}
BETAS = (0.9, 0.999)


def lr_of(name: str) -> float:
    return LR.get(name, 1e-2)


def toy_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 64, generator=g)
    w = torch.randn(64, 64, generator=g) / 8
    return x, x @ w


def toy_model(dtype: torch.dtype = torch.float32, bias: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    # 64x64 = 4096 weights: large enough for bitsandbytes to use its 8-bit state; the bias (64) is not.
    return torch.nn.Linear(64, 64, bias=bias).to(dtype)


def model_for(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return toy_model(dtype, bias=name != "muon")  # Muon steps matrices only


def build(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    return build_optimizer(name, list(model.parameters()), lr_of(name), BETAS, weight_decay=1e-2, eps=1e-8)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = torch.nn.functional.mse_loss(model(x.to(model.weight.dtype)).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def roundtrip(obj: object) -> object:
    """Save and load as train/checkpoint.py does (torch.save, then torch.load with weights_only=True)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_descriptions_are_one_line() -> None:
    from difftune.train.optimizers import MAIN_OPTIMIZERS

    assert MAIN_OPTIMIZERS == ("adamw", "adamw_bf16", "lion", "optimi-stableadamw", "optimi-adamw", "optimi-lion",
                               "prodigy", "adamw8bit", "adamw_schedulefree")
    assert NAMES[:len(MAIN_OPTIMIZERS)] == list(MAIN_OPTIMIZERS) and len(NAMES) == 45
    for name, text in OPTIMIZERS.items():
        assert text and "\n" not in text, name


def test_module_import_is_light() -> None:
    # config/schema.py may import OPTIMIZERS, and the schema must not import torch.
    code = "import sys, difftune.train.optimizers as o; assert o.OPTIMIZERS; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_name_lists_the_choices() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="unknown optimizer 'adam'.*adamw, adamw_bf16, lion.*adamw8bit"):
        build_optimizer("adam", [p], 1e-3, BETAS, 0.0, 1e-8)


def test_no_parameters_is_an_error() -> None:
    with pytest.raises(ValueError, match="no parameters"):
        build_optimizer("adamw", [], 1e-3, BETAS, 0.0, 1e-8)


def test_every_name_works_on_cpu() -> None:
    support = optimizer_support("cpu")
    assert support == dict.fromkeys(NAMES), support
    assert supported_optimizers("cpu") == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_builds_and_steps(name: str) -> None:
    model = model_for(name)
    opt = build(name, model)
    assert isinstance(opt, torch.optim.Optimizer)
    before = weights(model)
    x, y = toy_data()
    for _ in range(2 if name == "soap" else 1):  # SOAP's first step only sets up its preconditioner
        train_step(model, opt, x, y)
    after = weights(model)
    assert all(torch.isfinite(a).all() for a in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("name", NAMES)
def test_loss_goes_down(name: str) -> None:
    model = model_for(name)
    opt = build(name, model)
    x, y = toy_data()
    losses = [train_step(model, opt, x, y) for _ in range(20)]
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(name, torch.float32) for name in NAMES] + [("adamw_bf16", torch.bfloat16), ("optimi-stableadamw", torch.bfloat16)],
)
def test_state_dict_resume_is_exact(name: str, dtype: torch.dtype) -> None:
    x, y = toy_data()
    model = model_for(name, dtype)
    opt = build(name, model)
    for _ in range(3):
        train_step(model, opt, x, y)
    saved_weights = roundtrip({str(i): w for i, w in enumerate(weights(model))})
    saved_opt = roundtrip(opt.state_dict())
    for _ in range(3):
        train_step(model, opt, x, y)  # the uninterrupted run

    resumed = model_for(name, dtype)
    with torch.no_grad():
        for i, p in enumerate(resumed.parameters()):
            p.copy_(saved_weights[str(i)])
    opt2 = build(name, resumed)
    opt2.load_state_dict(saved_opt)
    for _ in range(3):
        train_step(resumed, opt2, x, y)

    for a, b in zip(weights(resumed), weights(model), strict=True):
        assert a.dtype == dtype
        assert torch.equal(a, b)


def test_adamw8bit_keeps_8bit_state() -> None:
    model = toy_model()
    opt = build("adamw8bit", model)
    x, y = toy_data()
    train_step(model, opt, x, y)
    assert opt.state[model.weight]["state1"].dtype == torch.uint8
    assert opt.state[model.bias]["state1"].dtype == torch.float32  # under 4096 elements: 32-bit state


def test_prodigy_keeps_the_given_lr() -> None:
    """An AdamW-like rate is used as given; check notes it (tests/test_unused_keys.py)."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = build_optimizer("prodigy", [p], 1e-4, BETAS, 0.0, 1e-8)
    assert opt.param_groups[0]["lr"] == 1e-4


def small_update_run(name: str, steps: int = 1000) -> torch.Tensor:
    """bf16 weights of 1.0 and a constant gradient: each AdamW step moves a weight by about lr = 1e-5,
    far below bf16's resolution at 1.0 (2**-7 = 0.0078, so anything under 0.0039 rounds away)."""
    p = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    opt = build_optimizer(name, [p], 1e-5, BETAS, weight_decay=0.0, eps=1e-8)
    for _ in range(steps):
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    return p.detach().float()


def test_adamw_bf16_keeps_small_updates() -> None:
    plain = small_update_run("adamw")
    assert torch.equal(plain, torch.ones(256)), "plain AdamW on bf16 weights should lose every update"
    kahan = small_update_run("adamw_bf16")
    # 1000 steps of 1e-5 add up to 0.01, a little over two bf16 steps below 1.0 (2**-8 each): the Kahan
    # buffer carries what bf16 cannot hold, so the weights land on the bf16 value nearest 0.99.
    assert torch.allclose(kahan, torch.full((256,), 1 - 1000 * 1e-5), atol=2**-8), kahan[:4]


def test_simpletuner_aliases_build_the_same_optimizer() -> None:
    from difftune.train.optimizers import OPTIMIZER_ALIASES

    assert OPTIMIZER_ALIASES == {"torch-adamw": "adamw", "bnb-adamw8bit": "adamw8bit"}
    p = torch.nn.Parameter(torch.zeros(4))
    assert type(build_optimizer("torch-adamw", [p], 1e-3, (0.9, 0.999), 0.0, 1e-8)) is torch.optim.AdamW
    import optimi

    assert type(build_optimizer("optimi-lion", [p], 1e-3, (0.9, 0.99), 0.0, 1e-8)) is optimi.Lion


@pytest.mark.parametrize("name", NAMES)
def test_keywords_match_the_installed_library(name: str) -> None:
    """KEYWORDS (what optimizer_config is checked against, without importing anything) is each constructor's
    signature after `params`, defaults included."""
    import inspect

    from difftune.train.optimizers import KEYWORDS, REQUIRED, optimizer_class

    signature = inspect.signature(optimizer_class(name).__init__).parameters.values()
    actual = {p.name: REQUIRED if p.default is inspect.Parameter.empty else p.default
              for p in signature if p.name not in ("self", "params") and p.kind != p.VAR_KEYWORD}
    assert KEYWORDS[name] == actual


@pytest.mark.parametrize(("name", "settings", "check"), [
    ("adamw", {"amsgrad": True}, lambda opt: opt.param_groups[0]["amsgrad"] is True),
    ("prodigy", {"d_coef": 2}, lambda opt: opt.param_groups[0]["d_coef"] == 2),
    ("adamw_bf16", {"kahan_sum": False}, lambda opt: opt.param_groups[0]["kahan_sum"] is False),
    ("adamw_schedulefree", {"r": 0.5, "weight_lr_power": 1.0},
     lambda opt: (opt.param_groups[0]["r"], opt.param_groups[0]["weight_lr_power"]) == (0.5, 1.0)),
])
def test_settings_reach_the_constructor(name, settings, check) -> None:
    model = toy_model()
    plain = build(name, model)
    assert not check(plain)  # the default differs from the setting
    opt = build_optimizer(name, list(model.parameters()), lr_of(name), BETAS, 1e-2, 1e-8, settings=settings)
    assert check(opt)
    assert opt.param_groups[0]["lr"] == lr_of(name)  # difftune's own arguments stay


def test_amsgrad_changes_the_steps() -> None:
    x, y = toy_data()
    runs = []
    for settings in (None, {"amsgrad": True}):
        model = toy_model()
        opt = build_optimizer("adamw", list(model.parameters()), 1e-2, BETAS, 1e-2, 1e-8, settings=settings)
        runs.append([train_step(model, opt, x, y) for _ in range(10)])
    assert runs[0][:2] == runs[1][:2] and runs[0] != runs[1]  # AMSGrad keeps the largest second moment


@pytest.mark.parametrize(("name", "key", "value", "message"), [
    ("adamw", "d_coef", 2.0, r"torch.optim.AdamW \(optimizer 'adamw'\) has no setting 'd_coef'; its settings: "
     r"amsgrad, maximize"),
    ("lion", "eps", 1e-6, "has no setting 'eps'"),  # Lion has no epsilon: not 'use adam_epsilon'
    ("adamw", "lr", 0.1, "lr is set by learning_rate"),
    ("prodigy", "betas", 0.9, "betas is set by adam_beta1 and adam_beta2"),
    ("adamw", "weight_decay", 0.0, "use that key instead"),
    ("adamw_schedulefree", "warmup_steps", 10, "warmup_steps is set by lr_warmup_steps"),
    ("adamw", "amsgrad", 1, "amsgrad takes true or false, got 1"),
    ("prodigy", "d_coef", "big", "d_coef takes a number"),
    ("prodigy", "slice_p", 1.5, "slice_p takes a whole number"),
    ("adamw8bit", "optim_bits", 32, "always keeps 8-bit state"),
    ("optimi-adamw", "gradient_release", True, "optimizer_release_gradients"),
])
def test_setting_problems(name, key, value, message) -> None:
    import re

    from difftune.train.optimizers import setting_problem

    assert re.search(message, setting_problem(name, key, value))
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=f"optimizer_config {key}="):
        build_optimizer(name, [p], 1.0, BETAS, 0.0, 1e-8, settings={key: value})


def test_schedulefree_starts_in_train_mode_and_switches() -> None:
    """The parameters train at y; eval() puts the average x in them; train() goes back."""
    from difftune.train.optimizers import schedule_free

    model = toy_model()
    opt = build(name="adamw_schedulefree", model=model)
    assert schedule_free(opt) and opt.param_groups[0]["train_mode"]
    assert not schedule_free(build("adamw", toy_model()))
    x, y = toy_data()
    for _ in range(3):
        train_step(model, opt, x, y)
    trained = weights(model)
    opt.eval()
    averaged = weights(model)
    assert all(not torch.equal(a, b) for a, b in zip(averaged, trained, strict=True))
    opt.train()
    for a, b in zip(weights(model), trained, strict=True):
        torch.testing.assert_close(a, b)  # the same y, up to rounding


# SimpleTuner's optimizer_choices[name]["default_settings"] (simpletuner/helpers/training/optimizer_param.py)
SIMPLETUNER_DEFAULTS = {
    "optimi-lion": {"betas": (0.9, 0.99), "weight_decay": 0.0},
    "optimi-adamw": {"betas": (0.9, 0.99), "weight_decay": 0.0, "eps": 1e-6},
    "adamw_bf16": {"betas": (0.9, 0.999), "weight_decay": 1e-2, "eps": 1e-6},
}


def _built_group(config_path):
    """The parameter group of the optimizer a run builds from `config_path` (as train/setup.py calls it)."""
    from difftune.config import load_config

    cfg = load_config(config_path).train
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = build_optimizer(cfg.optimizer, [p], cfg.learning_rate, (cfg.adam_beta1, cfg.adam_beta2),
                          cfg.adam_weight_decay, cfg.adam_epsilon, cfg.optimizer_settings())
    group = dict(opt.param_groups[0])
    if "beta1" in group:  # optimi keeps its betas apart
        group["betas"] = (group["beta1"], group["beta2"])
    return group


@pytest.mark.parametrize("name", list(SIMPLETUNER_DEFAULTS))
def test_unset_adam_keys_take_simpletuners_defaults_for_the_optimizer(tmp_path, dataset, name) -> None:
    """A config that names only the optimizer trains it with SimpleTuner's settings for that name; adam_* keys set
    explicitly still apply."""
    from conftest import write_config

    group = _built_group(write_config(tmp_path, dataset, optimizer=name))
    for key, value in SIMPLETUNER_DEFAULTS[name].items():
        assert group[key] == pytest.approx(value), key
    assert ("eps" in group) == ("eps" in SIMPLETUNER_DEFAULTS[name])  # Lion has none
    explicit = dict(adam_beta1=0.8, adam_beta2=0.95, adam_weight_decay=0.05, adam_epsilon=1e-7)
    group = _built_group(write_config(tmp_path, dataset, optimizer=name, **explicit))
    assert tuple(group["betas"]) == pytest.approx((0.8, 0.95)) and group["weight_decay"] == pytest.approx(0.05)
    if "eps" in SIMPLETUNER_DEFAULTS[name]:
        assert group["eps"] == pytest.approx(1e-7)


def test_every_optimizer_name_has_defaults() -> None:
    from difftune.train.optimizers import DEFAULTS, hyper_parameters

    assert set(DEFAULTS) == set(OPTIMIZERS)
    assert hyper_parameters("bnb-adamw8bit") == ((0.9, 0.999), 1e-2, 1e-6)  # SimpleTuner's name for adamw8bit
    assert hyper_parameters("optimi-lion", beta2=0.999) == ((0.9, 0.999), 0.0, None)


@pytest.mark.parametrize("optimizer,instead", [("lion", "optimi-lion"), ("prodigy", "adamw_bf16"),
                                               ("adamw_bf16", None), ("optimi-lion", None)])
def test_a_bf16_full_fine_tune_warns_of_every_optimizer_without_kahan_summation(tmp_path, dataset, optimizer,
                                                                                 instead):
    """Only adamw and adamw_schedulefree were named; lion and prodigy changed 0.4% of the weights in 3 steps."""
    import json

    from conftest import write_config
    from difftune.config import load_config
    from difftune.train.setup import build_run

    run = build_run(load_config(write_config(tmp_path, dataset, model_type="full", mixed_precision="bf16",
                                             optimizer=optimizer, learning_rate=1.0 if optimizer == "prodigy" else 1e-5)))
    warned = [e["message"] for e in map(json.loads, (run.output_dir / "events.jsonl").read_text().splitlines())
              if e["event"] == "warning" and "loses small updates to rounding" in e["message"]]
    assert warned == ([f"full fine-tune of bf16/fp16 weights with optimizer '{optimizer}' loses small updates to "
                       f"rounding; use optimizer '{instead}' (Kahan summation)"] if instead else [])
