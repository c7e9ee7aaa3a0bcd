"""`make bench-gpu` (`python -m difftune.bench_gpu`): LoRA training steps of the real-size transformers on a GPU,
one table: median step time, time to the first step, peak memory, TFLOP/s and MFU, for each attention backend
and with and without torch.compile and gradient checkpointing (issue 17).

The transformers are built on the GPU from the real architecture configs (`bench_memory.py`: Lumina2 2.0,
Kandinsky 5 Image Lite, Video Lite and Pro) with random bf16 weights: nothing is downloaded, and step time and
memory do not depend on the weights' values. The step is the training step's own pieces: the family's
`predict`, the flow-matching loss, backward, AdamW on peft LoRA r16 (fp32 adapter weights, bf16 autocast),
with difftune's attention (train/attention.py), compile (train/compile.py), checkpointing
(train/checkpointing.py) and FLOP count (train/throughput.py, models/flops.py), so the figures are the
trainer's. Captions are 128 tokens. The data path (cache reads, prefetch) is not part of it.

Besides the attention/compile/checkpointing matrix, `--matrix levers` measures the memory and speed levers of
issues 13-15 on the same step: a quantized frozen base (`--precisions`), TREAD (`--tread-ratio` over the specs'
route), block streaming with checkpointing (train/offload.py); `stream` and `tread` are their short forms for
one large case. `--profile` prints where one step's GPU time goes and how busy the GPU was.

`--tiny` runs the tiny test models on the CPU in fp32: a check that the script works anywhere (the tests run
it); its figures mean nothing. Figures are printed (and written as JSON lines with `--out`), never stored:
BENCHMARKS.md holds only numbers measured on a named machine.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from difftune import bench_memory as real
from difftune.bench import machine_info
from difftune.memory_plan.architecture import TRANSFORMER_CLASS


@dataclass(frozen=True)
class Setup:
    """One configuration of a case: the attention backend and the levers."""

    attention: str
    compiled: bool = False
    checkpointing: bool = False
    precision: str = "bf16"  # the frozen base: bf16, or a base_model_precision quantized on the GPU
    tread: float = 0.0  # TREAD selection ratio over the specs' route (start_layer_idx 2, end_layer_idx -2)
    stream: bool = False  # block streaming: every block's frozen weights in pinned CPU memory, prefetched
    activations: bool = False  # activation offload (with checkpointing): the blocks' inputs in pinned CPU memory
    full: str = ""  # a full fine-tune (adamw_bf16) instead of LoRA: "" no, "gpu", "offload" (optimizer on the CPU),
    # "offload+grads" (optimizer_offload_gradients too)

    def levers(self) -> str:
        out = [f"full fine-tune, optimizer {self.full}"] if self.full else []
        out += [self.precision] if self.precision != "bf16" else []
        out += [f"TREAD {self.tread}"] if self.tread else []
        out += ["streamed"] if self.stream else []
        out += ["activations offloaded"] if self.activations else []
        return ", ".join(out) or "-"


@dataclass(frozen=True)
class Case:
    family: str
    config: dict[str, Any]
    latent: tuple[int, ...]  # one sample's latent shape [C, h, w] or [C, T, h, w]
    batch: int
    note: str


# Anchors of the original trainer on an H100 (issue 17): Lumina2 512² bs2 0.235 s (16 GiB), 0.384 s with
# checkpointing (6.6 GiB); K5 Video Lite 768x512x81f bs2 1.97 s; K5 Image 1024² bs3 LoKr 6.59 s.
CASES = {
    "lumina2-512-bs2": Case("lumina2", real.LUMINA2, (16, 64, 64), 2, "Lumina2 2.0, 512x512, batch 2"),
    "lumina2-1024-bs1": Case("lumina2", real.LUMINA2, (16, 128, 128), 1, "Lumina2 2.0, 1024x1024, batch 1"),
    "k5-image-1024-bs1": Case("kandinsky5-image", real.K5_IMAGE_LITE, (16, 128, 128), 1,
                              "K5 Image Lite, 1024x1024, batch 1"),
    # 81 frames -> 21 latent frames (4x in time), 768x512 -> 96x64 latents
    "k5-video-lite-81f-bs2": Case("kandinsky5-video", real.K5_VIDEO_LITE, (16, 21, 64, 96), 2,
                                  "K5 Video Lite, 768x512x81f, batch 2"),
    "k5-video-pro-81f-bs1": Case("kandinsky5-video", real.K5_VIDEO_PRO, (16, 21, 64, 96), 1,
                                 "K5 Video Pro, 768x512x81f, batch 1"),
}
DEFAULT_CASES = ("lumina2-512-bs2", "lumina2-1024-bs1", "k5-image-1024-bs1", "k5-video-lite-81f-bs2")
TEXT_TOKENS = 128


def tiny_case(case: Case) -> Case:
    """The same family at the tiny test model's size (its folder's config)."""
    from difftune.models import tiny_model
    from difftune.models.registry import TINY_FLAVOUR

    folder = tiny_model(case.family, TINY_FLAVOUR)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    channels = config.get("in_channels") or config.get("in_visual_dim")
    latent = (channels, 8, 8) if len(case.latent) == 3 else (channels, 3, 8, 8)
    return Case(case.family, config, latent, case.batch, case.note + " (tiny)")


def text_item(family: str, config: dict[str, Any], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One caption's cached text embedding, as the family's text cache holds it."""
    if family == "lumina2":
        return {"prompt_embeds": torch.randn(TEXT_TOKENS, config["cap_feat_dim"], generator=generator)}
    return {"prompt_embeds": torch.randn(TEXT_TOKENS, config["in_text_dim"], generator=generator),
            "pooled": torch.randn(config["in_text_dim2"], generator=generator)}


