"""Fill the text and latent caches, then free the encoders: the text encoder is dropped, the VAE is
kept on the CPU only when validation needs it to decode.

Validation prompts (and their input image, for image-to-image flavours) are encoded here too, while
the text encoder is still loaded.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from difftune.config import RunConfig
from difftune.config.crepa_keys import decodes
from difftune.config.dataset_entry_keys import validation_video_fps, validation_video_frames
from difftune.data.buckets import SizeRule
from difftune.data.cache import TensorCache, TextJob, fill_text_cache
from difftune.data.discovery import VIDEO_SUFFIXES, Discovery
from difftune.data.images import fit
from difftune.data.latents import CachedSample, fill_latent_cache, planned, text_jobs, uncached
from difftune.models.base import Components, Family, SampleRequest
from difftune.train import long_captions, validation_input
from difftune.train.crepa import drop_vae_encoder
from difftune.train.distributed import Ranks
from difftune.train.events import Events
from difftune.train.plan import encoded_in_training, latents_on_demand


@dataclass
class Cached:
    samples: list[CachedSample]
    text_caches: dict[str, TensorCache]  # dataset id -> its text cache
    failed: list[tuple[Path, str]]
    validation: list[SampleRequest]
    on_the_fly: bool  # some dataset encodes its images during training (vae_cache_disable, vae_cache_clear_each_epoch,
    # vae_cache_ondemand)
    ondemand: dict[str, Any] = field(default_factory=dict)  # vae_cache_ondemand: dataset id -> writes its entries


def negative_cache(text_cache: TensorCache) -> TensorCache:
    """Negative prompts may be encoded differently from captions: they get their own folder."""
    return TensorCache(text_cache.folder / "negative", {"role": "negative"}, text_cache.compress)


def encode_validation(
    run_cfg: RunConfig, family: Family, comps: Components, text_cache: TensorCache, found: list[Discovery],
    events: Events | None = None, before_encoding: Callable[[], None] = lambda: None,
) -> list[SampleRequest]:
    cfg = run_cfg.train
    prompts = cfg.validation_prompts()
    if not prompts:
        return []
    if not cfg.validation_disable_unconditional:  # what the model draws from no prompt at all
        prompts.append(("unconditional", ""))
    path, image, skipped = validation_input.pick(run_cfg, found)  # image-conditioned flavours: the first readable
    for message in skipped if events is not None else []:
        events.emit("warning", message=message)
    if path is not None and events is not None:
        first = " (its first frame)" if path.suffix.lower() in VIDEO_SUFFIXES else ""
        events.emit("info", message=f"validation input image: {path}{first}")
    suffix = "" if path is None else f"\x00validation:{path.resolve()}:{path.stat().st_mtime_ns}"
    frames, fps = ((validation_video_frames(cfg, run_cfg.datasets), validation_video_fps(cfg, run_cfg.datasets))
                   if family.facts.video else (0, 0.0))

    def encode(negative: bool):
        def encoded(texts, images):
            before_encoding()
            return family.encode_text(comps, texts, negative=negative, images=images)
        return encoded

    # The pipelines resize their input image to the sample's size, stretching it, and the image-to-image text encoder
    # sees it whole (a 4032x3024 photo fills its token budget): like a training input, it is resized to cover each
    # validation size and center-cropped, once per size, and the prompt is encoded with that picture.
    sizes = cfg.validation_sizes()
    pictures = {size: fit(image, size, "center", (0.5, 0.5)) for size in sizes} if image is not None else {}

    def key(prompt: str, size: tuple[int, int]) -> str:
        return prompt + suffix + (f"\x00{size[0]}x{size[1]}" if image is not None else "")

    def jobs(texts: list[str]) -> list[TextJob]:
        made = {key(t, size): TextJob(key(t, size), t, None if image is None else (lambda p=pictures[size]: p))
                for t in texts for size in sizes}
        return list(made.values())

    negatives = negative_cache(text_cache)
    for _ in range(2):  # an entry whose data was damaged is dropped by get (its header looked whole): encoded again
        fill_text_cache(text_cache, jobs([p for _, p in prompts]), encode(False), 8)
        fill_text_cache(negatives, jobs([cfg.validation_negative_prompt]), encode(True), 1)
        negative = {size: negatives.get(key(cfg.validation_negative_prompt, size)) for size in sizes}
        embeds = {(p, size): text_cache.get(key(p, size)) for _, p in prompts for size in sizes}
        unusable = [p for (p, _), e in [*embeds.items(), *(((cfg.validation_negative_prompt, s), e)
                                                             for s, e in negative.items())] if e is None]
        if not unusable:
            break
    if unusable:  # fill_text_cache refused them twice: the text encoder returned NaN or inf
        raise ValueError(f"the text encoder returned NaN or inf for validation prompt {unusable[0]!r}; "
                         "check the model's weights and mixed_precision")
    seed = cfg.validation_seed if cfg.validation_seed is not None else cfg.seed
    return [
        SampleRequest(embeds[(prompt, (w, h))], negative[(w, h)], w, h, cfg.validation_num_inference_steps,
                      cfg.guidance(), seed, pictures.get((w, h)), name, frames, fps, prompt,
                      noise_on_cpu=cfg.validation_seed_source == "cpu")
        for name, prompt in prompts
        for w, h in sizes
    ]


def text_cache_identity(text: dict, precisions: dict[str, str]) -> dict:
    """The text cache's identity: the family's, plus the precision of each quantized text encoder (a
    quantized encoder gives other embeddings). Unquantized encoders add nothing, so caches written before
    text encoders could be quantized stay valid."""
    return {**text, "precisions": precisions} if precisions else text


def text_cache_for(run_cfg: RunConfig, ds, identity: dict) -> tuple[TensorCache, int]:
    """The text cache of a dataset (its own text_embeds entry, or the default) and its batch size."""
    entry = run_cfg.datasets.text_embeds_for(ds)
    root = Path(run_cfg.datasets.text_cache_root(ds, run_cfg.train.model_family))
    compress = _compress(entry.compress_cache if entry else None, run_cfg.train.compress_disk_cache)
    return TensorCache(root, identity, compress), (entry.encode_batch() if entry else 32)


def _compress(own: bool | None, default: bool) -> bool:
    """A dataset entry's compress_cache, else the config's compress_disk_cache."""
    return default if own is None else own


def fill_caches(
    run_cfg: RunConfig, family: Family, comps: Components, found: list[Discovery], rules: list[SizeRule],
    device: torch.device, events: Events, ranks: Ranks | None = None,
) -> Cached:
    """With several processes each encodes its share (`ranks.shard`), then all wait and take the whole
    cache: a second pass finds everything present (only entries that failed are tried again)."""
    ranks = ranks or Ranks()
    cfg = run_cfg.train
    datasets = run_cfg.datasets.discovered()  # the trained ones first (validation prompts share the first's cache)
    identity = family.identity(comps)
    text_identity = text_cache_identity(identity["text"], cfg.text_encoder_precisions())
    text_caches: dict[str, TensorCache] = {}
    placed: list[bool] = []

    def on_device() -> None:
        # the text encoders reach the accelerator only when a caption is to be encoded: with a complete text cache
        # (filled once on a larger GPU by `difftune cache`) Qwen2.5-VL's 15 GiB never come to this one
        if not placed:
            for module in comps.text_modules():
                module.to(device)
            placed.append(True)

    with long_captions.watching() as long:  # captions over the prompt length: one warning, not diffusers' flood
        def encoded(prompts, images):
            on_device()
            return family.encode_text(comps, prompts, images=images)

        encode = long.wrap(encoded)
        encoded, text_failed, total, distinct = _fill_text(run_cfg, datasets, found, text_caches, text_identity,
                                                           encode, events, ranks)
    if (said := long.message()) is not None:
        events.emit("warning", message=f"text cache: {said}")
    validation = (encode_validation(run_cfg, family, comps, text_caches[datasets[0].id], found, events, on_device)
                  if ranks.main else [])
    per_process = ranks.gather(encoded)
    new = sum(per_process)
    events.emit("info", message=f"text cache: {total} captions, {distinct} distinct: "
                + counts(distinct - new - len(text_failed), new, len(text_failed), per_process))
    comps.text = {}  # the text encoders' job is done: free the memory before training
    _free(device)
    return _fill_latents(run_cfg, family, comps, found, rules, device, events, ranks, identity, text_caches,
                         text_failed, validation)


def _fill_text(run_cfg: RunConfig, datasets: list, found: list[Discovery], text_caches: dict[str, TensorCache],
               text_identity: dict, encode, events: Events, ranks: Ranks) -> tuple[int, list, int, int]:
    """The datasets' captions, each process its share, then a second pass that retries only failures."""
    cfg = run_cfg.train
    encoded, text_failed, total = 0, [], 0
    distinct: set[tuple[Path, str]] = set()  # over datasets: two that share captions and a cache encode them once
    all_jobs = {}
    for ds, d in zip(datasets, found, strict=True):
        cache, batch = text_cache_for(run_cfg, ds, text_identity)
        text_caches[ds.id] = cache
        jobs = text_jobs(d.samples, ds.crop_style, cfg.seed, with_empty=cfg.caption_dropout_probability > 0)
        unique = sorted({job.key: job for job in jobs}.values(), key=lambda job: job.key)
        all_jobs[ds.id] = (cache, batch, unique)
        total += len(jobs)
        distinct |= {(cache.folder, job.key) for job in unique}
        mine = ranks.shard(unique)
        n, _ = fill_text_cache(  # failures are reported by the second pass
            cache, mine, encode, batch, on_progress=progress(events, f"text embeddings ({ds.id})", len(mine)),
        )
        encoded += n
    ranks.barrier()
    for cache, batch, unique in all_jobs.values():  # after the others' shares: only failures are retried
        n, bad = fill_text_cache(cache, unique, encode, batch)
        encoded, text_failed = encoded + n, text_failed + bad
    return encoded, text_failed, total, len(distinct)


