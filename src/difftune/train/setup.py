"""Build everything a run needs, as a straight sequence of named steps: `build_run(cfg)`.

Order matters for memory: discover data (no model), load the model, fill the text cache and drop
the text encoder, fill the latent cache and park the VAE, then attach the adapter and optimizer.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from diffusers.optimization import get_scheduler
from peft import LoraConfig

from difftune.config import RunConfig, TrainConfig
from difftune.data.batches import TrainingData
from difftune.data.buckets import SizeRule
from difftune.data.cache import TensorCache, fill_text_cache
from difftune.data.discovery import Discovery, discover
from difftune.data.latents import CachedSample, fill_latent_cache
from difftune.data.report import DataReport
from difftune.data.sampler import BucketSampler
from difftune.models import get_family
from difftune.models.base import Components, Family, SampleRequest
from difftune.models.registry import TINY_FLAVOUR
from difftune.models.tiny import ensure_built
from difftune.train.events import Events

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class DataError(Exception):
    """The datasets cannot train (for example a dataset with no usable image)."""


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed


@dataclass
class Run:
    cfg: TrainConfig
    accelerator: Accelerator
    family: Family
    comps: Components
    transformer: Any  # prepared (possibly wrapped) module
    params: list[torch.nn.Parameter]
    optimizer: Any
    lr_scheduler: Any
    data: TrainingData
    validation: list[SampleRequest]
    events: Events
    output_dir: Path
    total_steps: int
    generator: torch.Generator
    state: TrainState = field(default_factory=TrainState)


def resolve_source(cfg: TrainConfig, family: Family) -> str:
    if cfg.pretrained_model_name_or_path is None and cfg.flavour() == TINY_FLAVOUR:
        return str(ensure_built(f"{cfg.model_family}-v1", family.build_tiny))
    return cfg.model_source()


def size_rule(ds, family: Family) -> SizeRule:
    return SizeRule(
        resolution=ds.resolution, resolution_type=ds.resolution_type, crop=ds.crop, crop_aspect=ds.crop_aspect,
        multiple=family.pixel_multiple, minimum_image_size=ds.minimum_image_size,
        maximum_image_size=ds.maximum_image_size, target_downsample_size=ds.target_downsample_size,
    )


def discover_all(run_cfg: RunConfig, family: Family) -> list[Discovery]:
    found = [discover(ds.id, Path(ds.instance_data_dir), size_rule(ds, family)) for ds in run_cfg.datasets.images]
    empty = [d.dataset_id for d in found if not d.samples]
    if empty:
        report = DataReport(found, [], {})
        raise DataError(
            f"dataset(s) {', '.join(map(repr, empty))} have no usable image (see the report above "
            f"for each file's reason); add captioned images or disable the dataset\n{report.render()}"
        )
    return found


def fill_caches(
    run_cfg: RunConfig, family: Family, comps: Components, found: list[Discovery], device: torch.device,
    events: Events,
) -> tuple[list[CachedSample], TensorCache, list[tuple[Path, str]]]:
    cfg = run_cfg.train
    identity = family.identity(comps)
    embeds = run_cfg.datasets.text_embeds
    text_root = Path(embeds.cache_dir) if embeds else Path("cache/text") / cfg.model_family
    text_cache = TensorCache(text_root, identity["text"])
    captions = {s.caption for d in found for s in d.samples}
    if cfg.validation_prompt is not None:
        captions.add(cfg.validation_prompt)
    batch = embeds.write_batch_size if embeds else 32
    comps.text_encoder.to(device)
    n = fill_text_cache(text_cache, captions, lambda p: family.encode_text(comps, p), batch)
    if cfg.validation_prompt is not None:
        fill_text_cache(negative_cache(text_cache), [cfg.validation_negative_prompt],
                        lambda p: family.encode_text(comps, p, negative=True), batch)
    events.emit("info", message=f"text cache: {len(captions)} captions, {n} newly encoded ({text_cache.folder})")
    comps.text_encoder = None  # its job is done: free the memory before training
    _free(device)

    comps.vae.to(device)
    cached: list[CachedSample] = []
    failed: list[tuple[Path, str]] = []
    for ds, disc in zip(run_cfg.datasets.images, found, strict=True):
        root = Path(ds.cache_dir_vae) if ds.cache_dir_vae else Path("cache/vae") / cfg.model_family / ds.id
        rule = size_rule(ds, family)
        cache = TensorCache(root, {**identity["vae"], "rule": rule.__dict__, "crop_style": ds.crop_style})
        done, bad = fill_latent_cache(disc.samples, cache, ds.crop_style, cfg.seed,
                                      lambda px: family.encode_images(comps, px), cfg.vae_batch_size)
        cached += done
        failed += bad
        for path, reason in bad:
            events.emit("warning", quiet=True, message=f"skipped {path}: {reason}")
    # The VAE stays (on the CPU) only if validation needs it to decode samples.
    comps.vae = comps.vae.to("cpu") if cfg.validation_prompt is not None else None
    _free(device)
    return cached, text_cache, failed


def negative_cache(text_cache: TensorCache) -> TensorCache:
    """Negative prompts may be encoded differently from captions: they get their own folder."""
    return TensorCache(text_cache.folder / "negative", {"role": "negative"})


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build_data(
    run_cfg: RunConfig, family: Family, cached: list[CachedSample], text_cache: TensorCache
) -> tuple[TrainingData, dict[tuple[int, int], int]]:
    cfg = run_cfg.train
    repeats = {ds.id: ds.repeats for ds in run_cfg.datasets.images}
    lost = sorted(set(repeats) - {c.sample.dataset_id for c in cached})
    if lost:
        raise DataError(f"dataset(s) {', '.join(map(repr, lost))} have no image that could be decoded; "
                        "see the warnings above for each file")
    items = [c for c in cached for _ in range(1 + repeats[c.sample.dataset_id])]
    counts: dict[tuple[int, int], int] = {}
    for c in items:
        counts[c.sample.bucket] = counts.get(c.sample.bucket, 0) + 1
    pruned = {b: n for b, n in counts.items() if n < cfg.train_batch_size and not cfg.disable_bucket_pruning}
    kept = [c for c in items if c.sample.bucket not in pruned]
    if not kept:
        raise DataError(
            f"every aspect bucket holds fewer images than train_batch_size={cfg.train_batch_size}; "
            "lower train_batch_size, add images, or set disable_bucket_pruning"
        )
    sampler = BucketSampler([c.sample.bucket for c in kept], cfg.train_batch_size, cfg.seed,
                            keep_partial=cfg.disable_bucket_pruning)
    return TrainingData(kept, text_cache, sampler, family.collate_text), pruned


def total_steps(cfg: TrainConfig, batches_per_epoch: int) -> int:
    by_steps = cfg.max_train_steps or math.inf
    by_epochs = math.ceil(cfg.num_train_epochs * batches_per_epoch / cfg.gradient_accumulation_steps) or math.inf
    return int(min(by_steps, by_epochs))


def attach_lora(cfg: TrainConfig, family: Family, transformer: Any) -> list[torch.nn.Parameter]:
    transformer.requires_grad_(False)
    transformer.add_adapter(
        LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.effective_lora_alpha(), init_lora_weights=True,
                   target_modules=list(family.lora_target_modules))
    )
    params = [p for p in transformer.parameters() if p.requires_grad]
    for p in params:  # adapters train in fp32 even when the base is bf16
        p.data = p.data.float()
    if cfg.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return params


def validation_requests(cfg: TrainConfig, text_cache: TensorCache) -> list[SampleRequest]:
    if cfg.validation_prompt is None:
        return []
    text = text_cache.get(cfg.validation_prompt)
    negative = negative_cache(text_cache).get(cfg.validation_negative_prompt)
    seed = cfg.validation_seed if cfg.validation_seed is not None else cfg.seed
    return [
        SampleRequest(text, negative, w, h, cfg.validation_num_inference_steps, cfg.guidance(), seed)
        for w, h in cfg.validation_sizes()
    ]


def build_run(run_cfg: RunConfig, events: Events | None = None) -> Run:
    cfg = run_cfg.train
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    events = events or Events(output_dir / "events.jsonl")
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, cpu=not torch.cuda.is_available())
    family = get_family(cfg.model_family)
    found = discover_all(run_cfg, family)
    for path, reason in (item for d in found for item in d.skipped):
        events.emit("warning", quiet=True, message=f"skipped {path}: {reason}")  # the data report lists them

    source = resolve_source(cfg, family)
    events.emit("info", message=f"loading {cfg.model_family} from {source}")
    comps = family.load(source, DTYPES[cfg.weight_dtype_name()])
    cached, text_cache, failed = fill_caches(run_cfg, family, comps, found, accelerator.device, events)
    data, pruned = build_data(run_cfg, family, cached, text_cache)
    report = DataReport(found, failed, pruned, data).render()
    events.write(report)
    events.emit("data_report", quiet=True, text=report)

    torch.manual_seed(cfg.seed)  # peft draws the initial lora_A from the global RNG: same seed, same run
    params = attach_lora(cfg, family, comps.transformer)
    optimizer = torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.adam_weight_decay, eps=cfg.adam_epsilon,
    )
    steps = total_steps(cfg, data.sampler.batches_per_epoch())
    lr_scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.lr_warmup_steps,
                                 num_training_steps=steps)
    transformer, optimizer = accelerator.prepare(comps.transformer, optimizer)
    events.total_steps = steps
    return Run(
        cfg=cfg, accelerator=accelerator, family=family, comps=comps, transformer=transformer, params=params,
        optimizer=optimizer, lr_scheduler=lr_scheduler, data=data,
        validation=validation_requests(cfg, text_cache), events=events, output_dir=output_dir,
        total_steps=steps, generator=torch.Generator().manual_seed(cfg.seed),
    )