def build(case: Case, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The transformer with random weights, made directly on `device` in `dtype` (no fp32 copy anywhere)."""
    import diffusers

    cls = getattr(diffusers, TRANSFORMER_CLASS[case.family])
    config = dict(case.config)
    if case.family != "lumina2":
        config.setdefault("attention_type", "regular")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).requires_grad_(False)


def quantize(model: torch.nn.Module, precision: str) -> None:
    """The frozen base in `precision`, quantized where it is (the GPU), as base_model_precision does (with
    `quantize_transformer`'s lean_saves: the quantized layers keep only their quantized weight for backward).
    'int4-torchao' is not a trainer precision (config/pending.py): kept here to show why (on an H100, torch 2.11:
    "derivative for aten::_weight_int4pack_mm is not implemented", so no adapter trains over it)."""
    from difftune.models.quantize import QUANTIZERS, quantized_layers
    from difftune.models.quantized_saves import lean_saves

    if precision == "bf16":
        return
    if precision == "int4-torchao":
        import torchao.quantization as ao

        config = ao.Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
        wanted = set(quantized_layers(model))
        ao.quantize_(model, config, filter_fn=lambda m, fqn: fqn in wanted)
        return
    QUANTIZERS[precision](model, quantized_layers(model))
    lean_saves(model)


def run_config(case: Case, setup: Setup, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from types import SimpleNamespace as NS

    from peft import LoraConfig

    from difftune.adapters.casts import skip_casts_under_autocast
    from difftune.config.schema import TrainConfig
    from difftune.models import get_family
    from difftune.train import attention, throughput, tread
    from difftune.train.activation_offload import offload_activations
    from difftune.train.checkpointing import enable_checkpointing
    from difftune.train.compile import compile_transformer
    from difftune.train.offload import BlockStreamer, streamed_blocks

    mechanism, compiled, checkpointing = setup.attention, setup.compiled, setup.checkpointing

    family = get_family(case.family)
    half = device.type == "cuda"
    messages: list[str] = []
    emit = lambda kind, message="", **_: messages.append(message)  # noqa: E731
    cfg = TrainConfig(model_family=case.family, pretrained_model_name_or_path="bench", output_dir="bench",
                      max_train_steps=1, mixed_precision="bf16" if half else "no", attention_mechanism=mechanism,
                      dynamo_backend=args.compile_backend if compiled else "no",
                      dynamo_mode=getattr(args, "compile_mode", None) if compiled else None,
                      gradient_checkpointing=checkpointing)
    model = build(case, device, torch.bfloat16 if half else torch.float32)
    quantize(model, setup.precision)
    if setup.full:  # every weight trains, in its dtype (bf16 on the GPU), as model_type 'full' does
        model.requires_grad_(True)
    else:
        model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights=True,
                                     target_modules=family.lora_target_modules
                                     if isinstance(family.lora_target_modules, str)
                                     else list(family.lora_target_modules)))
    params = [p for p in model.parameters() if p.requires_grad]
    if not setup.full:
        for p in params:
            p.data = p.data.float()
        skip_casts_under_autocast(model)  # as the trainer's LoRA (adapters/casts.py)
    streamer = None
    if setup.stream:  # after the adapter, as the trainer does: the LoRA weights stay resident
        blocks = streamed_blocks(model, family.facts.block_stacks, None)
        streamer = BlockStreamer(model, blocks, 1, device, prefetch=True)
        model.to(device)
    if checkpointing:
        enable_checkpointing(model, None)
    if setup.activations:  # gradient_checkpointing_backend 'unsloth' (checkpointing again, through the offload)
        offload_activations(NS(gradient_checkpointing_backend="unsloth", gradient_checkpointing_interval=None),
                            model, device, emit)
    chosen = attention.apply(cfg, model, device, emit)
    compile_transformer(cfg, family.facts.block_stacks, model, emit)
    meter = throughput.build(cfg, family, model, [], False, device, emit)
    model.train()
    optimizer = full_optimizer(setup.full, params, device) if setup.full else torch.optim.AdamW(params, lr=1e-5)
    g = torch.Generator(device=device).manual_seed(0)
    if setup.tread:  # the specs' route; a tiny test model (under 5 blocks) routes all but its first block
        small = tread.block_count(family, model) < 5
        route = NS(routes=[NS(selection_ratio=setup.tread, start_layer_idx=1 if small else 2,
                              end_layer_idx=-1 if small else -2)])
        tread.attach(route, family, model, torch.Generator(device=device).manual_seed(1), False)
    cpu = torch.Generator().manual_seed(0)
    text = family.collate_text([text_item(case.family, case.config, cpu) for _ in range(case.batch)])
    text = {k: v.to(device) for k, v in text.items()}
    x0 = torch.randn((case.batch, *case.latent), generator=g, device=device)
    step_flops, tokens = meter.micro_batch(tuple(x0.shape), TEXT_TOKENS)

    def step() -> None:
        noise = torch.randn(x0.shape, generator=g, device=device)
        sigmas = torch.rand(case.batch, generator=g, device=device)
        s = sigmas.view(-1, *([1] * (x0.dim() - 1)))
        x_t = ((1 - s) * x0 + s * noise).to(model.dtype)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
            pred = family.predict(model, x_t, sigmas, text, None)
        loss = (pred.float() - (noise - x0)).pow(2).mean()
        loss.backward()
        if setup.full.endswith("grads"):  # the loop's clipping, where the gradients now are
            optimizer.clip(1.0, "norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed() -> float:
        if half:
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        step()
        if half:
            torch.cuda.synchronize(device)
        return time.perf_counter() - began

    first = timed()  # includes compilation and kernel selection
    for _ in range(args.warmup):
        timed()
    if half:
        torch.cuda.reset_peak_memory_stats(device)
    times = [timed() for _ in range(args.steps)]
    median = statistics.median(times)
    if getattr(args, "profile", False):
        profile(step, device)
    peak = meter.peak
    row = {"case": case.note, "attention": LABEL.get(chosen.choice.train, chosen.choice.train), "compile": (getattr(args, "compile_mode", None) or True) if compiled else False,
           "checkpointing": checkpointing, "levers": setup.levers(), "step_s": round(median, 4), "first_step_s": round(first, 2),
           "tflop_per_step": round(step_flops / 1e12, 3), "tflops": round(step_flops / median / 1e12, 1),
           "tokens_per_s": round(tokens / median), "mfu": round(step_flops / median / 1e12 / peak, 3) if peak else None,
           "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if half else None}
    if streamer is not None:
        row["streamed_gib"] = round(streamer.streamed_bytes() / 2**30, 2)
    return row  # the model and optimizer go with this frame; main() then empties the caches


def full_optimizer(kind: str, params: list, device: torch.device) -> Any:
    """A full fine-tune's optimizer (adamw_bf16, the spec's advice), on the device or stepping in CPU memory
    (train/optimizer_offload.py), as optimizer_cpu_offload_method / optimizer_offload_gradients build it."""
    from difftune.train.optimizer_offload import HostStepOptimizer
    from difftune.train.optimizers import build_optimizer

    def build(trained: list) -> Any:
        return build_optimizer("adamw_bf16", trained, 1e-5, (0.9, 0.999), 0.01, 1e-8)

    if kind == "gpu":
        return build(params)
    return HostStepOptimizer(params, build, device, offload_gradients=kind.endswith("grads"))


def profile(step: Any, device: torch.device) -> None:
    """One step under torch.profiler: where the GPU time goes, and whether the host keeps the GPU fed."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profiler(activities=activities) as prof:
        began = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - began
    events = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    gpu = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
    print(f"profile: step {wall:.3f} s wall, {gpu:.3f} s of GPU kernels ({100 * gpu / wall:.0f}% busy), "
          f"{len(prof.events())} events")
    print(events.table(sort_by=sort, row_limit=25, max_name_column_width=60))


LABEL = {"native": "sdpa", "flash": "flash-attn 2", "_flash_3": "flash-attn 3", "flex": "flex",
         "_native_cudnn": "cudnn", "_native_flash": "sdpa flash", "_native_efficient": "sdpa efficient",
         "_native_math": "sdpa math"}


def configurations(args: argparse.Namespace) -> list[Setup]:
    """The setups to measure per case."""
    best = args.backends[0]
    if args.matrix == "full":
        return [Setup(*c) for c in itertools.product(args.backends, (False, True), (False, True))]
    if args.matrix == "levers":  # issues 13-15: each lever alone on the first backend, then streaming's set
        ckpt = args.checkpointing  # a model whose activations do not fit without it: every row checkpoints
        out = [Setup(best, checkpointing=ckpt)] + [Setup(best, checkpointing=ckpt, precision=p) for p in args.precisions]
        out += [Setup(best, checkpointing=ckpt, tread=args.tread_ratio)] + ([] if ckpt else [Setup(best, False, True)])
        out += [Setup(best, checkpointing=True, activations=True), Setup(best, checkpointing=True, stream=True),
                Setup(best, checkpointing=True, stream=True, precision=args.precisions[0])]
        return out
    compiled = getattr(args, "compiled", False)
    if args.matrix == "stream":  # a model that barely fits: checkpointed, resident, streamed, streamed with the
        # activations offloaded too, streamed + TREAD
        return [Setup(best, compiled, True), Setup(best, compiled, True, stream=True),
                Setup(best, compiled, True, stream=True, activations=True),
                Setup(best, compiled, True, stream=True, tread=args.tread_ratio)][getattr(args, "skip", 0):]
    if args.matrix == "fullft":  # a full fine-tune, checkpointed: optimizer on the GPU, on the CPU, + its gradients
        return [Setup(best, False, True, full=kind) for kind in ("gpu", "offload", "offload+grads")]
    if args.matrix == "tread":
        return [Setup(best, compiled, args.checkpointing), Setup(best, compiled, args.checkpointing,
                                                                 tread=args.tread_ratio)]
    out = [Setup(b) for b in args.backends]  # each backend, plain
    out += [Setup(best, True, False), Setup(best, False, True), Setup(best, True, True)]
    return out


def cleanup() -> None:
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(rows: list[dict[str, Any]]) -> str:
    head = ("case", "attention", "compile", "ckpt", "levers", "step s", "first s", "TFLOP/step", "TFLOP/s", "MFU",
            "tokens/s", "peak GiB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            cells = [r["case"], r["attention"], str(r["compile"]), str(r["checkpointing"]), r.get("levers", "-"),
                     r["error"]] + [""] * 6
        else:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
            compiled = (r["compile"] if isinstance(r["compile"], str) else "yes") if r["compile"] else "no"
            cells = [r["case"], r["attention"], compiled, "yes" if r["checkpointing"] else "no", r.get("levers", "-"),
                     f"{r['step_s']:.3f}", f"{r['first_step_s']:.1f}", f"{r['tflop_per_step']:.2f}",
                     f"{r['tflops']:.0f}", mfu, str(r["tokens_per_s"]),
                     "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m difftune.bench_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(DEFAULT_CASES))
    parser.add_argument("--backends", nargs="+", default=None,
                        help="attention_mechanism values; default: 'auto' and 'native' (when auto picks another)")
    parser.add_argument("--matrix", choices=("quick", "full", "levers", "stream", "tread", "fullft"), default="quick",
                        help="quick: each backend plain, then the first with compile and/or checkpointing; "
                             "full: every combination; levers: the first backend plain, with each of --precisions, "
                             "with TREAD, with checkpointing, streamed (+ the first precision); stream: checkpointed, resident, "
                             "streamed, streamed with activation offload, streamed with TREAD; tread: without and with TREAD; "
                             "fullft: a full fine-tune (adamw_bf16, checkpointed) with the optimizer on the GPU, on the CPU "
                             "(optimizer_cpu_offload_method), and with its gradients too")
    parser.add_argument("--precisions", nargs="+", default=["int8-quanto", "int8-torchao", "fp8-torchao"],
                        help="base precisions of the levers matrix (int4-torchao: an experiment, see quantize())")
    parser.add_argument("--checkpointing", action="store_true", help="levers, tread: every row checkpoints")
    parser.add_argument("--compiled", action="store_true", help="stream, tread: every row compiled")
    parser.add_argument("--skip", type=int, default=0, help="stream: leave out its first rows")
    parser.add_argument("--profile", action="store_true",
                        help="after each configuration's timed steps, profile one more step and print the 25 "
                             "costliest operators by GPU time, and the step's CPU and GPU time")
    parser.add_argument("--tread-ratio", type=float, default=0.5, help="TREAD selection ratio (levers, stream, tread)")
    parser.add_argument("--steps", type=int, default=8, help="measured steps (median)")
    parser.add_argument("--warmup", type=int, default=3, help="steps after the first, not measured")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting new configurations after this")
    parser.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"), default="inductor",
                        help="dynamo_backend of the compiled configurations")
    parser.add_argument("--compile-mode", choices=("default", "reduce-overhead", "max-autotune",
                                                   "max-autotune-no-cudagraphs"),
                        help="dynamo_mode of the compiled rows (inductor): 'reduce-overhead' replays CUDA graphs")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (checks the script)")
    parser.add_argument("--out", type=Path, help="also write each row as a JSON line here")
    args = parser.parse_args(argv)
    read_by = {"checkpointing": ("levers", "tread"), "compiled": ("stream", "tread"), "skip": ("stream",)}
    for flag, matrices in read_by.items():  # a flag the chosen matrix does not read is an error, not ignored
        if getattr(args, flag) and args.matrix not in matrices:
            parser.error(f"--{flag} applies to --matrix {' or '.join(matrices)}, not {args.matrix}")
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        parser.error("no CUDA device: run on a GPU machine, or add --tiny to check the script on the CPU")
    if args.backends is None:
        from difftune.train.attention import Device, auto, installed

        picked = auto(Device.of(device), installed(), half=device.type == "cuda")
        args.backends = ["auto"] + (["native"] if picked != "native" else [])
    print(json.dumps(machine_info()))
    started, rows = time.perf_counter(), []
    cases = [tiny_case(CASES[name]) if args.tiny else CASES[name] for name in args.cases]
    # every case's uncompiled setups first: a compile costs minutes, and the budget may end before them all
    runs = sorted(((case, setup) for case in cases for setup in configurations(args)), key=lambda r: r[1].compiled)
    for case, setup in runs:
        if time.perf_counter() - started > args.budget_s:
            print(f"skipped (budget): {case.note} {setup}")
            continue
        failed = {"case": case.note, "attention": setup.attention, "compile": setup.compiled,
                  "checkpointing": setup.checkpointing, "levers": setup.levers()}
        try:
            row = run_config(case, setup, args, device)
        except torch.OutOfMemoryError:
            row = failed | {"error": "out of memory"}
        except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others' figures
            traceback.print_exc()
            row = failed | {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        cleanup()
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