def _fill_latents(run_cfg: RunConfig, family: Family, comps: Components, found: list[Discovery],
                  rules: list[SizeRule], device: torch.device, events: Events, ranks: Ranks, identity: dict,
                  text_caches: dict[str, TensorCache], text_failed: list, validation: list) -> Cached:
    """Each dataset's latents (or its on-the-fly plan), with the VAE alone on the accelerator. `identity`: the
    family's, taken while the text encoders were still loaded."""
    cfg = run_cfg.train
    datasets = run_cfg.datasets.discovered()

    if cfg.vae_enable_patch_conv and not _patch_conv(comps.vae):
        raise ValueError(f"vae_enable_patch_conv: the VAE of {comps.source} has no 3D convolution to split; "
                         "set it to false")
    comps.vae.to(device)  # only now: the text encoders are gone, so the two never share the accelerator
    cached: list[CachedSample] = []
    failed: list[tuple[Path, str]] = []
    on_the_fly = False
    ondemand: dict[str, Any] = {}
    latents_encoded = 0  # by this process, in its share
    for ds, disc, rule in zip(datasets, found, rules, strict=True):
        if encoded_in_training(cfg, ds):
            on_the_fly = True  # encoded during training: nothing written, the VAE stays loaded
            cached += [uncached(s, ds.crop_style, cfg.seed, ds.vae_cache_clear_each_epoch) for s in disc.samples]
            continue
        # Entries of image-to-video runs also hold the first frame encoded alone. (A clip's frame count and
        # rate are in each entry's key, so changing the video block re-encodes only the clips it changes.)
        first_frame = family.facts.first_frame(cfg.flavour())
        cache = TensorCache(Path(ds.vae_cache_root(cfg.model_family)),
                            {**identity["vae"], "rule": rule.__dict__, "crop_style": ds.crop_style,
                             **({"first_frame": True} if first_frame else {})},
                            _compress(ds.compress_cache, cfg.compress_disk_cache))
        encode = lambda px: family.encode_images(comps, px)  # noqa: E731
        if latents_on_demand(cfg, ds):
            items, bad = planned(disc.samples, cache, ds.crop_style, cfg.seed, ds.id)
            cached, failed = cached + items, failed + bad
            waiting = sum(c.ondemand is not None for c in items)
            if waiting:  # the VAE stays loaded until a start finds every entry written
                on_the_fly = True
                ondemand[ds.id] = _writer(comps, cache, ds, cfg.seed, encode, cfg.vae_batch_size, first_frame,
                                          events)
            events.emit("info", message=f"dataset {ds.id!r}: {waiting} of {len(items)} latents are encoded during "
                        f"training as each is first drawn, and written to {cache.folder} (vae_cache_ondemand)")
            continue
        mine = ranks.shard(disc.samples)
        counted: dict[str, Any] = {}
        fill_latent_cache(mine, cache, ds.crop_style, cfg.seed, encode, cfg.vae_batch_size,
                          on_progress=progress(events, f"latents ({ds.id})", len(mine)), first_frame=first_frame,
                          stats=counted)
        latents_encoded += counted["encoded"]
        black_masks(events, ds.id, counted)
        ranks.barrier()
        done, bad = fill_latent_cache(disc.samples, cache, ds.crop_style, cfg.seed, encode, cfg.vae_batch_size,
                                      first_frame=first_frame)
        cached += done
        failed += bad
    per_process = ranks.gather(latents_encoded)
    files, new = sum(len(d.samples) for d in found), sum(per_process)
    later = sum(c.latent_file is None or c.ondemand is not None for c in cached)  # on the fly, or not written yet
    events.emit("info", message=f"latent cache: {files} files: "
                + counts(len(cached) - later - new, new, len(failed), per_process)
                + (f", {later} encoded during training (vae_cache_disable, vae_cache_clear_each_epoch, "
                   "vae_cache_ondemand)"
                   if later else ""))
    for ds in datasets:
        if ds.vae_cache_clear_each_epoch:
            events.emit("info", message=f"dataset {ds.id!r}: latents encoded during training, with a new random crop "
                                        "each epoch (vae_cache_clear_each_epoch)")
    cached = [c for c in cached if all(text_caches[c.sample.dataset_id].has(k) for k in c.text_keys)]
    for key, why in text_failed:  # an input image that failed to load, or a caption encoded to NaN
        if "\x00" in key:
            failed.append((Path(key.split("\x00")[-1].split("|")[0]), f"input image: {why}"))
        else:
            failed.append((Path(f"caption {key[:60]!r}"), f"text embedding: {why}"))
    for path, reason in failed:
        events.emit("warning", quiet=True, message=f"skipped {path}: {reason}")
    # The VAE stays for on-the-fly encoding; on the CPU only if validation (or CREPA, train/crepa.py) decodes with it.
    if not on_the_fly:
        comps.vae = comps.vae.to("cpu") if validation or decodes(cfg) else None
    if decodes(cfg) and cfg.crepa_drop_vae_encoder:  # every start, once its caches are complete: CREPA only
        drop_vae_encoder(comps.vae, events.emit)  # decodes (what would encode later is refused by the config)
    _free(device)
    return Cached(cached, text_caches, failed, validation, on_the_fly, ondemand)


