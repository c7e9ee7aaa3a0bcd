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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from difftune import bench_memory as real
from difftune.bench import machine_info
from difftune.memory_plan.architecture import TRANSFORMER_CLASS


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


def run_config(case: Case, mechanism: str, compiled: bool, checkpointing: bool, args: argparse.Namespace,
               device: torch.device) -> dict[str, Any]:
    from peft import LoraConfig

    from difftune.config.schema import TrainConfig
    from difftune.models import get_family
    from difftune.train import attention, throughput
    from difftune.train.checkpointing import enable_checkpointing
    from difftune.train.compile import compile_transformer

    family = get_family(case.family)
    half = device.type == "cuda"
    messages: list[str] = []
    emit = lambda kind, message="", **_: messages.append(message)  # noqa: E731
    cfg = TrainConfig(model_family=case.family, pretrained_model_name_or_path="bench", output_dir="bench",
                      max_train_steps=1, mixed_precision="bf16" if half else "no", attention_mechanism=mechanism,
                      dynamo_backend=args.compile_backend if compiled else "no",
                      gradient_checkpointing=checkpointing)
    model = build(case, device, torch.bfloat16 if half else torch.float32)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights=True,
                                 target_modules=family.lora_target_modules if isinstance(family.lora_target_modules,
                                                                                         str)
                                 else list(family.lora_target_modules)))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    if checkpointing:
        enable_checkpointing(model, None)
    chosen = attention.apply(cfg, model, device, emit)
    compile_transformer(cfg, family.facts.block_stacks, model, emit)
    meter = throughput.build(cfg, family, model, [], False, device, emit)
    model.train()
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    g = torch.Generator(device=device).manual_seed(0)
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
    peak = meter.peak
    row = {"case": case.note, "attention": LABEL.get(chosen.choice.train, chosen.choice.train), "compile": compiled,
           "checkpointing": checkpointing, "step_s": round(median, 4), "first_step_s": round(first, 2),
           "tflop_per_step": round(step_flops / 1e12, 3), "tflops": round(step_flops / median / 1e12, 1),
           "tokens_per_s": round(tokens / median), "mfu": round(step_flops / median / 1e12 / peak, 3) if peak else None,
           "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if half else None}
    return row  # the model and optimizer go with this frame; main() then empties the caches


LABEL = {"native": "sdpa", "flash": "flash-attn 2", "_flash_3": "flash-attn 3", "flex": "flex",
         "_native_cudnn": "cudnn", "_native_flash": "sdpa flash", "_native_efficient": "sdpa efficient",
         "_native_math": "sdpa math"}


def configurations(args: argparse.Namespace) -> list[tuple[str, bool, bool]]:
    """(attention_mechanism, compile, checkpointing) to measure per case."""
    if args.matrix == "full":
        return list(itertools.product(args.backends, (False, True), (False, True)))
    out = [(b, False, False) for b in args.backends]  # each backend, plain
    best = args.backends[0]
    out += [(best, True, False), (best, False, True), (best, True, True)]
    return out


def cleanup() -> None:
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(rows: list[dict[str, Any]]) -> str:
    head = ("case", "attention", "compile", "ckpt", "step s", "first s", "TFLOP/step", "TFLOP/s", "MFU",
            "tokens/s", "peak GiB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            cells = [r["case"], r["attention"], str(r["compile"]), str(r["checkpointing"]), r["error"]] + [""] * 6
        else:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
            cells = [r["case"], r["attention"], "yes" if r["compile"] else "no", "yes" if r["checkpointing"] else "no",
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
    parser.add_argument("--matrix", choices=("quick", "full"), default="quick",
                        help="quick: each backend plain, then the first with compile and/or checkpointing; "
                             "full: every combination")
    parser.add_argument("--steps", type=int, default=8, help="measured steps (median)")
    parser.add_argument("--warmup", type=int, default=3, help="steps after the first, not measured")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting new configurations after this")
    parser.add_argument("--compile-backend", choices=("inductor", "aot_eager", "eager"), default="inductor",
                        help="dynamo_backend of the compiled configurations")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (checks the script)")
    parser.add_argument("--out", type=Path, help="also write each row as a JSON line here")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        parser.error("no CUDA device: run on a GPU machine, or add --tiny to check the script on the CPU")
    if args.backends is None:
        from difftune.train.attention import Device, auto, installed

        picked = auto(Device.of(device), installed(), half=device.type == "cuda")
        args.backends = ["auto"] + (["native"] if picked != "native" else [])
    print(json.dumps(machine_info()))
    started, rows = time.perf_counter(), []
    for name in args.cases:
        case = tiny_case(CASES[name]) if args.tiny else CASES[name]
        for mechanism, compiled, checkpointing in configurations(args):
            if time.perf_counter() - started > args.budget_s:
                print(f"skipped (budget): {case.note} {mechanism} compile={compiled} ckpt={checkpointing}")
                continue
            try:
                row = run_config(case, mechanism, compiled, checkpointing, args, device)
            except torch.OutOfMemoryError:
                row = {"case": case.note, "attention": mechanism, "compile": compiled,
                       "checkpointing": checkpointing, "error": "out of memory"}
            except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others' figures
                row = {"case": case.note, "attention": mechanism, "compile": compiled,
                       "checkpointing": checkpointing, "error": f"{type(e).__name__}: {str(e)[:120]}"}
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
