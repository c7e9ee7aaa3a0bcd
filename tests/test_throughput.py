"""FLOP counting (models/flops.py, each family's `forward_flops`) against torch's FlopCounterMode running the real
diffusers transformers, on the tiny models on the CPU and at real size on the meta device; and the throughput
fields of the "step" event (train/throughput.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest
import torch
from peft import LoraConfig
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import write_config
from difftune import bench_memory as real
from difftune.config import load_config
from difftune.demo import make_dataset
from difftune.memory_plan.architecture import Architecture, transformer_on_meta
from difftune.models import get_family, tiny_model
from difftune.models.flops import lora_forward
from difftune.train import throughput, tread
from difftune.train.loop import micro_step, train
from difftune.train.setup import build_run
from difftune.train.throughput import adapter_shapes, peak_tflops
from families import Case


def counted(fn) -> int:
    """FLOPs torch counts for `fn()`. The math attention kernel: its matmuls are counted (CPU flash attention is
    not in FlopCounterMode's table)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def close(ours: float, torchs: float, tolerance: float = 0.02) -> bool:
    return abs(ours - torchs) <= tolerance * torchs


def tiny_inputs(case: Case, transformer, batch: int, frames: int, captions: tuple[int, ...], h: int = 8, w: int = 12):
    """Latents, collated text (captions of these lengths, padded as training pads) and conditioning."""
    family, cfg = get_family(case.family), transformer.config
    torch.manual_seed(0)
    if case.family == "lumina2":
        text = family.collate_text([{"prompt_embeds": torch.randn(n, cfg.cap_feat_dim)} for n in captions])
        return torch.randn(batch, cfg.in_channels, h, w), text, None
    text = family.collate_text([{"prompt_embeds": torch.randn(n, cfg.in_text_dim), "pooled": torch.randn(cfg.in_text_dim2)}
                                for n in captions])
    x = torch.randn(batch, 16, frames, h, w) if case.video else torch.randn(batch, 16, h, w)
    cond = x[:, :, :1] if case.i2v else (torch.randn_like(x) if case.i2i else None)
    return x, text, cond


TINY = [  # (case, batch, latent frames, caption lengths)
    (Case("lumina2", "tiny-random"), 1, 1, (7,)),
    (Case("lumina2", "tiny-random"), 2, 1, (5, 9)),  # unequal captions: a masked joint sequence
    (Case("kandinsky5-image", "tiny-random"), 2, 1, (4, 6)),
    (Case("kandinsky5-image", "tiny-random-i2i"), 1, 1, (5,)),
    (Case("kandinsky5-video", "tiny-random"), 2, 3, (5, 5)),
    (Case("kandinsky5-video", "tiny-random-i2v"), 1, 4, (6,)),
]


@pytest.mark.parametrize(("case", "batch", "frames", "captions"), TINY,
                         ids=[f"{c.id}-b{b}-f{f}-{'x'.join(map(str, t))}" for c, b, f, t in TINY])
def test_forward_and_full_step_match_torch_on_the_tiny_models(case, batch, frames, captions):
    family = get_family(case.family)
    transformer = family.load(str(tiny_model(case.family, case.flavour)), torch.float32).transformer.train()
    x, text, cond = tiny_inputs(case, transformer, batch, frames, captions)
    sigmas = torch.full((batch,), 0.5)
    ours = family.forward_flops(transformer.config, x.shape, text["prompt_embeds"].shape[1], first_frame=case.i2v)
    assert close(ours.forward, counted(lambda: family.predict(transformer, x, sigmas, text, cond)))
    patches = frames * (x.shape[-2] // 2) * (x.shape[-1] // 2)
    assert ours.tokens == batch * patches
    transformer.requires_grad_(True)  # a full fine-tune: every weight's gradient, and every input gradient but the first
    step = counted(lambda: family.predict(transformer, x, sigmas, text, cond).square().mean().backward())
    assert close(ours.step(full=True), step)


def test_lumina2_joint_sequence_runs_to_the_longest_caption_not_the_padding():
    """Validation pads captions to 256: the context refiner computes the padding, the joint blocks stop at the
    longest caption."""
    case = Case("lumina2", "tiny-random")
    family = get_family(case.family)
    transformer = family.load(str(tiny_model(case.family, case.flavour)), torch.float32).transformer
    torch.manual_seed(0)
    text = family.collate_text([{"prompt_embeds": torch.randn(n, 32)} for n in (4, 6)], length=20)
    x = torch.randn(2, 4, 8, 8)
    torchs = counted(lambda: family.predict(transformer, x, torch.full((2,), 0.5), text))
    assert close(family.forward_flops(transformer.config, x.shape, 20, longest_caption=6).forward, torchs)
    assert not close(family.forward_flops(transformer.config, x.shape, 20).forward, torchs)


@pytest.mark.parametrize("case", [Case("lumina2", "tiny-random"), Case("kandinsky5-video", "tiny-random-i2v")],
                         ids=lambda c: c.id)
def test_tread_routed_blocks_are_counted_with_the_tokens_they_keep(case):
    family = get_family(case.family)
    transformer = family.load(str(tiny_model(case.family, case.flavour)), torch.float32).transformer.train()
    x, text, cond = tiny_inputs(case, transformer, 2, 3, (5, 8))
    config = NS(routes=[NS(selection_ratio=0.5, start_layer_idx=1, end_layer_idx=-1)])
    routes = tread.check(config, family, transformer)
    tread.attach(config, family, transformer, torch.Generator().manual_seed(0), case.i2v)
    sigmas = torch.full((2,), 0.5)
    with torch.enable_grad():  # TREAD routes only while training with gradients
        torchs = counted(lambda: family.predict(transformer, x, sigmas, text, cond))
    L = text["prompt_embeds"].shape[1]
    routed = family.forward_flops(transformer.config, x.shape, L, routes=routes, first_frame=case.i2v)
    assert close(routed.forward, torchs)
    assert routed.forward < family.forward_flops(transformer.config, x.shape, L, first_frame=case.i2v).forward


# --- real size, on the meta device (no memory) ----------------------------------------------------------------

REAL = {  # name: (family, architecture config, latent shape, text tokens)
    "Lumina2 512² bs2": ("lumina2", real.LUMINA2, (2, 16, 64, 64), 128),
    "K5 Image Lite 1024²": ("kandinsky5-image", real.K5_IMAGE_LITE, (1, 16, 128, 128), 128),
    "K5 Video Lite 768x512x81f": ("kandinsky5-video", real.K5_VIDEO_LITE, (1, 16, 21, 64, 96), 128),
}


def meta_forward(family_name: str, model, latent_shape, text_tokens):
    """One forward of the real-size model on meta tensors; returns its output."""
    family = get_family(family_name)
    batch = latent_shape[0]
    sigmas = torch.full((batch,), 0.5, device="meta")
    if family_name == "lumina2":
        # The model reads each caption's length from the mask (.tolist()): the mask stays a CPU tensor, and a
        # pre-hook hands it to the context refiner's attention on meta.
        for block in model.context_refiner:
            block.register_forward_pre_hook(lambda module, args: (args[0], args[1].to("meta"), *args[2:]))
        mask = torch.ones(batch, text_tokens, dtype=torch.long)
        mask[1:, text_tokens // 2:] = 0  # a shorter second caption
        return model(hidden_states=torch.empty(latent_shape, device="meta", dtype=torch.bfloat16),
                     timestep=sigmas, encoder_hidden_states=torch.empty(batch, text_tokens, model.config.cap_feat_dim,
                                                                        device="meta", dtype=torch.bfloat16),
                     encoder_attention_mask=mask, return_dict=False)[0]
    cfg = model.config
    text = {"prompt_embeds": torch.empty(batch, text_tokens, cfg.in_text_dim, device="meta"),
            "pooled": torch.empty(batch, cfg.in_text_dim2, device="meta")}
    return family.predict(model, torch.empty(latent_shape, device="meta", dtype=torch.bfloat16), sigmas, text)


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if "K5" in name else [])
                                  for name in REAL])  # 5 s, 13 s, 7 s
