"""What only a CUDA device shows: block streaming on its side stream, TREAD's token plans made on the device.
Skipped without CUDA (`make test-gpu` runs these with the bf16 user-path tests on a GPU machine).

The CPU tests prove the same code synchronously; these catch what the CPU cannot: tensors made on the wrong
device (TREAD's plans were, and crashed every spec config with tread_config on a GPU) and copies on a second
stream racing the compute stream."""

from __future__ import annotations

import pytest
import torch

from difftune.models import get_family
from difftune.train import tread
from difftune.train.offload import BlockStreamer, streamed_blocks
from test_offload import STACKS, forward_backward, lora_lumina2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_side_stream_prefetch_gives_the_resident_loss_gradients_and_samples(checkpointing):
    expected = forward_backward(lora_lumina2(checkpointing=checkpointing).to(CUDA), CUDA)
    transformer = lora_lumina2(checkpointing=checkpointing)
    streamer = BlockStreamer(transformer, streamed_blocks(transformer, STACKS, None), 1, CUDA, prefetch=True)
    transformer.to(CUDA)
    assert streamer.stream is not None  # the side stream, not the synchronous CPU path
    repeats(expected, transformer)
    assert streamer.holding() == 0 and streamer.peak == 2


def repeats(expected, transformer, times: int = 3) -> None:
    """`times` steps of `transformer` give `expected` (loss, gradients, sample) exactly: a copy on the side stream
    that raced the compute stream shows up as a difference in some step, not necessarily the first."""
    for _ in range(times):
        for p in transformer.parameters():
            p.grad = None
        got = forward_backward(transformer, CUDA)
        assert torch.equal(expected[0], got[0])
        assert all(torch.equal(expected[1][n], got[1][n]) for n in expected[1])
        assert torch.equal(expected[2], got[2])


@pytest.mark.parametrize("family,kwargs,first", [
    ("lumina2", dict(hidden_states=torch.zeros(2, 4, 8, 8),
                     encoder_attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)), False),
    ("kandinsky5-video", dict(hidden_states=torch.zeros(2, 3, 8, 8, 4)), True),
])
def test_tread_plans_are_made_on_the_device(family, kwargs, first):
    fam = get_family(family)
    layout = tread.LAYOUTS[fam.tread_layout]
    transformer = type("T", (), {"config": type("C", (), {"patch_size": 2 if family == "lumina2" else (1, 2, 2)})})
    plan = layout.plan(transformer, {k: v.to(CUDA) for k, v in kwargs.items()}, 0.5,
                       torch.Generator(device=CUDA).manual_seed(0), first)
    assert plan is not None and plan.keep.device.type == "cuda"


def test_activation_offload_on_the_side_stream_gives_checkpointing_results_with_less_memory_kept():
    """gradient_checkpointing_backend 'unsloth' on CUDA: the copies to pinned memory and back run on a side stream;
    repeated steps give plain checkpointing's loss, gradients and samples, and between forward and backward the
    device holds less (the checkpointed inputs are in CPU memory)."""
    from types import SimpleNamespace

    from difftune.train.activation_offload import offload_activations

    def kept_after_forward(transformer) -> int:
        x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1)).to(CUDA)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = transformer(hidden_states=x, timestep=torch.rand(2, device=CUDA),
                           encoder_hidden_states=torch.randn(2, 5, 32, device=CUDA),
                           encoder_attention_mask=torch.ones(2, 5, dtype=torch.bool, device=CUDA)).sample.pow(2).mean()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        loss.backward()
        return kept

    plain = lora_lumina2(checkpointing=True).to(CUDA)
    expected = forward_backward(plain, CUDA)
    transformer = lora_lumina2().to(CUDA)
    cfg = SimpleNamespace(gradient_checkpointing_backend="unsloth", gradient_checkpointing_interval=None)
    offload = offload_activations(cfg, transformer, CUDA, lambda *a, **k: None)
    assert offload is not None and offload.stream is not None
    repeats(expected, transformer)
    assert offload.fetches == 3 * len(transformer.layers)
    assert kept_after_forward(transformer) < kept_after_forward(plain)


