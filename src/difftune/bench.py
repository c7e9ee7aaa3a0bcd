"""`make bench`: a quick performance check of the trainer on the tiny random Lumina2 model.

Measures, in a temporary folder that is removed afterwards:
  - import time of the training stack in a fresh interpreter;
  - time to first step: build_run (discovery, model load, text and latent caches from cold, LoRA,
    optimizer) until the first optimizer step has finished;
  - median optimizer step time over 50 steps (batch 2, 64x64 images);
  - latent cache throughput (decode, crop, VAE encode, write) on 64 images, cold cache;
  - discovery time of 2,000 small captioned images;
  - peak RSS of the process.

It calls the trainer's own functions (load_config, build_run, optimizer_step, fill_latent_cache,
discover) so that the figures follow the code. The tiny model is built before any timing starts: it
is a one-off per machine (kept under $DIFFTUNE_HOME), not part of a run.
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

from difftune.config import RunConfig, load_config
from difftune.data.cache import TensorCache
from difftune.data.discovery import discover
from difftune.data.latents import fill_latent_cache
from difftune.demo import make_dataset
from difftune.models import get_family
from difftune.train.events import Events
from difftune.train.loop import optimizer_step
from difftune.train.setup import DTYPES, build_run, resolve_source, size_rule

TRAIN_IMAGES = 64
IMAGE_SIZE = (64, 64)
BATCH_SIZE = 2
TIMED_STEPS = 50
DISCOVERY_FILES = 2000
DISCOVERY_REPEATS = 3


def machine_info() -> dict[str, str]:
    cpuinfo = Path("/proc/cpuinfo")  # Linux; elsewhere platform gives what it can
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
             if ln.startswith("model name")] if cpuinfo.exists() else []
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no CUDA device)"
    return {
        "cpu": names[0] if names else platform.processor() or platform.machine(),
        "cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
    }


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


def write_config(root: Path, data_dir: Path) -> Path:
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
        "model_family": "lumina2", "model_flavour": "tiny-random", "model_type": "lora",
        "mixed_precision": "no", "output_dir": str(root / "output"), "data_backend_config": str(backend),
        "train_batch_size": BATCH_SIZE, "learning_rate": 1e-3, "lora_rank": 8,
        "max_train_steps": TIMED_STEPS + 1, "seed": 42,
    }
    path = root / "config.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def bench_import() -> dict[str, float]:
    """A fresh interpreter importing the training stack: every `difftune train` pays this before
    build_run starts, so it belongs beside time to first step (files are in the page cache by now)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import difftune.train.loop"], check=True)
    return {"import_s": time.perf_counter() - started}


def bench_training(run_cfg: RunConfig) -> dict[str, float]:
    events = Events(Path(run_cfg.train.output_dir) / "events.jsonl", console=False)
    started = time.perf_counter()
    run = build_run(run_cfg, events)
    built = time.perf_counter()
    # The same preparation as train(), minus resume and logging: what the first step really costs.
    run.transformer.train()
    batches = iter(run.data)
    optimizer_step(run, batches)
    first = time.perf_counter()
    times = []
    for _ in range(TIMED_STEPS):
        t = time.perf_counter()
        optimizer_step(run, batches)
        times.append(time.perf_counter() - t)
    times.sort()
    return {
        "build_run_s": built - started,
        "first_step_s": first - started,
        "step_median_ms": statistics.median(times) * 1000,
        "step_p90_ms": times[int(0.9 * (len(times) - 1))] * 1000,
    }


def bench_cache(root: Path, data_dir: Path) -> dict[str, float]:
    """Latent cache fill alone, into a fresh cache folder: decode + crop + VAE encode + write."""
    run_cfg = load_config(write_config(root, data_dir))
    cfg, dataset = run_cfg.train, run_cfg.datasets.images[0]
    family = get_family(cfg.model_family)
    comps = family.load(resolve_source(cfg, family), DTYPES[cfg.weight_dtype_name()])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    comps.vae.to(device)
    samples = discover(dataset.id, data_dir, size_rule(dataset, family)).samples
    cache = TensorCache(root / "cache-bench", family.identity(comps)["vae"])
    started = time.perf_counter()
    done, failed = fill_latent_cache(samples, cache, dataset.crop_style, cfg.seed,
                                     lambda px: family.encode_images(comps, px), cfg.vae_batch_size)
    elapsed = time.perf_counter() - started
    if failed or len(done) != len(samples):
        raise RuntimeError(f"latent cache bench: {len(failed)} image(s) failed: {failed[:3]}")
    return {"cache_images": len(done), "cache_s": elapsed, "cache_images_per_s": len(done) / elapsed,
            "vae_batch_size": cfg.vae_batch_size}