def test_real_size_forward_and_lora_step_match_torch_on_meta(name):
    family_name, config, shape, text_tokens = REAL[name]
    family = get_family(family_name)
    model = transformer_on_meta(Architecture(family_name, name, dict(config), True))
    ours = family.forward_flops(model.config, shape, text_tokens)
    assert close(ours.forward, counted(lambda: meta_forward(family_name, model, shape, text_tokens)))
    targets = family.lora_target_modules
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets if isinstance(targets, str) else list(targets)))
    model.train()
    torchs = counted(lambda: meta_forward(family_name, model, shape, text_tokens).float().sum().backward())
    adapter = lora_forward(ours, adapter_shapes(model))
    assert 0 < adapter < 0.02 * ours.forward
    assert close(ours.step(full=False, adapter=adapter), torchs)
    # a frozen base: the forward, input gradients (1x) and attention's backward (2x)
    assert 2 * ours.forward < ours.step(full=False, adapter=adapter) < 3 * ours.forward


def test_lumina2_lora_step_at_512_is_the_issues_22_tflop():
    family = get_family("lumina2")
    model = transformer_on_meta(Architecture("lumina2", "Lumina2", dict(real.LUMINA2), True))
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=list(family.lora_target_modules)))
    ours = family.forward_flops(model.config, (2, 16, 64, 64), 128)
    step = ours.step(full=False, adapter=lora_forward(ours, adapter_shapes(model)))
    assert 21e12 < step < 23e12  # "A Lumina2 LoRA step at 512² bs2 is about 22 TFLOP"
    assert 31e12 < ours.step(full=True) < 33.5e12


