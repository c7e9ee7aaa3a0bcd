"""torch.compile of the transformer (train/compile.py, keys in config/speed_keys.py) on the tiny models, on the CPU.

The fast tests use dynamo_backend 'eager' or 'aot_eager' (traced, no code generation), which compute exactly what the
uncompiled model computes: their losses and weights are compared for equality. Inductor generates other kernels
(fused, reordered sums): its test allows a relative difference of 1e-4 on the losses.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.utils import counters

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.demo import make_dataset
from difftune.models import get_family, tiny_model
from difftune.train import compile as compiling
from difftune.train import tread
from difftune.train.loop import train
from difftune.train.setup import build_run
from test_offload import forward_backward, lora_lumina2, streamed
from test_train import crash_then_resume, losses

# torch.compile counts recompilations per call (torch 2.13); older torch has only dynamo's global count
ISOLATED = "isolate_recompiles" in inspect.signature(torch.compile).parameters

STACKS = get_family("lumina2").facts.block_stacks
RESULT = "pytorch_lora_weights.safetensors"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts from empty compile caches and counters (they are process-wide); compile_transformer's
    process-wide setting is put back afterwards."""
    lazy = torch._functorch.config.force_non_lazy_backward_lowering
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    torch._functorch.config.force_non_lazy_backward_lowering = lazy


def events(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "events.jsonl").read_text().splitlines()]


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def keys(backend: str = "aot_eager", **overrides) -> NS:
    """The compile keys as compile_transformer reads them."""
    values = dict(dynamo_mode=None, dynamo_fullgraph=False, dynamo_dynamic=None, dynamo_use_regional_compilation=True,
                  dynamo_recompile_limit=16) | overrides
    return NS(compile_backend=lambda: backend, **values)


def compile_model(transformer, backend: str = "aot_eager", **overrides) -> list[tuple[str, dict]]:
    emitted: list[tuple[str, dict]] = []
    compiling.compile_transformer(keys(backend, **overrides), STACKS, transformer,
                                  lambda kind, **data: emitted.append((kind, data)))
    return emitted


def forward_backward_any(transformer):
    """`forward_backward` whose gradients include a LyCORIS network's (kept beside the transformer)."""
    network = getattr(transformer, "network", None)
    if network is None:
        return forward_backward(transformer)
    loss, _, sample = forward_backward(transformer)
    return loss, {n: p.grad.clone() for n, p in network[0].named_parameters() if p.requires_grad}, sample


def same_results(expected, got) -> None:
    """Loss, LoRA gradients and a no-grad output of `forward_backward`, bit for bit."""
    assert torch.equal(expected[0], got[0])
    assert expected[1].keys() == got[1].keys() and expected[1]
    assert all(torch.equal(expected[1][k], got[1][k]) for k in expected[1])
    assert torch.equal(expected[2], got[2])


# --- config -----------------------------------------------------------------------------------------------------