def bench_discovery(root: Path) -> dict[str, float]:
    folder = root / "discovery"
    make_dataset(folder, count=DISCOVERY_FILES, size=(32, 32), seed=1)
    run_cfg = load_config(write_config(root, folder))
    dataset = run_cfg.datasets.images[0]
    rule = size_rule(dataset, get_family(run_cfg.train.model_family))
    times = []
    for _ in range(DISCOVERY_REPEATS):
        t = time.perf_counter()
        found = discover(dataset.id, folder, rule)
        times.append(time.perf_counter() - t)
    if len(found.samples) != DISCOVERY_FILES:
        raise RuntimeError(f"discovery bench: found {len(found.samples)} of {DISCOVERY_FILES} images")
    return {"discovery_s": statistics.median(times), "discovery_files": DISCOVERY_FILES}


def rows(r: dict[str, float]) -> list[tuple[str, str, str]]:
    return [
        ("import of training stack", f"{r['import_s']:.2f} s",
         "fresh interpreter: import difftune.train.loop (torch, diffusers, transformers, peft)"),
        ("time to first step", f"{r['first_step_s']:.2f} s",
         f"build_run + 1 step, cold caches, {TRAIN_IMAGES} images (build_run alone {r['build_run_s']:.2f} s)"),
        ("optimizer step, median", f"{r['step_median_ms']:.1f} ms",
         f"{TIMED_STEPS} steps, batch {BATCH_SIZE}, {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}, fp32 "
         f"(p90 {r['step_p90_ms']:.1f} ms)"),
        ("latent cache fill", f"{r['cache_images_per_s']:.1f} images/s",
         f"{r['cache_images']} images {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}, cold cache, "
         f"vae_batch_size {r['vae_batch_size']} ({r['cache_s']:.2f} s)"),
        ("discovery", f"{r['discovery_s'] * 1000:.0f} ms",
         f"{r['discovery_files']} images 32x32 with .txt captions, median of {DISCOVERY_REPEATS}"),
        ("peak RSS", f"{r['peak_rss_mib']:.0f} MiB", "whole benchmark process (ru_maxrss)"),
    ]


def main() -> int:
    # Library chatter (progress bars, load reports) would bury the table.
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()

    info = machine_info()
    for key, value in info.items():
        print(f"{key:>14}: {value}")
    with tempfile.TemporaryDirectory(prefix="difftune-bench-") as tmp:
        root = Path(tmp)
        data_dir = root / "data"
        make_dataset(data_dir, count=TRAIN_IMAGES, size=IMAGE_SIZE)
        run_cfg = load_config(write_config(root / "train", data_dir))
        family = get_family(run_cfg.train.model_family)
        # A one-off per machine; built before timing so that "first step" measures a run, not a build.
        resolve_source(run_cfg.train, family)
        started = time.perf_counter()
        snapshot = cpu_snapshot()
        print("\nimport ...", flush=True)
        results: dict[str, float] = bench_import()
        print("training (time to first step, step time) ...", flush=True)
        results |= bench_training(run_cfg)
        print("latent cache fill ...", flush=True)
        results |= bench_cache(root / "cache", data_dir)
        print("discovery ...", flush=True)
        results |= bench_discovery(root / "discovery")
        results["peak_rss_mib"] = peak_rss_mib()
        results["other_cores"] = other_cores(snapshot)
        total = time.perf_counter() - started

    table = rows(results)
    others = results["other_cores"]
    print(f"\nresults (benchmark took {total:.0f} s; other processes kept {others:.2f} cores busy meanwhile)\n")
    if others > 0.2:
        print("  warning: the machine was busy with other work; these figures are likely too slow\n")
    for name, value, detail in table:
        print(f"  {name:<24} {value:>14}   {detail}")
    print("\nmarkdown:\n")
    print(f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, device {info['device']}\n")
    print("| measure | value | conditions |")
    print("| --- | ---: | --- |")
    for name, value, detail in table:
        print(f"| {name} | {value} | {detail} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
