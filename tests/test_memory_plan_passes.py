"""`difftune plan` for DoRA (memory_plan/dora.py), the regularisation teacher and the evaluation loss
(memory_plan/passes.py), and schedule-free AdamW's state (predict.optimizer_bytes): each against what really
happens on the tiny models (and DoRA at real width, slow)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from conftest import write_config
from difftune.adapters.casts import skip_casts_under_autocast
from difftune.config import load_config
from difftune.demo import make_dataset
from difftune.memory_plan import architecture as A
from difftune.memory_plan import dora, measure, passes
from difftune.memory_plan.predict import (
    DTYPE_BYTES,
    Phase,
    _transformer,
    activation_bytes,
    coefficients_for,
    optimizer_bytes,
    predict,
    tokens_of,
)
from difftune.train.plan import discover_all


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-passes")
    make_dataset(root / "images", count=2)
    return root


def tiny_cfg(root, **keys):
    """A config under `root` (a folder of the module's tmp dir) training the module's images."""
    return load_config(write_config(root, root.parent / "images", mixed_precision="bf16",
                                    validation_resolution="64x64", **keys))


def loaded(cfg, use_dora: bool):
    from diffusers import Lumina2Transformer2DModel

    model = Lumina2Transformer2DModel.from_pretrained(A.architecture_of(cfg).name, subfolder="transformer",
                                                      torch_dtype=torch.bfloat16)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_rank, use_dora=use_dora,
                                 target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    skip_casts_under_autocast(model)  # as adapters/kinds.py: plain LoRA layers skip peft's input cast, DoRA's keep it
    return model


# --- DoRA -----------------------------------------------------------------------------------------------


def test_dora_magnitudes_are_counted_with_the_adapter(tiny):
    """The adapter line (and so gradients and optimizer state) counts peft's magnitude vectors: the parameters
    adapters/kinds.py trains with use_dora on the loaded model."""
    from difftune.adapters.kinds import build_adapter
    from difftune.models import get_family

    cfg = tiny_cfg(tiny / "dora", use_dora=True).train
    plain = tiny_cfg(tiny / "plain").train
    from diffusers import Lumina2Transformer2DModel

    base = Lumina2Transformer2DModel.from_pretrained(A.architecture_of(cfg).name, subfolder="transformer",
                                                     torch_dtype=torch.bfloat16)
    adapter = build_adapter(cfg, get_family(cfg.model_family), base)
    trained = sum(p.numel() for p in adapter.parameters())
    line = next(li for li in predict(cfg, None).phase("training").lines if li.label.startswith("adapter"))
    assert line.bytes == trained * 4
    plain_line = next(li for li in predict(plain, None).phase("training").lines if li.label.startswith("adapter"))
    assert line.bytes > plain_line.bytes  # the magnitudes: one per output row of each adapted layer


@pytest.mark.parametrize("checkpointing", [False, True])
def test_dora_saved_products_within_tolerance(tiny, checkpointing):
    """What the loss's graph holds after a DoRA forward of the whole tiny model (computed for real, bf16), against
    the plan's saved activations plus DoRA's saved products; and DoRA's share alone against the LoRA run's."""
    cfg = tiny_cfg(tiny / "dora", use_dora=True).train.model_copy(
        update={"gradient_checkpointing": checkpointing, "train_batch_size": 2})
    arch = A.architecture_of(cfg)
    blocks = _transformer(arch, "bf16", "no_change")[1]
    coefficients = coefficients_for(arch)[0]
    latent, text, bucket = (1, 24, 16), 40, (128, 192)
    kept = {}
    for use_dora in (False, True):
        by = measure.saved_by_block(arch, loaded(cfg, use_dora), latent, text, checkpointing, batch=2, kept=True)
        kept[use_dora] = sum(by.values())
    phase = Phase("training")
    dora.add_training(cfg, arch, blocks, coefficients, bucket, text, DTYPE_BYTES["bf16"], phase)
    products = next(li.bytes for li in phase.lines if li.label == "DoRA: saved products")
    saved, _, _ = activation_bytes(cfg, arch, blocks, tokens_of(arch, bucket), text, coefficients)
    assert saved + products == pytest.approx(kept[True], rel=0.15)
    if not checkpointing:  # checkpointed joint blocks keep only their inputs: DoRA's share is the refiners'
        assert products == pytest.approx(kept[True] - kept[False], rel=0.15)
    assert any(li.label.startswith("DoRA: recomputed") for li in phase.lines) == checkpointing


def test_dora_off_changes_nothing(tiny):
    cfg = tiny_cfg(tiny / "plain").train
    lines = [(li.label, li.bytes) for p in predict(cfg, None).phases for li in p.lines]
    assert not any("DoRA" in label for label, _ in lines)
    assert lines == [(li.label, li.bytes) for p in predict(cfg.model_copy(update={"use_dora": False}), None).phases
                     for li in p.lines]


class Attention(torch.nn.Module):
    """A self-attention as the families write it (Lumina2's names): q, k and v read one input, to_out.0 the
    flash attention's output."""

    def __init__(self, width: int, inner: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(width, inner, bias=False) for _ in range(3))
        self.to_out = torch.nn.ModuleList([torch.nn.Linear(inner, width, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.to_out[0](out.transpose(1, 2).flatten(2))


def test_dora_layer_bytes_exact_on_an_attention():
    """What the loss's graph keeps after a DoRA attention's forward (computed for real: bf16 base, fp32 adapter,
    bf16 autocast, the trainer's skipped LoRA casts), above the trainer's LoRA: dora.layer_bytes to the byte (the
    products, the kept input casts of k, v and to_out.0, the fp32 scale vectors)."""
    from peft import get_peft_model

    batch, tokens, width, inner, heads = 2, 12, 48, 64, 4
    kept = {}
    for use_dora in (False, True):
        torch.manual_seed(0)
        model = get_peft_model(Attention(width, inner, heads).to(torch.bfloat16),
                               LoraConfig(r=4, lora_alpha=4, use_dora=use_dora,
                                          target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        skip_casts_under_autocast(model)
        x = torch.randn(batch, tokens, width, dtype=torch.bfloat16, requires_grad=True)
        meter = measure.KeptBytes(model, ())
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(meter.pack,
                                                                                                   lambda t: t):
            loss = model(x).float().square().mean()
        kept[use_dora] = meter.kept()["outside"]
        assert loss.requires_grad
    rows = batch * tokens
    products = 2 * rows * (3 * inner + width) * 2  # base and LoRA outputs, bf16
    casts = rows * (2 * width + inner) * 2  # bf16 copies of k's, v's and to_out.0's inputs (q's was kept already)
    vectors = 3 * (3 * inner + width) * 4  # fp32 m/|W+sBA|, that - 1, |W+sBA|
    assert kept[True] - kept[False] == products + casts + vectors
    assert kept[True] - kept[False] == sum(dora.layer_bytes(name, rows, n_in, n_out, 2) for name, n_in, n_out in (
        ("to_q", width, inner), ("to_k", width, inner), ("to_v", width, inner), ("to_out.0", inner, width)))


@pytest.mark.parametrize("n_in,n_out", [(2304, 768), (768, 2304), (2304, 2304)])
def test_dora_weight_norm_transient(n_in, n_out):
    """One real-width DoRA layer's forward (bf16 base, fp32 adapter, bf16 autocast): its peak of live tensors
    above a plain LoRA layer's is the plan's weight-norm working set, within 15%."""
    from peft import get_peft_model

    rows = 16
    peaks = {}
    for use_dora in (False, True):
        model = torch.nn.Sequential(torch.nn.Linear(n_in, n_out, bias=False)).to(torch.bfloat16)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=["0"], use_dora=use_dora))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        x = torch.zeros(rows, n_in, dtype=torch.bfloat16)
        with measure.LiveBytes(exclude=list(model.parameters())) as meter, measure.ShapesOnly(), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
        peaks[use_dora] = meter.peak
    assert peaks[True] - peaks[False] == pytest.approx(dora.layer_norm_bytes(n_in, n_out, 2), rel=0.15)


@pytest.mark.slow
@pytest.mark.parametrize("family,flavour", [("lumina2", "2.0"), ("kandinsky5-image", "t2i-lite-sft")])
def test_dora_real_size_blocks_match_measurement(family, flavour):
    """At real width, 2 blocks per stack, computed under ShapesOnly: what each block's DoRA keeps in the graph above
    the trainer's LoRA (its products and kept input casts) within 15% of the rule (under a minute each on the
    CPU; the rule gives it to the byte, dora.py's docstring)."""
    from types import SimpleNamespace as NS

    name, config = A.real_architecture(family, flavour)
    arch = A.Architecture(family, name, config, known=True)
    latent, text = (1, 48, 48), 64
    kept = {}
    for use_dora in (False, True):
        model = measure.reduced_model(arch, "lora", dora=use_dora)
        kept[use_dora] = measure.per_stack(measure.saved_by_block(arch, model, latent, text, False, compute=False,
                                                                  kept=True))
        del model
    layers = dora.per_layer_bytes(NS(train_batch_size=1, lora_target_modules=None, model_family=family),
                                  arch, (384, 384), text, 2)
    for stack in A.STACKS[family]:
        rule = sum(v for k, v in layers.items() if k.startswith(f"{stack}.0."))
        measured = kept[True][stack] - kept[False][stack]
        print(f"{name} {stack}: DoRA measured {measured / 2**20:.2f} MiB, rule {rule / 2**20:.2f} MiB")
        assert rule == pytest.approx(measured, rel=0.15), stack


# --- the no-grad passes ---------------------------------------------------------------------------------


def test_regularisation_teacher_never_sets_the_peak(tiny):
    reg = tiny / "reg"
    make_dataset(reg, count=2, seed=3)
    entry = {"id": "reg", "type": "local", "dataset_type": "image", "instance_data_dir": str(reg),
             "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel_area",
             "cache_dir_vae": str(tiny / "cache" / "vae-reg"), "is_regularisation_data": True}
    run_cfg = tiny_cfg(tiny / "with-reg", extra_datasets=[entry])
    found = discover_all(run_cfg, write_metadata=False)
    with_reg = predict(run_cfg.train, found)
    note = next(n for n in with_reg.notes if n.startswith("regularisation data"))
    assert "never sets the peak" in note
    cfg = run_cfg.train
    arch = A.architecture_of(cfg)
    blocks = _transformer(arch, "bf16", "no_change")[1]
    training = with_reg.phase("training")
    for checkpointing in (False, True):  # the model's claim, with and without checkpointing, at the bucket
        changed = cfg.model_copy(update={"gradient_checkpointing": checkpointing, "train_batch_size": 4})
        step = predict(changed, found).phase("training")
        assert passes.teacher_peak(changed, arch, blocks, coefficients_for(arch)[0], (64, 64), step) < step.total
    assert passes.teacher_peak(cfg, arch, blocks, coefficients_for(arch)[0], (64, 64), training) < training.total
    plain_cfg = tiny_cfg(tiny / "no-reg")
    plain = predict(plain_cfg.train, discover_all(plain_cfg, write_metadata=False))
    assert not any(n.startswith("regularisation") for n in plain.notes)
    extra = {li.label for li in with_reg.phase("training").lines} - {li.label for li in plain.phase("training").lines}
    assert extra == {"regularisation target (fp32)"}


@pytest.mark.parametrize("eval_size,phase", [(64, False), (1024, True)])
def test_evaluation_pass_is_a_phase_only_when_larger(tiny, eval_size, phase):
    held = tiny / f"eval-{eval_size}"
    make_dataset(held, count=1, size=(eval_size, eval_size), seed=5)
    entry = {"id": "held", "type": "local", "dataset_type": "eval", "instance_data_dir": str(held),
             "caption_strategy": "textfile", "resolution": eval_size, "resolution_type": "pixel_area",
             "cache_dir_vae": str(tiny / "cache" / f"vae-eval-{eval_size}")}
    run_cfg = tiny_cfg(tiny / f"with-eval-{eval_size}", extra_datasets=[entry])
    prediction = predict(run_cfg.train, discover_all(run_cfg, write_metadata=False))
    names = [p.name for p in prediction.phases]
    assert ("evaluation loss" in names) == phase
    assert any(n.startswith("evaluation loss") for n in prediction.notes) != phase
    if phase:
        assert prediction.phase("evaluation loss").total > prediction.phase("training").total


# --- schedule-free AdamW --------------------------------------------------------------------------------


def test_schedulefree_state_bytes_match_the_optimizer():
    """optimizer_bytes('adamw_schedulefree') against the real optimizer's state tensors after one step."""
    import schedulefree

    params = [torch.nn.Parameter(torch.randn(n)) for n in (4096, 300, 17)]
    optimizer = schedulefree.AdamWScheduleFree(params, lr=1e-3)
    optimizer.train()
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.numel() > 1)
    assert optimizer_bytes("adamw_schedulefree", [p.numel() for p in params], 4) == state
