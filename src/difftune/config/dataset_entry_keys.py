"""SimpleTuner's dataset-entry keys (its DATALOADER.md) that need more than a field of config/datasets.py: spellings,
switched-off blocks, and the checks between an entry and the rest of the run. config/load.py calls each in one line.
The keys difftune does not implement are in config/pending.py (PENDING_DATASET_KEYS, PENDING_VALUES).

- `disable` is SimpleTuner's other spelling of `disabled`, `csv_shorten_filenames` of `shorten_filenames` (type csv);
- `ignore_epochs` on an image, video or eval dataset is dropped with a note (a no-op in SimpleTuner too);
- `metadata_update_interval` (SimpleTuner's seconds between metadata saves while scanning) is dropped, with a note
  at a value other than SimpleTuner's 3600: each dataset is scanned once at start-up, so it changes nothing;
- `preserve_data_backend_cache` and `skip_file_discovery` (SimpleTuner's switches for skipping its scans) are
  dropped, with a note when on: each start reuses the dataset's scan and caches anyway;
- `caption_shuffle` / `grounding` blocks whose switch (`enable` / `enabled`) is off change nothing and are dropped;
  switched on, `caption_shuffle` is read (config/caption_shuffle_keys.py) and `grounding` refused by
  config/pending.py;
- `conditioning_data` as a list of one id is that id, an empty list none; several ids are refused (a dataset pairs
  with one);
- what SimpleTuner's web UI dataset builder leaves on every entry (`BUILDER_LEFTOVERS`: empty audio keys, an empty
  video block on an image entry, its image defaults on a text_embeds or conditioning entry, which SimpleTuner ignores
  there) is dropped at exactly those values; another value is refused as before. `cache_dir_text`, which its
  dataset wizard writes on image entries, is dropped with a note (the text_embeds entry's cache_dir is the folder);
- a text_embeds entry with both `text_encoder_batch_size` and `write_batch_size`: the first sets the batch, a note
  says the second is not used;
- a conditioning entry's `source_dataset_id` must name an image dataset that pairs with it (`conditioning_data`);
- `caption_filter_list` is a text_embeds entry's key (config/caption_filter_keys.py); on another entry it is
  accepted empty and otherwise refused with the fix;
- `video.is_i2v` must agree with the flavour: true with a text-to-video flavour is refused; false with an
  image-to-video flavour is overridden with a note, as SimpleTuner does.
- `vae_cache_clear_each_epoch` (a field; its checks of the entry alone are in config/datasets.py) is refused on a
  dataset with image-to-image input images: the text encoder sees the cropped input image, and its embeddings are
  cached once, at start-up.
- image-to-video validation needs 17 frames or more (`check_i2v_validation`; `validation_video_frames` says how many
  a validation video has).
Import-light: no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ENTRY_ALIASES = {"disable": "disabled", "csv_shorten_filenames": "shorten_filenames"}  # SimpleTuner's spellings
# SimpleTuner's switches for skipping its scans (speed only): key -> its values that mean "off"
SPEED_ONLY = {"preserve_data_backend_cache": (False, None), "skip_file_discovery": ("", None)}
SWITCHED_BLOCKS = {"caption_shuffle": "enable", "grounding": "enabled"}  # block -> its on/off key
# SimpleTuner's web UI builder copies every key of its form into each entry: kind -> {key: the values it leaves}
_AUDIO_LEFTOVERS = {"audio": ({},), "audio_caption_fields": ([],), "lyrics_column": ("",)}
_IMAGE_DEFAULTS = {"probability": (1,), "repeats": (0,)}
BUILDER_LEFTOVERS: dict[str, dict[str, tuple[Any, ...]]] = {
    "image": _AUDIO_LEFTOVERS | {"video": ({},)},
    "eval": _AUDIO_LEFTOVERS | {"video": ({},)},
    "video": _AUDIO_LEFTOVERS,
    "conditioning": _AUDIO_LEFTOVERS | _IMAGE_DEFAULTS | {"video": ({},), "default": (False, None)},
    "text_embeds": _AUDIO_LEFTOVERS | _IMAGE_DEFAULTS | {"crop_style": ("random",), "crop_aspect": ("square",),
                                                        "resolution_type": ("pixel",)},
}


def disabled(entry: dict[str, Any]) -> bool:
    """An entry switched off (`disabled`, or SimpleTuner's `disable`), in any spelling the loader reads as true: it is
    not read (config/load.py), walked (the web UI's ui/confine.py) nor edited (the wizard)."""
    from difftune.config.pending import coerce

    return any(coerce(entry.get(key)) in (True, 1) or str(entry.get(key)).lower() in ("yes", "on")
               for key in ("disabled", "disable"))


def scan_skip_note(key: str, value: Any) -> str:
    """The note of a SPEED_ONLY key set on (an entry's, or config.json's: config/small_keys.py)."""
    return (f"{key} {value!r} changes nothing here: each start reuses the datasets' scans (metadata.json) and their "
            "caches while the files are unchanged, and reads only what changed; remove it")


def prepare(entry: dict[str, Any], where: str, problems: list[str], notes: list[str]) -> dict[str, Any]:
    """The entry with switched-off blocks dropped, a one-id conditioning_data list unwrapped, and an image dataset's
    ignore_epochs dropped with a note (it is in SimpleTuner's own examples, where it is a no-op too)."""
    from difftune.config.caption_filter_keys import prepare_entry
    from difftune.config.pending import coerce

    out = dict(entry)
    prepare_entry(out, where, problems)  # caption_filter_list belongs on the text_embeds entry
    if "ignore_epochs" in out and out.get("dataset_type", "image") in ("image", "video", "eval"):
        del out["ignore_epochs"]
        notes.append(f"{where}: ignore_epochs does nothing (SimpleTuner deprecated it and ignores it as well: "
                     "every dataset's batches count towards an epoch); remove it")
    if "metadata_update_interval" in out:
        interval = coerce(out.pop("metadata_update_interval"))
        if interval not in (None, 3600):
            notes.append(f"{where}: metadata_update_interval {interval!r} changes nothing here (the dataset is "
                         "scanned once at start-up); remove it")
    for key, off in SPEED_ONLY.items():  # SimpleTuner's multidatabackend.json.example carries both
        value = coerce(out.pop(key, None))
        if value not in off:
            notes.append(f"{where}: {scan_skip_note(key, value)}")
    for block, switch in SWITCHED_BLOCKS.items():
        value = out.get(block)
        if isinstance(value, dict) and coerce(value.get(switch, False)) in (False, None):
            del out[block]  # off: SimpleTuner does nothing with the rest of the block either
    kind = out.get("dataset_type", "image")
    for key, left in BUILDER_LEFTOVERS.get(kind if isinstance(kind, str) else "", {}).items():
        if key in out and any(type(out[key]) is type(v) and out[key] == v for v in left):
            del out[key]
    for key in [k for k in ("repeats", "probability") if k in out and kind == "conditioning"]:
        # said in its own words, not as an unknown key: the pairs follow their dataset's draws
        problems.append(f"{where}: {key} {out.pop(key)!r} does nothing on a conditioning entry: its input images are "
                        f"drawn with the images they pair with; set {key} on the dataset whose conditioning_data "
                        "names it, and remove it here")
    if "cache_dir_text" in out and kind in ("image", "video", "eval"):  # SimpleTuner's dataset wizard writes it
        notes.append(f"{where}: cache_dir_text {out.pop('cache_dir_text')!r} is not used on a dataset entry: the text "
                     "cache's folder is the text_embeds entry's cache_dir (or config.json's cache_dir_text); remove it")
    ids = out.get("conditioning_data")
    if isinstance(ids, list):
        if not ids:  # SimpleTuner's web UI writes [] for no pairing
            del out["conditioning_data"]
        elif len(ids) == 1:
            out["conditioning_data"] = ids[0]
        else:  # the first kept, so that the checks of the pairing that follow do not also say it is unset
            out["conditioning_data"] = ids[0]
            problems.append(f"{where}: conditioning_data: {ids!r}: a dataset pairs with one conditioning dataset "
                            "(SimpleTuner's several, drawn at random or stitched, are not implemented yet); name one")
    return out


def notes(where: str, item: Any) -> list[str]:
    """What a validated entry's settings mean that the user may not expect."""
    from difftune.config.datasets import ImageDataset, TextEmbedsDataset

    if isinstance(item, TextEmbedsDataset) and item.text_encoder_batch_size and "write_batch_size" in item.model_fields_set:
        return [f"{where}: write_batch_size is not used: text_encoder_batch_size sets the captions per text-encoder "
                "pass, and each embedding is written as its own file; remove write_batch_size"]
    if isinstance(item, ImageDataset):
        off = [f"{where}: {item._clear_each_epoch_off}"] if item._clear_each_epoch_off else []
        if item.type == "aws" and item.cache_dir_vae:  # SimpleTuner writes the latents into the bucket there
            off.append(f"{where}: cache_dir_vae {item.cache_dir_vae!r} is a folder on this machine here (in "
                       "SimpleTuner, a prefix inside the bucket): the latents are cached locally, not in S3")
        return (off + _crop_notes(where, item) + _upscale_notes(where, item) + _pixel_resolution_notes(where, item)
                + _trigger_notes(where, item) + _shuffle_notes(where, item) + _unread_caption_notes(where, item))
    return []


def _unread_caption_notes(where: str, item: Any) -> list[str]:
    """Caption settings the entry's caption_strategy does not read."""
    out = []
    if item.caption_strategy == "instanceprompt" and item.prepend_instance_prompt:
        out.append(f"{where}: prepend_instance_prompt not used: caption_strategy 'instanceprompt' trains "
                   "instance_prompt alone already; remove it")
    if item.disable_multiline_split and item.caption_strategy == "huggingface":
        out.append(f"{where}: disable_multiline_split not used: each caption of a huggingface row (a list cell, or "
                   "each caption_column) is a caption of its own, and a newline inside one is a space")
    if item.parquet is not None and item.caption_strategy != "parquet":
        out.append(f"{where}: the parquet block is not read: caption_strategy is {item.caption_strategy!r}; set "
                   "caption_strategy 'parquet' to caption from its table, or remove the block")
    return out


def _upscale_notes(where: str, item: Any) -> list[str]:
    """max_upscale_threshold limits the pick from crop_aspect_buckets: without one it limits nothing."""
    if item.max_upscale_threshold is None or (item.crop and item.crop_aspect in ("closest", "random")):
        return []
    how = "crop is false" if not item.crop else f"crop_aspect is {item.crop_aspect!r}"
    return [f"{where}: max_upscale_threshold not used: it limits the pick from crop_aspect_buckets (crop_aspect "
            f"'closest' or 'random'), and {how}; use minimum_image_size to leave small images out"]


def _shuffle_notes(where: str, item: Any) -> list[str]:
    """caption_shuffle where no caption of the data is trained: the instance prompt alone has no tags to shuffle."""
    if item.caption_shuffle is None or not item.caption_shuffle.enable:
        return []
    why = ("caption_strategy 'instanceprompt'" if item.caption_strategy == "instanceprompt" else
           "only_instance_prompt" if item.only_instance_prompt else None)
    return [] if why is None else [f"{where}: caption_shuffle not used: with {why} every sample is trained with "
                                   "instance_prompt alone, which is not shuffled; remove caption_shuffle"]


def _pixel_resolution_notes(where: str, item: Any) -> list[str]:
    """A megapixel-sized resolution (1.0) under a pixel resolution_type: the usual slip when switching from 'area',
    which trains at the smallest buckets instead of failing. Noted below 16 or with a fraction: megapixel sizes lie
    there (SimpleTuner's area values go up to a few), while tiny test models train at 32 pixels on purpose."""
    if item.resolution_type in ("pixel", "pixel_area") and (item.resolution < 16 or item.resolution % 1):
        tiny = " (images shrink to the smallest buckets, a few pixels a side)" if item.resolution < 16 else ""
        return [f"{where}: resolution {item.resolution:g} with resolution_type {item.resolution_type!r} is taken as "
                f"{item.resolution:g} pixels{tiny}; did you mean resolution_type 'area' (megapixels)? Pixel "
                "resolutions are whole numbers such as 512 or 1024"]
    return []


def _trigger_notes(where: str, item: Any) -> list[str]:
    """instance_prompt beside captions read from the data, without prepend_instance_prompt or only_instance_prompt:
    the trigger word is in no caption (a forgotten prepend_instance_prompt), only on the model card."""
    if (not item.instance_prompt or item.caption_strategy == "instanceprompt" or item.prepend_instance_prompt
            or item.only_instance_prompt):
        return []
    return [f"{where}: instance_prompt {item.instance_prompt!r} is in no caption: caption_strategy "
            f"{item.caption_strategy!r} trains the captions as they are, and the model card only names it as the "
            "trigger; set prepend_instance_prompt to true to put it before every caption, or remove it"]


def _crop_notes(where: str, item: Any) -> list[str]:
    """Crop settings the entry's crop leaves unused (set on the entry or by the config-level default). Notes, not
    errors: SimpleTuner's own examples carry crop: false with crop_style and crop_aspect. crop_style is never
    unused: without crop it still places the trim of the resized image to its bucket."""
    given = item.model_fields_set
    if not item.crop:
        # SimpleTuner's defaults ('square', []), which its tools and examples write on every entry, are not said
        unused = [k for k in ("crop_aspect", "crop_aspect_buckets") if k in given and getattr(item, k) not in
                  (None, "square", [])]
        return [f"{where}: {' and '.join(unused)} not used: crop is false, so each image keeps its own aspect; remove "
                f"{'them' if len(unused) > 1 else 'it'} or set crop to true"] if unused else []
    if item.crop_aspect_buckets and item.crop_aspect in ("square", "preserve"):
        return [f"{where}: crop_aspect_buckets not used: crop_aspect {item.crop_aspect!r} does not pick from them "
                "(only 'closest' and 'random' do); remove crop_aspect_buckets or change crop_aspect"]
    return []


def check_sources(path: Path, images: list[Any], conditioning: dict[str, Any], problems: list[str]) -> None:
    """source_dataset_id of each enabled conditioning entry names an image dataset pairing with it."""
    for ident, entry in conditioning.items():
        source = entry.source_dataset_id
        if source is None:
            continue
        ds = next((d for d in images if d.id == source), None)
        if ds is None:
            problems.append(f"{path}: dataset {ident!r}: source_dataset_id {source!r} names no enabled image or video "
                            "dataset; fix the name or remove it")
        elif ds.conditioning_data != ident:
            problems.append(f"{path}: dataset {ident!r}: source_dataset_id {source!r}: dataset {source!r} does not "
                            f"pair with this one; set its conditioning_data to {ident!r} (pairs are made by "
                            "conditioning_data) or remove source_dataset_id")


def check_video(train: Any, plan: Any, path: Path, problems: list[str]) -> None:
    """video.is_i2v against the flavour (FAMILY_FACTS: which flavours train image-to-video)."""
    from difftune.models.registry import FAMILY_FACTS

    facts = FAMILY_FACTS[train.model_family]
    flavour = train.flavour()
    for ds in plan.discovered():
        wanted = ds.video.is_i2v if ds.video is not None else None
        if wanted is True and not facts.first_frame(flavour):
            choices = ", ".join(sorted(facts.first_frame_flavours)) or f"none for {train.model_family}"
            problems.append(f"{path}: dataset {ds.id!r}: video.is_i2v: true asks for image-to-video training, which "
                            f"the flavour decides here and {flavour!r} is text-to-video; pick an image-to-video "
                            f"flavour ({choices}) or set is_i2v to false")
        elif wanted is False and facts.first_frame(flavour):
            plan.notes.append(f"{path}: dataset {ds.id!r}: video.is_i2v false is overridden: flavour {flavour!r} "
                              "trains every clip image-to-video (SimpleTuner forces is_i2v for it too); remove is_i2v")


def check_each_epoch(train: Any, plan: Any, path: Path, problems: list[str]) -> None:
    """Draws made again each epoch. vae_cache_clear_each_epoch against the dataset's input images (image-to-image):
    their crop follows the target's, and the text encoder, which sees the input image, runs once before training
    (data/latents.text_key). SimpleTuner's aspect_bucket_disable_rebuild false (its default): a new random crop aspect
    each epoch, which difftune does not draw; it changes nothing without a crop_aspect 'random' dataset."""
    randoms = [ds.id for ds in plan.images if ds.crop and ds.crop_aspect == "random"]
    if train.aspect_bucket_disable_rebuild is False and randoms:
        problems.append(f"{path}: dataset {randoms[0]!r}: aspect_bucket_disable_rebuild false (a new random crop "
                        "aspect every epoch) is not implemented yet: difftune draws each image's random aspect once, "
                        "as with aspect_bucket_disable_rebuild true; set it to true or remove it")
    for ds in plan.images:
        if ds.vae_cache_clear_each_epoch and plan.conditioning_dir(ds) is not None:
            problems.append(f"{path}: dataset {ds.id!r}: vae_cache_clear_each_epoch draws a new crop each epoch, but "
                            f"its input images (conditioning_data {ds.conditioning_data!r}) are also seen by the text "
                            "encoder, whose embeddings are cached once per crop before training; remove "
                            "vae_cache_clear_each_epoch (its crop is then drawn once per image and seed)")


def validation_video_frames(train: Any, plan: Any) -> int:
    """validation_num_video_frames, else the first video dataset's num_frames (61 without one)."""
    if train.validation_num_video_frames is not None:
        return train.validation_num_video_frames
    return next((ds.video.num_frames for ds in plan.images if ds.video is not None), 61)


def validation_video_fps(train: Any, plan: Any) -> float:
    """The frame rate validation videos are written at: the config's frame_rate, else the first video dataset's
    video.frame_rate (the rate its clips trained at; a sample written at 24 fps from 12 fps clips played twice as
    fast), else the family's default."""
    if train.frame_rate is not None:
        return train.frame_rate
    rates = (ds.video.frame_rate for ds in plan.images if ds.video is not None and ds.video.frame_rate is not None)
    return next(rates, train.video_fps())


def video_rate_notes(train: Any, plan: Any) -> list[str]:
    """A note for each video dataset whose clips train at another rate than validation videos are written at
    (`validation_video_fps`): a sample then plays faster or slower than the motion the run learned."""
    if not train.validation_prompts():
        return []
    written = validation_video_fps(train, plan)
    why = "the config's frame_rate" if train.frame_rate is not None else "the first video dataset's video.frame_rate"
    notes = []
    for ds in plan.images:
        rate = ds.video.frame_rate if ds.video is not None and ds.video.frame_rate is not None else written
        if ds.video is not None and abs(rate / written - 1) >= 0.005:
            notes.append(f"dataset {ds.id!r}: its clips train at {rate:g} fps (video.frame_rate) and validation "
                         f"videos are written at {written:g} fps ({why}), so they play {written / rate:.3g}x as fast as "
                         f"the clips move; set frame_rate to {rate:g} in config.json unless that is meant")
    return notes


I2V_MIN_FRAMES = 17  # image-to-video validation's least frame count (the wizard offers it too)


def check_i2v_validation(train: Any, plan: Any, where: str, problems: list[str]) -> None:
    """The stock I2V pipeline renormalizes the first 4 latent frames against the next ones: below 17
    frames there are none, and the video comes out as NaN. Caught here, before anything loads."""
    from difftune.models.registry import FAMILY_FACTS

    if not FAMILY_FACTS[train.model_family].first_frame(train.flavour()):
        return
    if not (train.validation_prompt or train.user_prompt_library or train.validation_prompt_library):
        return
    frames = validation_video_frames(train, plan)
    if frames < I2V_MIN_FRAMES:
        given = "" if train.validation_num_video_frames else " (from the first video dataset's num_frames)"
        problems.append(f"{where}: validation_num_video_frames: {frames}{given} is too few for image-to-video "
                        "validation, which needs at least 17 (the stock I2V pipeline renormalizes the first 4 "
                        "latent frames against the next ones); set validation_num_video_frames to 17 or more")