def test_keys_and_refused_combinations(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, compile=True)).train
    assert cfg.compile_backend() == "inductor" and cfg.dynamo_use_regional_compilation
    assert load_config(write_config(tmp_path / "b", dataset, dynamo_backend="AOT_EAGER")).train.compile_backend() == \
        "aot_eager"
    bad = {
        r"dynamo_mode 'max-autotune' is a mode of the inductor backend; dynamo_backend 'aot_eager' takes none":
            dict(dynamo_backend="aot_eager", dynamo_mode="max-autotune"),
        r"dynamo_use_regional_compilation false .* with enable_group_offload.*use regional compilation":
            dict(compile=True, dynamo_use_regional_compilation=False, enable_group_offload=True),
        r"dynamo_mode 'reduce-overhead' uses CUDA graphs.*musubi_blocks_to_swap moves the weights":
            dict(compile=True, dynamo_mode="reduce-overhead", musubi_blocks_to_swap=1),
        r"compile: true means dynamo_backend 'inductor'": dict(compile=True, dynamo_backend="eager"),
        r"dynamo_use_regional_compilation false .* with tread_config with gradient_checkpointing":
            dict(compile=True, dynamo_use_regional_compilation=False, gradient_checkpointing=True,
                 tread_config={"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -1}]}),
        r"dynamo_use_regional_compilation false .* with fsdp_enable":
            dict(compile=True, dynamo_use_regional_compilation=False, fsdp_enable=True),
    }
    for i, (message, overrides) in enumerate(bad.items()):
        with pytest.raises(ConfigError, match=message):
            load_config(write_config(tmp_path / f"bad{i}", dataset, **overrides))
    # the settings of a switched-off compile are accepted (SimpleTuner's configs carry them at their defaults)
    load_config(write_config(tmp_path / "off", dataset, dynamo_use_regional_compilation=False, dynamo_dynamic=False,
                             dynamo_recompile_limit=4))


# --- the compiled model -------------------------------------------------------------------------------------------


def test_recompile_limit_runs_new_shapes_uncompiled_with_one_warning():
    if not ISOLATED:  # the count below is per region; older torch shares dynamo's global one (the test further down)
        pytest.skip("this torch.compile has no isolate_recompiles (older torch)")
    transformer = lora_lumina2()
    plain = {}
    sizes = [(8, 8), (8, 16), (16, 8)]
    with torch.no_grad():
        for h, w in sizes:
            torch.manual_seed(0)
            x = dict(hidden_states=torch.randn(1, 4, h, w), timestep=torch.rand(1),
                     encoder_hidden_states=torch.randn(1, 5, 32), encoder_attention_mask=torch.ones(1, 5, dtype=torch.bool))
            plain[h, w] = (x, transformer(**x).sample)
        emitted = compile_model(transformer, "eager", dynamo_dynamic=False, dynamo_recompile_limit=1)
        for h, w in sizes:
            assert torch.equal(transformer(**plain[h, w][0]).sample, plain[h, w][1])
    # context_refiner sees the same caption every time: one graph; noise_refiner and layers: one each, then eager
    assert graphs() == 3
    warnings = [data for kind, data in emitted if kind == "warning"]
    # noise_refiner and layers share their block class's forward (so do the refiners): one warning names them
    assert len(warnings) == 1, warnings
    message = warnings[0]["message"]
    assert "Lumina2TransformerBlock.forward" in message and "(dynamo_recompile_limit 1)" in message
    assert "run uncompiled" in message


def test_compiler_failure_names_the_backend_and_the_way_out():
    transformer = lora_lumina2()
    # The whole Lumina2 transformer does not trace as one graph (its rotary embedding reads caption lengths as
    # Python ints), so dynamo_fullgraph refuses it at the first call: a real compiler failure.
    compile_model(transformer, "eager", dynamo_use_regional_compilation=False, dynamo_fullgraph=True)
    with pytest.raises(compiling.CompileError) as caught:
        forward_backward(transformer)
    message = str(caught.value)
    assert message.startswith("torch.compile failed (dynamo_backend 'eager', transformer region): ")
    assert "transformer_lumina2.py" in message  # the model line it could not trace
    assert "set dynamo_backend 'no' and compile false" in message and "set it false" in message  # fullgraph
    assert isinstance(caught.value.__cause__, torch._dynamo.exc.TorchDynamoException)


def test_a_missing_cxx_compiler_is_named():
    """inductor's C++ compiler is missing (a process edge): the first call says so and names the way out."""
    import torch._inductor.config

    transformer = lora_lumina2()
    compile_model(transformer, "inductor")
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/g++",)}), \
            pytest.raises(compiling.CompileError, match=r"dynamo_backend 'inductor', context_refiner region\): "
                                                        r"InvalidCxxCompiler: No working C\+\+ compiler.*"
                                                        r"set dynamo_backend 'no' and compile false; dynamo_backend "
                                                        r"'aot_eager' \(no code generation\) tells"):
        forward_backward(transformer)


# --- training ----------------------------------------------------------------------------------------------------


BASE = dict(max_train_steps=2, checkpoint_step_interval=1, resume_from_checkpoint="latest", gradient_checkpointing=True)


@pytest.fixture(scope="module")
def uncompiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("uncompiled")
    make_dataset(root / "images", count=4)
    run = build_run(load_config(write_config(root / "run", root / "images", **BASE)))
    train(run)
    return root / "images", run.output_dir