def test_optimizer_offload_steps_on_pinned_copies_and_gives_the_cpu_optimizers_weights():
    """optimizer_cpu_offload_method 'cpu' on CUDA: the gradients leave on the side stream, the optimizer steps CPU
    copies (pinned), and the weights the next forward reads are those a CPU optimizer made, bit for bit; the
    accelerator holds no optimizer state. A copy racing the compute stream shows as a difference in some step."""
    from difftune.train.optimizer_offload import HostStepOptimizer
    from difftune.train.optimizers import build_optimizer

    def build(params):
        return build_optimizer("adamw_bf16", params, 1e-2, (0.9, 0.999), 0.01, 1e-8)

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(256, 256, generator=g).bfloat16() for _ in range(4)]
    grads = [[torch.randn(256, 256, generator=g).bfloat16() for _ in start] for _ in range(5)]
    reference = [torch.nn.Parameter(w.clone()) for w in start]
    plain = build(reference)
    device = [torch.nn.Parameter(w.to(CUDA)) for w in start]
    optimizer = HostStepOptimizer(device, build, CUDA)
    assert optimizer.stream is not None and all(h.is_pinned() for h in optimizer.hosts)
    before = torch.cuda.memory_allocated()
    for step in grads:
        for p, q, grad in zip(reference, device, step, strict=True):
            p.grad, q.grad = grad.clone(), grad.to(CUDA)
        plain.step()
        optimizer.step()
        optimizer.zero_grad()
        outputs = [(q.float() * 2).sum() for q in device]  # the compute stream reads the weights at once
        assert all(torch.equal(p.cuda(), q) for p, q in zip(reference, device, strict=True))
        assert all(torch.isfinite(o) for o in outputs)
    assert all(t.device.type == "cpu" for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    assert torch.cuda.memory_allocated() <= before


def test_offloaded_gradients_leave_the_device_in_the_backward_pass():
    """optimizer_offload_gradients on CUDA: after backward the device holds no gradient, the pinned CPU copies equal
    the gradients a plain backward makes, and the step gives the weights a CPU optimizer gives."""
    from difftune.train.optimizer_offload import HostStepOptimizer
    from difftune.train.optimizers import build_optimizer

    def build(params):
        return build_optimizer("adamw", params, 1e-2, (0.9, 0.999), 0.0, 1e-8)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]).to(CUDA)
    reference = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]).to(CUDA)
    reference.load_state_dict(model.state_dict())
    cpu_reference = [torch.nn.Parameter(p.detach().cpu()) for p in reference.parameters()]
    plain = build(cpu_reference)
    optimizer = HostStepOptimizer(list(model.parameters()), build, CUDA, offload_gradients=True)
    x = torch.randn(64, 512, device=CUDA)
    for _ in range(3):
        model(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        assert all(p.grad is None for p in model.parameters())
        norm = optimizer.clip(1.0, "norm")
        expected = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 1.0)
        assert torch.allclose(norm, expected.cpu(), rtol=1e-5)
        for h, r, c in zip(optimizer.hosts, reference.parameters(), cpu_reference, strict=True):
            assert torch.allclose(h.grad, r.grad.cpu(), rtol=1e-5, atol=1e-7)
            c.grad = h.grad.clone()
        plain.step()
        optimizer.step()
        optimizer.zero_grad()
        reference.zero_grad()
        assert all(torch.equal(c.cuda(), p) for c, p in zip(cpu_reference, model.parameters(), strict=True))
        with torch.no_grad():  # the reference follows the offloaded weights, so every step compares one step
            for r, p in zip(reference.parameters(), model.parameters(), strict=True):
                r.copy_(p)