# --- the step event's fields ---------------------------------------------------------------------------------------

def test_peak_table_matches_device_names():
    expected = {
        "NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0, "NVIDIA H200": 989.4,
        "NVIDIA H200 NVL": 835.0, "NVIDIA GH200 480GB": 989.4, "NVIDIA H20": 148.0, "NVIDIA B200": 2250.0,
        "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA A10": 125.0, "NVIDIA L40S": 362.05,
        "NVIDIA L40": 181.05, "NVIDIA L4": 121.0, "NVIDIA GeForce RTX 4090": 165.2, "NVIDIA GeForce RTX 4090 D": 147.0,
        "NVIDIA GeForce RTX 3090": 71.0, "NVIDIA GeForce RTX 3090 Ti": 80.0, "NVIDIA GeForce RTX 5090": 209.5,
        "NVIDIA RTX 6000 Ada Generation": 364.2, "NVIDIA RTX A6000": 154.8, "AMD Instinct MI300X": 1307.4,
    }
    assert {name: peak_tflops(name) for name in expected} == expected
    for unknown in ("NVIDIA RTX A1000", "NVIDIA GeForce GTX 1080", "Tesla T4", "cpu", ""):
        assert peak_tflops(unknown) is None


def test_unknown_peak_says_how_to_set_it():
    family = get_family("lumina2")
    transformer = family.load(str(tiny_model("lumina2", "tiny-random")), torch.float32).transformer
    said = []
    cfg = NS(model_type="full", lora_type="standard", gpu_peak_tflops=None)
    meter = throughput.build(cfg, family, transformer, [], False, torch.device("cpu"),
                             lambda kind, **data: said.append((kind, data["message"])))
    assert meter.peak is None and len(said) == 1 and said[0][0] == "info" and "gpu_peak_tflops" in said[0][1]
    said.clear()
    meter = throughput.build(NS(model_type="full", lora_type="standard", gpu_peak_tflops=500.0), family, transformer,
                             [], False, torch.device("cpu"), lambda kind, **data: said.append(kind))
    assert meter.peak == 500.0 and not said


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_home):
    root = tmp_path_factory.mktemp("throughput")
    make_dataset(root / "images", count=4)
    cfg = load_config(write_config(root, root / "images", max_train_steps=2, train_batch_size=2,
                                   gradient_accumulation_steps=2, gpu_peak_tflops=2.0,
                                   validation_step_interval=0, checkpoint_step_interval=0))
    return build_run(cfg)