def assert_same_training(output_dir: Path, expected_dir: Path) -> None:
    assert losses(output_dir) == losses(expected_dir) and len(losses(output_dir)) == BASE["max_train_steps"]
    expected, got = load_file(expected_dir / RESULT), load_file(output_dir / RESULT)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_compiled_lora_training_equals_uncompiled(tmp_path, uncompiled):
    """Regional compilation with gradient checkpointing: the same losses and LoRA as the uncompiled run, bit for bit
    (the 'eager' backend runs the traced graphs as they are); the parameter names do not change."""
    images, expected = uncompiled
    run = build_run(load_config(write_config(tmp_path, images, **BASE, dynamo_backend="eager", dynamo_dynamic=True)))
    names = [n for n, _ in run.comps.transformer.named_parameters()]
    train(run)
    assert_same_training(run.output_dir, expected)
    assert [n for n, _ in run.comps.transformer.named_parameters()] == names  # no `_orig_mod.` anywhere
    info = [e for e in events(run.output_dir) if e.get("compiled_blocks")]
    assert len(info) == 1 and info[0]["regions"] == list(STACKS) and info[0]["backend"] == "eager"
    assert info[0]["compiled_blocks"] == sum(len(getattr(run.comps.transformer, s)) for s in STACKS)
    # one graph per block stack serves all of its blocks (layers has two), and checkpointing's recomputation too
    assert graphs() == len(STACKS)


def test_compiled_blocks_with_activation_offload_train_as_uncompiled(tmp_path, uncompiled):
    """gradient_checkpointing_backend 'unsloth' with regional compilation (AOTAutograd's graphs): the offload's hooks
    sit around the checkpointed call, outside the compiled block; the same losses and LoRA, bit for bit."""
    images, expected = uncompiled
    run = build_run(load_config(write_config(tmp_path, images, **BASE, dynamo_backend="aot_eager", dynamo_dynamic=True,
                                             gradient_checkpointing_backend="unsloth")))
    train(run)
    assert_same_training(run.output_dir, expected)
    assert any(e.get("message", "").startswith("activation offload:") for e in events(run.output_dir))


@pytest.mark.slow  # about 70 s on 2 shared cores
def test_compiled_run_resumes_exactly(tmp_path, monkeypatch, uncompiled):
    """aot_eager (AOTAutograd's forward and backward graphs, no code generation): a compiled run that dies after
    step 1 and resumes has the uncompiled run's losses and LoRA, bit for bit."""
    images, expected = uncompiled
    config = write_config(tmp_path, images, **BASE, dynamo_backend="aot_eager", dynamo_dynamic=True)
    crash_then_resume(monkeypatch, config, at_step=1)
    assert_same_training(tmp_path / "output", expected)
    info = [e for e in events(tmp_path / "output") if e.get("compiled_blocks")]
    assert len(info) == 2 and info[0]["backend"] == "aot_eager"  # one per launch
    names = set(load_file(tmp_path / "output" / "checkpoints" / "checkpoint-0000001" / RESULT))
    assert names == set(load_file(expected / "checkpoints" / "checkpoint-0000001" / RESULT))


