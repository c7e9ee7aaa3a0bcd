"""`make bench`: a quick performance check of the trainer on the tiny random-init models.

Measures, in a temporary folder that is removed afterwards: import time of the training stack; time to
first step on tiny Lumina2 (build_run from cold caches, then one optimizer step); median step time on
tiny Lumina2 and tiny Kandinsky 5 image; the batch source's per-batch cost without the model
(TrainingData at batch 4: sampler, cached latents and text embeddings, collate); latent cache
throughput with vae_batch_size 1 and 8; discovery of 10,000 small files without and with the metadata
cache; the cost of verifying a cache entry where training reads it (checksum, layout, finiteness)
against a plain `load_file`; peak RSS. It calls the trainer's own functions so that the figures follow the code. Tiny models
are built before any timing starts: a one-off per machine (kept under $DIFFTUNE_HOME), not part of a run.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from difftune.config import RunConfig, load_config
from difftune.data.batches import TrainingData
from difftune.data.cache import TensorCache, read
from difftune.data.discovery import discover
from difftune.data.latents import fill_latent_cache
from difftune.data.sampler import BucketSampler
from difftune.demo import make_dataset
from difftune.models import get_family
from difftune.train import prefetch
from difftune.train.events import Events
from difftune.train.loop import optimizer_step
from difftune.train.plan import dataset_spec, size_rules
from difftune.train.setup import DTYPES, build_run, model_sources, resolve_source

TRAIN_IMAGES = 64
IMAGE_SIZE = (64, 64)
BATCH_SIZE = 2
TIMED_STEPS = 50
KANDINSKY = ("kandinsky5-image", "tiny-random")
CACHE_IMAGES = 128
CACHE_REPEATS = 3
VAE_BATCH_SIZES = (1, 8)
SAMPLER_BATCH = 4
SAMPLER_BATCHES = 200
DISCOVERY_FILES = 10_000
DISCOVERY_REPEATS = 3
VIDEO_CLIPS = 16
VERIFY_ENTRIES = 64
VERIFY_SHAPES = {"tiny": (16, 8, 8), "1mib": (16, 128, 128)}  # the bench's latents; a 1024 px Lumina2 latent
VIDEO_SOURCE = (64, 48, 30, 30.0)  # width, height, frames, fps of each synthetic clip (1 s at 30 fps)
VIDEO_FRAMES = 17  # trained frames: resampled to 24 fps, 4k+1


def machine_info() -> dict[str, str]:
    cpuinfo = Path("/proc/cpuinfo")  # Linux; elsewhere platform gives what it can
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
             if ln.startswith("model name")] if cpuinfo.exists() else []
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no CUDA device)"
    cpu = names[0] if names else platform.processor() or platform.machine()
    return {"cpu": cpu, "cores": str(os.cpu_count()), "torch threads": str(torch.get_num_threads()),
            "python": platform.python_version(), "torch": torch.__version__, "device": device}


def cpu_snapshot() -> tuple[float, float, float]:
    """(CPU seconds used machine-wide, by this process, wall clock). Steal counts as used: time the
    hypervisor gave to someone else is lost to us just the same."""
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)
    own = psutil.Process().cpu_times()  # children: the import benchmark's interpreter is ours too
    return busy, own.user + own.system + own.children_user + own.children_system, time.perf_counter()


def other_cores(start: tuple[float, float, float]) -> float:
    """Average number of cores other processes kept busy since `start`. Another busy process makes
    torch's threads wait on each other; on 2 cores that slowed steps and VAE passes about 10x here."""
    busy, own, wall = cpu_snapshot()
    return max(0.0, ((busy - start[0]) - (own - start[1])) / (wall - start[2]))


def peak_rss_mib() -> float:
    # ru_maxrss is KiB on Linux but bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def write_config(root: Path, data_dir: Path, family="lumina2", flavour="tiny-random") -> RunConfig:
    """A run like the demo's, without validation (sampling is not what we time) and without checkpoints."""
    datasets = [
        {"id": "bench", "type": "local", "dataset_type": "image", "instance_data_dir": str(data_dir),
         "caption_strategy": "textfile", "resolution": IMAGE_SIZE[0], "resolution_type": "pixel_area",
         "cache_dir_vae": str(root / "cache" / "vae")},
        {"id": "text-embeds", "type": "local", "dataset_type": "text_embeds", "default": True,
         "cache_dir": str(root / "cache" / "text")},
    ]
    root.mkdir(parents=True, exist_ok=True)
    backend = root / "multidatabackend.json"
    backend.write_text(json.dumps(datasets, indent=2))
    config = {
        "model_family": family, "model_flavour": flavour, "model_type": "lora",
        "mixed_precision": "no", "output_dir": str(root / "output"), "data_backend_config": str(backend),
        "train_batch_size": BATCH_SIZE, "learning_rate": 1e-3, "lora_rank": 8,
        "max_train_steps": TIMED_STEPS + 1, "seed": 42,
    }
    path = root / "config.json"
    path.write_text(json.dumps(config, indent=2))
    return load_config(path)