def black_masks(events: Events, dataset_id: str, counted: dict[str, Any]) -> None:
    if black := counted.get("black_masks"):  # a common slip: masks saved as 0/1 values, or inverted
        events.emit("warning", message=f"dataset {dataset_id!r}: {len(black)} loss mask(s) black over the whole "
                    f"trained crop, e.g. {black[0]}: those samples add nothing to the loss. White (255) marks "
                    "the area to train; a mask saved with values 0 and 1 looks black (scale it to 0 and 255)")


def _writer(comps: Components, cache: TensorCache, ds: Any, seed: int, encode: Any, batch_size: int,
            first_frame: bool, events: Events) -> Any:
    """vae_cache_ondemand: what writes the cache entries of samples drawn in training (data/batches.py), exactly
    as caching before training writes them: the VAE's tiling is off meanwhile (vae_enable_tiling applies after
    caching, so cached latents never depend on it). Returns the files that failed, with the reason."""
    def write(samples: list) -> list[tuple[Path, str]]:
        counted: dict[str, Any] = {}
        with untiled(comps.vae):
            failed = fill_latent_cache(samples, cache, ds.crop_style, seed, encode, batch_size,
                                       first_frame=first_frame, stats=counted)[1]
        black_masks(events, ds.id, counted)
        return failed
    return write


@contextlib.contextmanager
def untiled(vae: Any) -> Iterator[None]:
    tiled = bool(getattr(vae, "use_tiling", False))
    if tiled:
        vae.use_tiling = False
    try:
        yield
    finally:
        if tiled:
            vae.use_tiling = True


def counts(reused: int, new: int, failed: int, per_process: list[int]) -> str:
    """'13 from the cache, 1 newly encoded, 2 failed': parts that add up to the total before them."""
    line = f"{reused} from the cache, {new} newly encoded" + (f" (per process: {per_process})"
                                                               if len(per_process) > 1 else "")
    return line + (f", {failed} failed (skipped: see the data report)" if failed else "")


def _patch_conv(vae) -> int:
    from difftune.models.patch_conv import enable_patch_conv

    return enable_patch_conv(vae)


def progress(events: Events, what: str, total: int):
    """A progress bar for one cache fill (only when there is real work to show)."""
    if not events.console or total < 2:
        return None
    bar = tqdm(total=total, desc=what, unit="item", leave=False, dynamic_ncols=True, file=sys.stderr)

    def advance(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()

    return advance


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