@pytest.mark.slow  # about 30 s on 2 shared cores
def test_bf16_mixed_precision_and_validation_equal_uncompiled(tmp_path, dataset):
    """Autocast around the compiled blocks, and validation in the weights' dtype with the LoRA cast as loaded
    (another dtype: another graph): the same losses, LoRA and validation images, bit for bit (aot_eager)."""
    common = dict(max_train_steps=2, mixed_precision="bf16", gradient_checkpointing=True,
                  validation_prompt="a red circle", validation_resolution="32x32", validation_num_inference_steps=2)
    plain = build_run(load_config(write_config(tmp_path / "plain", dataset, **common)))
    a = load_file(train(plain))
    run = build_run(load_config(write_config(tmp_path / "compiled", dataset, **common, dynamo_backend="aot_eager")))
    b = load_file(train(run))
    assert losses(run.output_dir) == losses(plain.output_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    images = sorted((plain.output_dir / "validation").iterdir())
    assert images and all((run.output_dir / "validation" / p.name).read_bytes() == p.read_bytes() for p in images)


# --- shapes across buckets ----------------------------------------------------------------------------------------


def two_buckets(folder: Path) -> Path:
    """Square images and 2:1 ones: two aspect buckets (and captions of several lengths)."""
    make_dataset(folder, count=3)
    for path in make_dataset(folder / "wide", count=3, size=(96, 48), seed=1):
        for file in (path, path.with_suffix(".txt")):
            file.rename(folder / f"wide-{file.name}")
    (folder / "wide").rmdir()
    return folder


@pytest.mark.slow  # about 60 s on 2 shared cores
def test_two_buckets_compile_a_bounded_number_of_times(tmp_path):
    """Automatic dynamic shapes: a region compiles for its first shape, once more with the sizes that changed
    symbolic, and that graph serves the rest: two buckets, captions of several lengths and guided validation (whose
    batch is doubled) stay within 2 graphs per region and grad mode. Static shapes with a limit of 2: past it the
    region runs uncompiled, with one warning, and the losses do not change."""
    images = two_buckets(tmp_path / "images")
    common = dict(max_train_steps=5, validation_prompt="a red circle", validation_resolution="32x32",
                  validation_num_inference_steps=2, validation_step_interval=3, use_ema=True,
                  ema_validation="comparison", gradient_checkpointing=True)
    plain = build_run(load_config(write_config(tmp_path / "plain", images, **common)))
    train(plain)
    assert len({item.sample.group for item in plain.data.items}) == 2
    expected = losses(plain.output_dir)

    run = build_run(load_config(write_config(tmp_path / "auto", images, **common, dynamo_backend="eager")))
    train(run)
    assert losses(run.output_dir) == expected
    assert graphs() <= 2 * 2 * len(STACKS)  # (first shape + dynamic) x (training, sampling) per region
    assert not [e for e in events(run.output_dir) if e.get("recompile_limit_hit")]
    samples = sorted(p.name for p in (run.output_dir / "validation").iterdir())
    assert samples == sorted(p.name for p in (plain.output_dir / "validation").iterdir()) and any("-ema" in s for s in
                                                                                                samples)

    torch._dynamo.reset()
    static = build_run(load_config(write_config(tmp_path / "static", images, **common, dynamo_backend="eager",
                                                dynamo_dynamic=False, dynamo_recompile_limit=2)))
    train(static)
    assert losses(static.output_dir) == expected
    hits = [e for e in events(static.output_dir) if e.get("recompile_limit_hit")]
    assert hits and len(hits) == len({e["recompile_limit_hit"] for e in hits})  # one warning per compiled function
    assert "(dynamo_recompile_limit 2)" in hits[0]["message"]


# --- what runs around and inside the compiled blocks ---------------------------------------------------------------


def lycoris_lumina2():
    """Tiny Lumina2 with a LoKr network (not a submodule: its parameters are found through `network`)."""
    from difftune.adapters.lycoris import attach_lycoris

    transformer = get_family("lumina2").load(str(tiny_model("lumina2", "tiny-random")), torch.float32).transformer
    torch.manual_seed(0)
    network, params = attach_lycoris(transformer, {"algo": "lokr", "linear_dim": 4, "linear_alpha": 1, "factor": 4})
    with torch.no_grad():  # LoKr starts as the identity (w2 zero): make every gradient non-trivial
        for p in params:
            p.normal_(std=0.1)
    transformer.network = [network]  # kept out of the module tree, as difftune keeps it
    return transformer


def with_tread(checkpointing: bool):
    transformer = lora_lumina2(checkpointing=checkpointing).train()
    routes = NS(routes=[NS(selection_ratio=0.5, start_layer_idx=1, end_layer_idx=-1)])
    tread.attach(routes, get_family("lumina2"), transformer, torch.Generator().manual_seed(0), False)
    return transformer


def streaming(checkpointing: bool):
    transformer = lora_lumina2(checkpointing=checkpointing)
    streamed(transformer, 1, True)
    return transformer


SETUPS = {
    "streaming+checkpointing": (lambda: streaming(True), {}),
    "streaming": (lambda: streaming(False), {}),
    "tread+checkpointing": (lambda: with_tread(True), {}),
    # whole model: without checkpointing (refused with it: speed_keys.compile_checks)
    "tread, whole model": (lambda: with_tread(False), dict(dynamo_use_regional_compilation=False)),
    "lycoris": (lycoris_lumina2, {}),
    "int8-quanto": (lambda: lora_lumina2("int8-quanto"), {}),
    "int8-torchao": (lambda: lora_lumina2("int8-torchao"), {}),
    "nf4-bnb": (lambda: lora_lumina2("nf4-bnb"), {}),
}


@pytest.mark.slow  # 20-30 s each; the default suite keeps test_compiled_lora_training_equals_uncompiled
@pytest.mark.parametrize("setup", list(SETUPS))
def test_compiled_blocks_give_the_same_loss_gradients_and_samples(setup):
    """Hooks (block streaming, TREAD), adapters and quantized weights with compiled blocks (aot_eager: forward and
    backward graphs): loss, adapter gradients and a no-grad output equal the uncompiled model's, bit for bit."""
    build, overrides = SETUPS[setup]
    expected = forward_backward_any(build())
    transformer = build()
    compile_model(transformer, "aot_eager", **overrides)
    same_results(expected, forward_backward_any(transformer))
    assert graphs() > 0
    if not overrides:  # regional: each block is one whole graph (the whole Lumina2 transformer has graph breaks)
        assert not counters["graph_break"]


@pytest.mark.slow  # about 60 s on 2 shared cores
def test_crepa_with_compiled_blocks_equals_uncompiled(tmp_path, dataset):
    """CREPA's hook on block crepa_block_index captures the compiled block's output: the same losses (flow loss plus
    alignment term), LoRA and projector as without compiling."""
    from transformers import Dinov2Config, Dinov2Model

    from test_crepa import on

    torch.manual_seed(0)  # a tiny random DINOv2, as test_crepa's
    Dinov2Model(Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                             patch_size=14, image_size=28)).save_pretrained(tmp_path / "dino")
    common = dict(max_train_steps=2, train_batch_size=2, gradient_checkpointing=True, **on(str(tmp_path / "dino")))
    plain = train(build_run(load_config(write_config(tmp_path / "plain", dataset, **common))))
    compiled = train(build_run(load_config(write_config(tmp_path / "compiled", dataset, **common,
                                                        dynamo_backend="aot_eager"))))
    assert losses(tmp_path / "compiled" / "output") == losses(tmp_path / "plain" / "output")
    a, b = load_file(plain), load_file(compiled)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # about 40 s on 2 shared cores