def test_fields_from_real_batches(tiny_run):
    run = tiny_run
    meter = run.throughput
    batches = iter(run.data)
    first, second = next(batches), next(batches)
    family, config = run.family, run.comps.transformer.config
    expected = 0.0
    for batch in (first, second):
        f = family.forward_flops(config, batch.latents.shape, batch.text["prompt_embeds"].shape[1])
        expected += f.step(full=False, adapter=lora_forward(f, adapter_shapes(run.comps.transformer)))
        meter.add(batch)
    fields = meter.step_fields(0.5)
    tokens = sum(b.latents.shape[0] * (b.latents.shape[-2] // 2) * (b.latents.shape[-1] // 2) for b in (first, second))
    assert fields.keys() == {"tflops", "tokens_per_s", "mfu"}  # no CUDA: no peak memory
    assert fields["tflops"] == pytest.approx(expected / 0.5 / 1e12, rel=1e-3)
    assert fields["tokens_per_s"] == pytest.approx(tokens / 0.5, rel=1e-3)
    assert fields["mfu"] == pytest.approx(fields["tflops"] / 2.0, rel=1e-3)  # gpu_peak_tflops 2
    assert meter.step_fields(0.5) == {}  # the sums start again at each step
    # the count of one micro-batch against torch's, through the loop's own micro_step (its LoRA on the tiny model:
    # the first adapted layers' skipped input gradients weigh a few percent here, under 1% at real size)
    meter.add(first)
    ours = meter.flops
    torchs = counted(lambda: micro_step(run, first).backward())
    assert close(ours, torchs, 0.05)
    meter.step_fields(1.0)  # the loop's next step starts from zero


def test_regularisation_adds_the_teachers_forward(tiny_run):
    """A micro-batch of regularisation data counts the base model's no-grad forward too (the teacher's pass in
    train/regularisation.py): ours against torch's count of the loop's micro_step, and exactly one forward more than
    the same micro-batch without regularisation data."""
    from dataclasses import replace

    run = tiny_run
    plain = next(iter(run.data))
    reg = replace(plain, regularisation=torch.ones(plain.latents.shape[0], dtype=torch.bool))
    shape, text = tuple(plain.latents.shape), int(plain.text["prompt_embeds"].shape[1])
    without, _ = run.throughput.micro_batch(shape, text)
    ours, _ = run.throughput.micro_batch(shape, text, teacher=True)
    forward = run.family.forward_flops(run.comps.transformer.config, shape, text).forward
    assert ours == pytest.approx(without + forward, rel=1e-9)
    torchs = counted(lambda: micro_step(run, reg).backward())
    assert close(ours, torchs, 0.05)
    assert not close(without, torchs, 0.05)  # the teacher's pass is visible in torch's count
    run.optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("n_in,n_out", [(64, 32), (48, 96)])
def test_dora_products_against_torch(n_in, n_out):
    """dora_flops against torch's count: a peft DoRA layer's forward (and backward) less the same LoRA layer's."""
    from peft import get_peft_model

    counts, models = {}, {}
    for use_dora in (False, True):
        torch.manual_seed(0)
        model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(n_in, n_out)),
                               LoraConfig(r=4, lora_alpha=4, target_modules=["0"], use_dora=use_dora))
        x = torch.randn(10, n_in)
        counts[use_dora] = counted(lambda m=model, x=x: m(x).square().sum().backward())
        models[use_dora] = model
    assert throughput.dora_flops(models[True]) == counts[True] - counts[False] == 2 * 4 * n_in * (n_in + n_out)
    assert throughput.dora_flops(models[False]) == 0