def bench_import() -> dict[str, float]:
    """A fresh interpreter importing the training stack, as every `difftune train` does first."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import difftune.train.loop"], check=True)
    return {"import_s": time.perf_counter() - started}


def bench_training(run_cfg: RunConfig, prefix: str) -> tuple[dict[str, float], TrainingData]:
    events = Events(Path(run_cfg.train.output_dir) / "events.jsonl", console=False)
    started = time.perf_counter()
    run = build_run(run_cfg, events)
    built = time.perf_counter()
    # The same preparation as train(), minus resume and logging: what the first step really costs.
    run.transformer.train()
    batches = prefetch.feed(run)  # read ahead, as train() does
    optimizer_step(run, batches)
    first = time.perf_counter()
    times = []
    for _ in range(TIMED_STEPS):
        t = time.perf_counter()
        optimizer_step(run, batches)
        times.append(time.perf_counter() - t)
    times.sort()
    batches.close()
    events.close()
    return {
        f"{prefix}build_run_s": built - started,
        f"{prefix}first_step_s": first - started,
        f"{prefix}step_median_ms": statistics.median(times) * 1000,
        f"{prefix}step_p90_ms": times[int(0.9 * (len(times) - 1))] * 1000,
    }, run.data


def bench_sampler(data: TrainingData) -> dict[str, float]:
    """TrainingData iteration without the model: sampler + load cached latents + text embeddings +
    collate, over the training run's own items and caches (just written, so in the page cache)."""
    parts = [(list(range(len(data.items))), [c.sample.group for c in data.items], None)]
    samplers = [BucketSampler(parts, SAMPLER_BATCH, data.seed, keep_partial=False) for _ in range(2)]
    source = TrainingData(data.items, data.text_caches, samplers[0], data.collate_text, data.caption_dropout,
                          data.seed)
    full, alone = timed_next(source, SAMPLER_BATCHES), timed_next(samplers[1], SAMPLER_BATCHES)
    return {"sampler_median_ms": statistics.median(full) * 1000, "sampler_max_ms": max(full) * 1000,
            "sampler_only_ms": statistics.median(alone) * 1000}  # the sampler alone: indices, no file read


def timed_next(source, n: int) -> list[float]:
    """Seconds taken by each of the first n items of iter(source)."""
    it, times = iter(source), []
    for _ in range(n):
        t = time.perf_counter()
        next(it)
        times.append(time.perf_counter() - t)
    return times