def test_layersync_with_compiled_blocks_equals_uncompiled(tmp_path, dataset):
    """LayerSync's hooks on two compiled blocks (one output kept with its graph, one detached): the same losses, term
    included, and LoRA as without compiling (to rounding: the compiled block's output reaches the cosine's backward
    in another layout, a last-bit difference of 6e-8 after two steps)."""
    from test_layersync import ON

    common = dict(max_train_steps=2, train_batch_size=2, gradient_checkpointing=True, **ON)
    plain = train(build_run(load_config(write_config(tmp_path / "plain", dataset, **common))))
    compiled = train(build_run(load_config(write_config(tmp_path / "compiled", dataset, **common,
                                                        dynamo_backend="aot_eager"))))
    assert losses(tmp_path / "compiled" / "output") == losses(tmp_path / "plain" / "output")
    a, b = load_file(plain), load_file(compiled)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


@pytest.mark.slow  # about 90 s on 2 shared cores
def test_fsdp_with_compiled_blocks_equals_one_uncompiled_process(tmp_path):
    """FSDP2's all-gathers run as hooks around each compiled block: two compiled processes train as one uncompiled
    process with the global batch (FSDP's reduce-scatter sums in another order: relative 1e-5, as test_fsdp)."""
    from test_distributed import finish, launch
    from test_fsdp import same_run

    images = tmp_path / "images"
    make_dataset(images, count=8)
    settings = dict(max_train_steps=2, gradient_checkpointing=True)
    two = write_config(tmp_path / "two", images, train_batch_size=1, fsdp_enable=True, dynamo_backend="aot_eager",
                       **settings)
    one = write_config(tmp_path / "one", images, train_batch_size=2, **settings)
    finish(launch(two, 29651))
    finish(launch(one, 0, processes=1))
    same_run(tmp_path / "one" / "output", tmp_path / "two" / "output")
    assert any(e.get("compiled_blocks") for e in events(tmp_path / "two" / "output"))