def test_dora_count_of_a_run(tmp_path_factory, tiny_home):
    """use_dora: each micro-batch's count adds the products of the run's DoRA layers; a plain LoRA run has none."""
    root = tmp_path_factory.mktemp("throughput-dora")
    make_dataset(root / "images", count=2)
    run = build_run(load_config(write_config(root, root / "images", max_train_steps=1, train_batch_size=2,
                                             use_dora=True, validation_step_interval=0, checkpoint_step_interval=0)))
    batch = next(iter(run.data))
    shape, text = tuple(batch.latents.shape), int(batch.text["prompt_embeds"].shape[1])
    dora = throughput.dora_flops(run.comps.transformer)
    assert dora > 0 and run.throughput.per_forward == dora
    f = run.family.forward_flops(run.comps.transformer.config, shape, text)
    plain = f.step(False, lora_forward(f, adapter_shapes(run.comps.transformer)))
    assert run.throughput.micro_batch(shape, text)[0] == pytest.approx(plain + dora, rel=1e-9)
    torchs = counted(lambda: micro_step(run, batch).backward())
    assert close(run.throughput.micro_batch(shape, text)[0], torchs, 0.05)


def test_step_events_carry_the_fields(tiny_run):
    """The loop logs what the lead's `run.throughput.add(batch)` in optimizer_step counted."""
    train(tiny_run)
    events = [json.loads(x) for x in (tiny_run.output_dir / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 2
    for e in steps:
        assert e["tflops"] > 0 and e["tokens_per_s"] > 0 and e["mfu"] == pytest.approx(e["tflops"] / 2.0, rel=1e-3)
        assert "peak_memory_gib" not in e  # CPU
    assert not any("MFU is not shown" in (e.get("message") or "") for e in events)  # gpu_peak_tflops is set


def test_cuda_fields_come_from_the_allocator_and_the_device_name(monkeypatch):
    """No GPU here: the two CUDA queries are the process's edge, answered as an H100 would."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    family = get_family("lumina2")
    transformer = family.load(str(tiny_model("lumina2", "tiny-random")), torch.float32).transformer
    said = []
    meter = throughput.build(NS(model_type="full", lora_type="standard", gpu_peak_tflops=None), family, transformer,
                             [], False, torch.device("cuda", 0), lambda kind, **data: said.append(kind))
    assert meter.peak == 989.4 and not said
    assert meter.step_fields(1.0) == {"peak_memory_gib": 3.0}  # nothing added: no FLOPs, memory all the same
    meter.flops, meter.tokens = 98.94e12, 1000  # one second of an H100 at 10%
    assert meter.step_fields(1.0) == {"tflops": 98.94, "tokens_per_s": 1000.0, "mfu": 0.1, "peak_memory_gib": 3.0}


def test_the_web_ui_shows_the_last_steps_throughput(tmp_path):
    from test_ui_api import fake_run

    step = {"event": "step", "step": 1, "loss": 1.0, "lr": 1e-3, "elapsed": 0.1}
    fast = {"tflops": 400.0, "tokens_per_s": 9000.0, "mfu": 0.404, "peak_memory_gib": 31.5}
    run = fake_run(tmp_path, [{"event": "start", "total_steps": 9, "step": 0}, step, {**step, "step": 2, **fast}],
                   pid=None)
    summary = run.summary()
    assert {k: summary[k] for k in fast} == fast
    cpu = fake_run(tmp_path / "cpu", [{"event": "start", "total_steps": 9, "step": 0}, step], pid=None).summary()
    assert all(cpu[k] is None for k in fast)  # an older log, or a step without them: shown as "–"