def bench_cache(root: Path) -> dict[str, float]:
    """Latent cache fill alone (decode, crop, VAE encode, write), into a fresh cache per vae_batch_size."""
    make_dataset(data_dir := root / "images", count=CACHE_IMAGES, size=IMAGE_SIZE, seed=2)
    run_cfg = write_config(root, data_dir)
    cfg, dataset = run_cfg.train, run_cfg.datasets.images[0]
    family = get_family(cfg.model_family)
    comps = family.load(model_sources(cfg), DTYPES[cfg.weight_dtype_name()])
    comps.vae.to(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    samples = discover(dataset_spec(run_cfg, dataset, size_rules(run_cfg)[0])).samples

    def encode(px: torch.Tensor) -> torch.Tensor:
        return family.encode_images(comps, px)

    with torch.no_grad():  # one-off warm-up (allocator, kernels) outside the timings
        encode(torch.zeros(8, 3, *IMAGE_SIZE))
    times: dict[int, list[float]] = {batch: [] for batch in VAE_BATCH_SIZES}
    for repeat in range(CACHE_REPEATS):  # interleaved: a burst of other load hits one pass, not one size
        for batch in VAE_BATCH_SIZES:
            cache = TensorCache(root / f"cache-{repeat}-bs{batch}", family.identity(comps)["vae"])
            started = time.perf_counter()
            done, failed = fill_latent_cache(samples, cache, dataset.crop_style, cfg.seed, encode, batch)
            times[batch].append(time.perf_counter() - started)
            if failed or len(done) != CACHE_IMAGES:
                raise RuntimeError(f"cache bench: {len(done)} of {CACHE_IMAGES} cached; failed {failed[:3]}")
    return {f"cache_bs{batch}_per_s": CACHE_IMAGES / statistics.median(t) for batch, t in times.items()}


def bench_verification(root: Path) -> dict[str, float]:
    """Reading a cache entry as training does (`cache.read`: one read, safetensors load, CRC-32 over the
    layout and bytes, finiteness) against a plain `load_file`, per entry, for tiny latents and a 1 MiB
    latent. Interleaved, median over entries and 3 passes; the files are in the page cache. Also the same
    latents in bf16 written compressed (compress_disk_cache) against plain, with the size saved."""
    results: dict[str, float] = {}
    for name, shape in VERIFY_SHAPES.items():
        cache = TensorCache(root / name, {"bench": name})
        packed = TensorCache(root / f"{name}-packed", {"bench": name}, compress=True)
        latents = [torch.randn(shape) for _ in range(VERIFY_ENTRIES)]
        paths = [cache.put(str(i), {"latents": x}) for i, x in enumerate(latents)]
        bf16 = [cache.put(f"bf16-{i}", {"latents": x.bfloat16()}) for i, x in enumerate(latents)]
        deflated = [packed.put(f"bf16-{i}", {"latents": x.bfloat16()}) for i, x in enumerate(latents)]
        times: dict[str, list[float]] = {"plain": [], "verified": [], "bf16": [], "packed": []}
        for _ in range(3):
            for entry in zip(paths, paths, bf16, deflated, strict=True):
                for (kind, load), path in zip((("plain", load_file), ("verified", read), ("bf16", read),
                                               ("packed", read)), entry, strict=True):
                    t = time.perf_counter()
                    load(path)
                    times[kind].append(time.perf_counter() - t)
        ms = {kind: statistics.median(t) * 1000 for kind, t in times.items()}
        saved = 1 - sum(p.stat().st_size for p in deflated) / sum(p.stat().st_size for p in bf16)
        results |= {f"verify_{name}_plain_ms": ms["plain"], f"verify_{name}_ms": ms["verified"],
                    f"verify_{name}_bf16_ms": ms["bf16"], f"verify_{name}_packed_ms": ms["packed"],
                    f"verify_{name}_packed_saved": saved}
    return results


def bench_discovery(root: Path) -> dict[str, float]:
    """discover() over 10,000 files: cold (no metadata cache: every header read), then warm (the
    metadata file the cold scan wrote). The files were just written, so they are in the page cache."""
    folder = root / "images"
    make_dataset(folder, count=DISCOVERY_FILES, size=(32, 32), seed=1)
    run_cfg = write_config(root, folder)
    spec = dataset_spec(run_cfg, run_cfg.datasets.images[0], size_rules(run_cfg)[0])
    results: dict[str, float] = {}
    for kind in ("cold", "warm"):
        times = []
        for _ in range(DISCOVERY_REPEATS):
            if kind == "cold" and spec.metadata_file.exists():
                spec.metadata_file.unlink()
            t = time.perf_counter()
            found = discover(spec)
            times.append(time.perf_counter() - t)
            expected = DISCOVERY_FILES if kind == "cold" else 0
            if len(found.samples) != DISCOVERY_FILES or found.probed != expected:
                raise RuntimeError(f"discovery bench ({kind}): {len(found.samples)} of {DISCOVERY_FILES} "
                                   f"images, {found.probed} probed (expected {expected})")
        results[f"discovery_{kind}_s"] = statistics.median(times)
    return results


def video_config(root: Path) -> RunConfig:
    """Tiny Kandinsky 5 Video (t2v) on synthetic 30 fps clips, resampled to 24 fps, 17 frames each."""
    from difftune.data.video import synthetic_clip

    clips = root / "clips"
    clips.mkdir(parents=True, exist_ok=True)
    width, height, frames, fps = VIDEO_SOURCE
    for i in range(VIDEO_CLIPS):
        synthetic_clip(clips / f"clip{i:02d}.mp4", width=width, height=height, frames=frames, fps=fps, seed=i)
        (clips / f"clip{i:02d}.txt").write_text(f"a square moving across, take {i}")
    datasets = [
        {"id": "clips", "dataset_type": "video", "instance_data_dir": str(clips), "resolution": 64,
         "video": {"num_frames": VIDEO_FRAMES}, "cache_dir_vae": str(root / "cache" / "vae")},
        {"id": "text-embeds", "dataset_type": "text_embeds", "default": True, "cache_dir": str(root / "cache" / "text")},
    ]
    (root / "multidatabackend.json").write_text(json.dumps(datasets))
    config = {"model_family": "kandinsky5-video", "model_flavour": "tiny-random", "mixed_precision": "no",
              "output_dir": str(root / "output"), "data_backend_config": str(root / "multidatabackend.json"),
              "train_batch_size": 1, "learning_rate": 1e-3, "lora_rank": 8, "max_train_steps": TIMED_STEPS + 1}
    (root / "config.json").write_text(json.dumps(config))
    return load_config(root / "config.json")


def bench_video(root: Path) -> dict[str, float]:
    """Clip decoding alone (PyAV, resampled by timestamp), then a tiny t2v run: its time to first step
    includes probing, decoding and VAE-encoding every clip into the empty cache."""
    from difftune.data.frames import frame_times
    from difftune.data.video import decode_frames

    run_cfg = video_config(root)
    resolve_source(run_cfg.train)  # the tiny build is a one-off per machine, not part of the timings
    paths = sorted((root / "clips").glob("*.mp4"))
    started = time.perf_counter()
    for path in paths:
        decode_frames(path, frame_times(VIDEO_FRAMES, 24.0))
    decode_s = time.perf_counter() - started
    results, _ = bench_training(run_cfg, "k5v_")
    return results | {"k5v_decode_fps": len(paths) * VIDEO_FRAMES / decode_s}


def rows(r: dict[str, float]) -> list[tuple[str, str, str]]:
    size = f"{IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}"
    steps = f"{TIMED_STEPS} steps, batch {BATCH_SIZE}, {size}, fp32, LoRA rank 8"
    return [
        ("import of training stack", f"{r['import_s']:.2f} s",
         "fresh interpreter: import difftune.train.loop (torch, diffusers, transformers, peft)"),
        ("time to first step", f"{r['first_step_s']:.2f} s",
         f"tiny Lumina2, build_run + 1 step, cold caches, {TRAIN_IMAGES} images {size} "
         f"(build_run alone {r['build_run_s']:.2f} s)"),
        ("optimizer step, median", f"{r['step_median_ms']:.1f} ms",
         f"tiny Lumina2, {steps} (p90 {r['step_p90_ms']:.1f} ms)"),
        ("optimizer step, median (Kandinsky 5)", f"{r['k5_step_median_ms']:.1f} ms",
         f"tiny Kandinsky 5 image (t2i), {steps} (p90 {r['k5_step_p90_ms']:.1f} ms; "
         f"first step {r['k5_first_step_s']:.2f} s)"),
        ("optimizer step, median (Kandinsky 5 Video)", f"{r['k5v_step_median_ms']:.1f} ms",
         f"tiny Kandinsky 5 Video (t2v), {TIMED_STEPS} steps, batch 1, {VIDEO_FRAMES} frames of 64x48 (80x48 bucket), "
         f"fp32, LoRA rank 8 (p90 {r['k5v_step_p90_ms']:.1f} ms)"),
        ("time to first step (Kandinsky 5 Video)", f"{r['k5v_first_step_s']:.2f} s",
         f"tiny t2v, build_run + 1 step, cold caches: {VIDEO_CLIPS} clips of {VIDEO_SOURCE[2]} frames at "
         f"{VIDEO_SOURCE[3]:g} fps probed, resampled to 24 fps, decoded and encoded"),
        ("clip decoding", f"{r['k5v_decode_fps']:.0f} frames/s",
         f"PyAV decode_frames of {VIDEO_FRAMES} frames at 24 fps from {VIDEO_SOURCE[0]}x{VIDEO_SOURCE[1]} H.264 "
         f"at {VIDEO_SOURCE[3]:g} fps, {VIDEO_CLIPS} clips"),
        (f"batch source, per batch of {SAMPLER_BATCH}", f"{r['sampler_median_ms']:.2f} ms",
         f"TrainingData iteration without the model, tiny Lumina2 caches, median of {SAMPLER_BATCHES} "
         f"(max {r['sampler_max_ms']:.1f} ms; sampler alone {r['sampler_only_ms'] * 1000:.1f} us)"),
        *((f"latent cache fill, vae_batch_size {b}", f"{r[f'cache_bs{b}_per_s']:.0f} images/s",
           f"tiny Lumina2 VAE, {CACHE_IMAGES} images {size}, cold cache, median of {CACHE_REPEATS}")
          for b in VAE_BATCH_SIZES),
        ("discovery, cold", f"{r['discovery_cold_s']:.2f} s",
         f"{DISCOVERY_FILES:,} images 32x32 + .txt, no metadata cache, median of {DISCOVERY_REPEATS}"),
        ("discovery, warm", f"{r['discovery_warm_s']:.2f} s",
         f"same files, metadata cache from the cold scan, median of {DISCOVERY_REPEATS}"),
        *((f"cache entry read, verified ({label})", f"{r[f'verify_{name}_ms']:.3f} ms",
           f"cache.read (CRC-32, layout, finite) of a {label} latent entry; plain load_file "
           f"{r[f'verify_{name}_plain_ms']:.3f} ms; median of {VERIFY_ENTRIES} entries x 3")
          for name, label in (("tiny", "16x8x8 f32"), ("1mib", "16x128x128 f32 (1 MiB)"))),
        *((f"cache entry read, compressed ({label} bf16)", f"{r[f'verify_{name}_packed_ms']:.3f} ms",
           f"compress_disk_cache: {r[f'verify_{name}_packed_saved']:.0%} less disk; the same entry plain "
           f"{r[f'verify_{name}_bf16_ms']:.3f} ms; median of {VERIFY_ENTRIES} entries x 3")
          for name, label in (("tiny", "16x8x8"), ("1mib", "16x128x128"))),
        ("peak RSS", f"{r['peak_rss_mib']:.0f} MiB", "whole benchmark process (ru_maxrss)"),
    ]


def main() -> int:
    # Library chatter (progress bars, load reports) would bury the table.
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.set_verbosity_error()
        library.disable_progress_bar()

    info = machine_info()
    print("\n".join(f"{key:>14}: {value}" for key, value in info.items()) + "\n")
    with tempfile.TemporaryDirectory(prefix="difftune-bench-") as tmp:
        root = Path(tmp)
        data_dir = root / "data"
        make_dataset(data_dir, count=TRAIN_IMAGES, size=IMAGE_SIZE)
        lumina = write_config(root / "train", data_dir)
        kandinsky = write_config(root / "train-k5", data_dir, *KANDINSKY)
        for run_cfg in (lumina, kandinsky):  # a one-off per machine: "first step" measures a run, not a build
            resolve_source(run_cfg.train)
        started, snapshot, loads = time.perf_counter(), cpu_snapshot(), {}

        def phase(name: str, fn):  # runs one measurement, noting how busy other processes kept the cores
            print(f"{name} ...", flush=True)
            before = cpu_snapshot()
            out = fn()
            loads[name] = other_cores(before)
            return out

        results: dict[str, float] = phase("import", bench_import)
        lumina_results, data = phase("Lumina2 training", lambda: bench_training(lumina, ""))
        results |= lumina_results | phase("batch source", lambda: bench_sampler(data))
        results |= phase("Kandinsky 5 training", lambda: bench_training(kandinsky, "k5_")[0])
        results |= phase("Kandinsky 5 Video", lambda: bench_video(root / "video"))
        results |= phase("latent cache fill", lambda: bench_cache(root / "cache"))
        results |= phase("discovery", lambda: bench_discovery(root / "discovery"))
        results |= phase("cache verification", lambda: bench_verification(root / "verify"))
        results["peak_rss_mib"] = peak_rss_mib()
        results["other_cores"] = other_cores(snapshot)
        total = time.perf_counter() - started

    table = rows(results)
    per_phase = ", ".join(f"{name} {load:.2f}" for name, load in loads.items())
    print(f"\nresults (benchmark took {total:.0f} s; other processes kept {results['other_cores']:.2f} "
          f"cores busy meanwhile; per phase: {per_phase})\n")
    if busy := [name for name, load in loads.items() if load > 0.2]:
        print(f"  warning: the machine was busy with other work during {', '.join(busy)}; those figures are "
              "likely too slow\n")
    for name, value, detail in table:
        print(f"  {name:<38} {value:>12}   {detail}")
    print("\nmarkdown:\n")
    print(f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, device {info['device']}\n")
    print("| measure | value | conditions |")
    print("| --- | ---: | --- |")
    for name, value, detail in table:
        print(f"| {name} | {value} | {detail} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