# --- inductor -----------------------------------------------------------------------------------------------------


def step_times(output_dir: Path) -> list[float]:
    elapsed = [e["elapsed"] for e in events(output_dir) if e["event"] == "step"]
    return [b - a for a, b in zip([0.0, *elapsed], elapsed, strict=False)]


@pytest.mark.slow  # several minutes on 2 cores the first time (C++ compilation); inductor's cache makes reruns quicker
@pytest.mark.parametrize("family", ["lumina2", "kandinsky5-image"])
def test_inductor_trains_like_uncompiled(tmp_path, dataset, family):
    """The real backend: C++ kernels generated by inductor (gcc). Fused and reordered sums round differently, so
    the losses are compared with a relative tolerance of 1e-4. The LoRA weights: Adam divides each gradient by its
    own running size, so an element whose gradient is near zero (lora_A while lora_B is still small) can move by up
    to the learning rate per step on rounding alone. Measured on Kandinsky 5 after 4 steps: mean difference 1.7e-6,
    8 elements of 9216 above 1e-4, at most 1.1e-3; Lumina2: at most 5e-7. Asserted: mean below 1e-5, fewer than
    0.5% of the elements above 1e-4, none above 2 x lr x steps."""
    common = dict(model_family=family, max_train_steps=4, gradient_checkpointing=True)
    started = time.perf_counter()
    plain = train(build_run(load_config(write_config(tmp_path / "plain", dataset, **common))))
    plain_s = time.perf_counter() - started
    started = time.perf_counter()
    compiled = train(build_run(load_config(write_config(tmp_path / "inductor", dataset, **common, compile=True,
                                                          dynamo_dynamic=True))))
    compiled_s = time.perf_counter() - started
    expected, got = losses(tmp_path / "plain" / "output"), losses(tmp_path / "inductor" / "output")
    assert got.keys() == expected.keys() and all(got[k] == pytest.approx(expected[k], rel=1e-4) for k in got)
    a, b = load_file(plain), load_file(compiled)
    assert a.keys() == b.keys()
    diff = torch.cat([(b[k] - a[k]).abs().flatten() for k in a])
    assert diff.mean() < 1e-5 and (diff > 1e-4).float().mean() < 5e-3 and diff.max() <= 2 * 1e-3 * 4, diff.max()
    info = [e for e in events(tmp_path / "inductor" / "output") if e.get("compiled_blocks")]
    assert info and info[0]["backend"] == "inductor"
    print(f"\n{family}: uncompiled {plain_s:.1f} s, steps {[round(t, 3) for t in step_times(tmp_path / 'plain' / 'output')]}"
          f"; inductor {compiled_s:.1f} s, steps {[round(t, 3) for t in step_times(tmp_path / 'inductor' / 'output')]}")


def test_torch_without_isolated_limits_gets_the_global_limit_raised_for_shared_block_classes(monkeypatch):
    """torch 2.11 (the GPU images' torch) has no isolate_recompiles: compile still works there, on dynamo's global
    limit per code object, raised so that each of Lumina2's three stacks (one block class) gets its own share."""
    real = torch.compile

    def old_compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                    disable=False):
        return real(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options,
                    disable=disable)

    monkeypatch.setattr(torch, "compile", old_compile)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    transformer = lora_lumina2()
    regions = compiling.regions(get_family("lumina2").facts.block_stacks, transformer, True)
    assert len(regions) == 3 and compiling.recompile_limit(16, regions) == {}
    assert torch._dynamo.config.recompile_limit == 48
    assert compiling.recompile_limit(2, regions) == {} and torch._dynamo.config.recompile_limit == 48  # never lowered
    expected = forward_backward(lora_lumina2())
    compile_model(transformer, "eager")
    assert torch.equal(forward_backward(transformer)[0], expected[0])
    monkeypatch.undo()
    if ISOLATED:
        assert compiling.recompile_limit(4, regions) == dict(recompile_limit=4, isolate_recompiles=True)
