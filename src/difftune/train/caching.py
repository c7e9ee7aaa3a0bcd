"""Fill the text and latent caches, then free the encoders: the text encoder is dropped, the VAE is
kept on the CPU only when validation needs it to decode.

Validation prompts (and their input image, for image-to-image flavours) are encoded here too, while
the text encoder is still loaded.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from difftune.config import RunConfig
from difftune.data.buckets import SizeRule
from difftune.data.cache import TensorCache, TextJob, fill_text_cache
from difftune.data.discovery import Discovery, image_files
from difftune.data.images import load_rgb
from difftune.data.latents import CachedSample, fill_latent_cache, text_jobs
from difftune.models.base import Components, Family, SampleRequest
from difftune.train.events import Events


@dataclass
class Cached:
    samples: list[CachedSample]
    text_cache: TensorCache
    failed: list[tuple[Path, str]]
    validation: list[SampleRequest]


def negative_cache(text_cache: TensorCache) -> TensorCache:
    """Negative prompts may be encoded differently from captions: they get their own folder."""
    return TensorCache(text_cache.folder / "negative", {"role": "negative"})


def validation_image(run_cfg: RunConfig, found: list[Discovery]) -> Path | None:
    """Image-to-image validation input: the first image of eval_dataset_id, or the first training pair's."""
    cfg = run_cfg.train
    if cfg.validation_using_datasets:
        plan = run_cfg.datasets
        roots = {ds.id: ds.instance_data_dir for ds in plan.images} | {
            cid: c.instance_data_dir for cid, c in plan.conditioning.items()
        }
        files = image_files(Path(roots[cfg.eval_dataset_id]))
        if not files:
            raise FileNotFoundError(f"eval_dataset_id {cfg.eval_dataset_id!r}: no image in {roots[cfg.eval_dataset_id]}")
        return files[0]
    pairs = sorted(s.conditioning for d in found for s in d.samples if s.conditioning is not None)
    return pairs[0] if pairs else None


def encode_validation(
    run_cfg: RunConfig, family: Family, comps: Components, text_cache: TensorCache, found: list[Discovery]
) -> list[SampleRequest]:
    cfg = run_cfg.train
    prompts = cfg.validation_prompts()
    if not prompts:
        return []
    path = validation_image(run_cfg, found) if family.facts.needs_conditioning(cfg.flavour()) else None
    image: Image.Image | None = load_rgb(path) if path is not None else None
    suffix = "" if path is None else f"\x00validation:{path.resolve()}:{path.stat().st_mtime_ns}"

    def encode(negative: bool):
        return lambda texts, images: family.encode_text(comps, texts, negative=negative, images=images)

    def job(prompt: str) -> TextJob:
        return TextJob(prompt + suffix, prompt, None if image is None else (lambda: image))

    fill_text_cache(text_cache, [job(p) for _, p in prompts], encode(False), 8)
    negatives = negative_cache(text_cache)
    fill_text_cache(negatives, [job(cfg.validation_negative_prompt)], encode(True), 1)
    negative = negatives.get(cfg.validation_negative_prompt + suffix)
    seed = cfg.validation_seed if cfg.validation_seed is not None else cfg.seed
    return [
        SampleRequest(text_cache.get(prompt + suffix), negative, w, h, cfg.validation_num_inference_steps,
                      cfg.guidance(), seed, image, name)
        for name, prompt in prompts
        for w, h in cfg.validation_sizes()
    ]


def fill_caches(
    run_cfg: RunConfig, family: Family, comps: Components, found: list[Discovery], rules: list[SizeRule],
    device: torch.device, events: Events,
) -> Cached:
    cfg = run_cfg.train
    datasets = run_cfg.datasets.images
    identity = family.identity(comps)
    embeds = run_cfg.datasets.text_embeds
    text_root = Path(embeds.cache_dir) if embeds else Path("cache/text") / cfg.model_family
    text_cache = TensorCache(text_root, identity["text"])
    jobs = [job for ds, d in zip(datasets, found, strict=True) for job in text_jobs(d.samples, ds.crop_style, cfg.seed)]
    for module in comps.text_modules():
        module.to(device)
    encoded, text_failed = fill_text_cache(
        text_cache, jobs, lambda prompts, images: family.encode_text(comps, prompts, images=images),
        embeds.write_batch_size if embeds else 32,
    )
    validation = encode_validation(run_cfg, family, comps, text_cache, found)
    events.emit("info", message=f"text cache: {len(jobs)} captions, {encoded} newly encoded ({text_cache.folder})")
    comps.text = {}  # the text encoders' job is done: free the memory before training
    _free(device)

    comps.vae.to(device)
    cached: list[CachedSample] = []
    failed: list[tuple[Path, str]] = []
    for ds, disc, rule in zip(datasets, found, rules, strict=True):
        root = Path(ds.cache_dir_vae) if ds.cache_dir_vae else Path("cache/vae") / cfg.model_family / ds.id
        cache = TensorCache(root, {**identity["vae"], "rule": rule.__dict__, "crop_style": ds.crop_style})
        done, bad = fill_latent_cache(disc.samples, cache, ds.crop_style, cfg.seed,
                                      lambda px: family.encode_images(comps, px), cfg.vae_batch_size)
        cached += [c for c in done if text_cache.has(c.text_key)]
        failed += bad
    failed += [(Path(key.split("\x00")[-1].split("|")[0]), f"input image: {why}") for key, why in text_failed]
    for path, reason in failed:
        events.emit("warning", quiet=True, message=f"skipped {path}: {reason}")
    # The VAE stays (on the CPU) only if validation needs it to decode samples.
    comps.vae = comps.vae.to("cpu") if validation else None
    _free(device)
    return Cached(cached, text_cache, failed, validation)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
