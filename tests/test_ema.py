"""EMA of the trainable parameters: closed form, interval, swap, resume, CPU shadow."""

from __future__ import annotations

import io

import pytest
import torch
from diffusers.training_utils import EMAModel

from difftune.train.ema import EMA

DEFAULT_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_params(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (4,), (3, 5, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in shapes]


def trajectory(n: int, seed: int = 1) -> list[list[torch.Tensor]]:
    """Parameter values after optimizer steps 1..n (index k-1 holds step k)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in [(8, 4), (4,), (3, 5, 2)]] for _ in range(n)]


def set_params(params: list[torch.nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)


def run(ema: EMA, params: list[torch.nn.Parameter], values: list[list[torch.Tensor]], first_step: int = 1) -> None:
    for k, v in enumerate(values, start=first_step):
        set_params(params, v)
        ema.step(k)


def closed_form(decay: float, updates: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """First update copies (diffusers' convention), then constant decay:
    s_N = d^(N-1) p_1 + (1 - d) * sum_{k=2..N} d^(N-k) p_k."""
    n = len(updates)
    out = []
    for j in range(len(updates[0])):
        s = decay ** (n - 1) * updates[0][j].double()
        for k in range(2, n + 1):
            s = s + (1 - decay) * decay ** (n - k) * updates[k - 1][j].double()
        out.append(s)
    return out


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 1e-6) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.cpu().double(), y.cpu().double(), atol=atol, rtol=0)


def to_bytes_and_back(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_constant_decay_matches_closed_form() -> None:
    params = make_params()
    ema = EMA(params, decay=0.9, update_interval=1, device="cpu")
    values = trajectory(25)
    run(ema, params, values)
    assert ema.num_updates == 25
    assert ema.last_decay == 0.9
    assert_close(ema.shadow_params, closed_form(0.9, values))


def test_update_interval_is_honoured() -> None:
    params = make_params()
    ema = EMA(params, decay=0.8, update_interval=3, device="accelerator")
    values = trajectory(10)
    updated = []
    for k, v in enumerate(values, start=1):
        set_params(params, v)
        updated.append(ema.step(k))
    assert [k for k, u in enumerate(updated, start=1) if u] == [3, 6, 9]
    assert ema.num_updates == 3
    assert_close(ema.shadow_params, closed_form(0.8, [values[2], values[5], values[8]]))


def test_no_update_before_the_first_interval_keeps_the_initial_weights() -> None:
    params = make_params()
    initial = [p.detach().clone() for p in params]
    ema = EMA(params, decay=0.9, update_interval=5)
    run(ema, params, trajectory(4))
    assert ema.num_updates == 0
    assert_close(ema.shadow_params, initial, atol=0)


def test_warmup_schedule_matches_diffusers_emamodel() -> None:
    """With the diffusers settings, the same values as diffusers' own EMAModel.step."""
    settings = {"decay": 0.999, "min_decay": 0.0, "use_ema_warmup": True, "power": 0.75, "update_after_step": 2}
    params = make_params()
    ema = EMA(params, update_interval=1, device="accelerator", **settings)
    ref_params = make_params()
    ref = EMAModel(ref_params, foreach=True, **settings)
    for k, v in enumerate(trajectory(30), start=1):
        set_params(params, v)
        set_params(ref_params, v)
        ema.step(k)
        ref.step(ref_params)
        assert ema.last_decay == ref.cur_decay_value
    assert_close(ema.shadow_params, ref.shadow_params, atol=1e-6)


def test_swap_restores_live_weights_exactly() -> None:
    params = make_params(dtype=torch.bfloat16)
    ema = EMA(params, decay=0.9, device="cpu")
    run(ema, params, trajectory(5))
    live = [p.detach().clone() for p in params]
    assert all(s.dtype == torch.float32 for s in ema.shadow_params)  # fp32 shadow of bf16 weights
    with ema.swap():
        for p, s in zip(params, ema.shadow_params, strict=True):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.detach(), s.to(torch.bfloat16))
        with pytest.raises(RuntimeError, match="nested"):
            with ema.swap():
                pass
    for p, w in zip(params, live, strict=True):
        assert torch.equal(p.detach(), w)
    with pytest.raises(ValueError, match="boom"), ema.swap():  # restored on an error too
        raise ValueError("boom")
    for p, w in zip(params, live, strict=True):
        assert torch.equal(p.detach(), w)


def test_swap_does_not_touch_autograd() -> None:
    params = make_params()
    ema = EMA(params, decay=0.5)
    run(ema, params, trajectory(3))
    with ema.swap():
        loss = sum((p**2).sum() for p in params)
        loss.backward()
    assert all(p.grad is not None and p.is_leaf for p in params)


@pytest.mark.parametrize("device", ["cpu", "accelerator"])
def test_state_dict_round_trip_gives_identical_future_updates(device: str) -> None:
    values = trajectory(20)
    params = make_params()
    ema = EMA(params, decay=0.95, update_interval=2, device=device)
    run(ema, params, values[:7])
    saved = to_bytes_and_back(ema.state_dict())
    run(ema, params, values[7:], first_step=8)  # the uninterrupted run

    params2 = make_params()
    resumed = EMA(params2, decay=0.95, update_interval=2, device=device)
    resumed.load_state_dict(saved)
    assert resumed.num_updates == 3
    run(resumed, params2, values[7:], first_step=8)
    assert resumed.num_updates == ema.num_updates == 10
    for a, b in zip(resumed.shadow_params, ema.shadow_params, strict=True):
        assert torch.equal(a, b)


def test_state_dict_is_loadable_by_diffusers() -> None:
    params = make_params()
    ema = EMA(params, decay=0.9)
    run(ema, params, trajectory(4))
    ref = EMAModel(make_params(), decay=0.5)
    ref.load_state_dict(to_bytes_and_back(ema.state_dict()))
    assert ref.decay == 0.9 and ref.optimization_step == 4
    assert_close(ref.shadow_params, ema.shadow_params, atol=0)


def test_load_state_dict_checks_shapes_and_warns_on_changed_settings() -> None:
    params = make_params()
    ema = EMA(params, decay=0.9)
    run(ema, params, trajectory(2))
    state = to_bytes_and_back(ema.state_dict())
    with pytest.raises(ValueError, match="does not match"):
        EMA(params[:2], decay=0.9).load_state_dict(state)
    other = EMA(make_params(), decay=0.99, update_interval=4)
    other.load_state_dict(state)
    assert other.changed == ("EMA settings differ from the checkpoint's: ema_decay 0.9 then, 0.99 now, "
                             "ema_update_interval 1 then, 4 now; the EMA goes on with this run's")
    assert other.ema.decay == 0.99 and other.update_interval == 4 and other.num_updates == 2


def test_cpu_shadow_with_params_on_the_default_device() -> None:
    """The shadow stays on the CPU while the parameters live on the accelerator (when there is one),
    and gives the same averages as a shadow kept beside the parameters."""
    values = trajectory(12)
    params = make_params(DEFAULT_DEVICE)
    on_cpu = EMA(params, decay=0.9, update_interval=1, device="cpu", chunk_bytes=64)  # several chunks
    beside = EMA(params, decay=0.9, update_interval=1, device="accelerator")
    assert all(s.device.type == "cpu" for s in on_cpu.shadow_params)
    assert all(s.device == p.device for s, p in zip(beside.shadow_params, params, strict=True))
    for k, v in enumerate(values, start=1):
        set_params(params, [t.to(DEFAULT_DEVICE) for t in v])
        on_cpu.step(k)
        beside.step(k)
    assert all(s.device.type == "cpu" for s in on_cpu.shadow_params)
    assert_close(on_cpu.shadow_params, beside.shadow_params)
    assert_close(on_cpu.shadow_params, closed_form(0.9, values))
    live = [p.detach().clone() for p in params]
    with on_cpu.swap():
        for p, s in zip(params, on_cpu.shadow_params, strict=True):
            assert p.device == DEFAULT_DEVICE
            assert torch.equal(p.detach().cpu(), s)
    assert all(torch.equal(p.detach(), w) for p, w in zip(params, live, strict=True))


def test_chunking_does_not_change_the_result() -> None:
    values = trajectory(6)
    params = make_params(dtype=torch.bfloat16)
    small = EMA(params, decay=0.7, chunk_bytes=1)
    large = EMA(params, decay=0.7)
    for k, v in enumerate(values, start=1):
        set_params(params, v)
        small.step(k)
        large.step(k)
    for a, b in zip(small.shadow_params, large.shadow_params, strict=True):
        assert torch.equal(a, b)


def test_bad_arguments() -> None:
    params = make_params()
    with pytest.raises(ValueError, match="'cpu' or 'accelerator'"):
        EMA(params, decay=0.9, device="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="update_interval"):
        EMA(params, decay=0.9, update_interval=0)
    with pytest.raises(ValueError, match="between 0 and 1"):
        EMA(params, decay=1.5)
    with pytest.raises(ValueError, match="no parameters"):
        EMA([], decay=0.9)


def test_an_ema_never_updated_is_said_when_it_is_saved(tmp_path, dataset):
    """ema_update_interval above the steps trained: "EMA adapter saved" and -ema samples of the starting weights
    (a LoRA's zero B), with no word that the EMA never moved."""
    import json

    from conftest import write_config
    from difftune.config import load_config
    from difftune.train.loop import train
    from difftune.train.setup import build_run

    run = build_run(load_config(write_config(tmp_path, dataset, use_ema=True, ema_update_interval=10,
                                             max_train_steps=2)))
    train(run)
    events = [json.loads(line) for line in (run.output_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "warning" and e["message"].startswith("the EMA was never updated (2 steps, "
                                                                   "ema_update_interval 10)") for e in events)
