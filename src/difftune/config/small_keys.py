"""SimpleTuner's smaller config keys: `tokenizer_max_length` (the prompt length the text encoder sees),
`aspect_bucket_alignment` (the bucket grid; train/plan.size_rules) and `aspect_bucket_disable_rebuild` (one random
crop aspect per image: config/load.py refuses false beside a dataset with crop_aspect 'random'),
`model_card_note` (a note on the model card), the config-level `text_encoder_batch_size` (the default of every
text_embeds entry), `allow_dataset_oversubscription` (small datasets' repeats raised to one optimizer step), and
SimpleTuner's data-pipeline knobs that change no result (`PIPELINE_KNOBS`: accepted at any value, with a note).
Mixed into TrainConfig; import-light: no torch.

Where they act: models/<family>.py encode prompts and sample at `Components.text_length`, which train/setup.py sets
after checking the loaded model's own bound (`Family.text_length_limit`); memory_plan/predict.py `text_tokens`;
train/model_card.py; config/load.py hands text_encoder_batch_size to the text_embeds entries; data/repeats.py
raises the repeats (train/setup.build_data), data/report.py says so.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from difftune.config.dataset_entry_keys import SPEED_ONLY, scan_skip_note
from difftune.config.fields import field
from difftune.models.registry import FAMILY_FACTS


class SmallKeys(BaseModel):
    model_config = ConfigDict(protected_namespaces=())  # model_card_* keys: pydantic<2.10 warns on "model_"
    tokenizer_max_length: int | None = field(
        None, "The prompt length in tokens the text encoder sees: the stock pipeline's max_sequence_length, used to "
        "encode the captions for the text cache and the validation prompts, and given to the pipeline when "
        "sampling (longer prompts are cut, as the pipeline cuts them). Empty: the pipeline's default, kept from "
        "before (Lumina2 256, counting its system prompt; Kandinsky 5 512 for text alone, 1024 for image-to-image, "
        "where the input image's tokens count too). At most 512 for Lumina2 (its pipeline's bound; the real "
        "model's caption positions stop at 299, checked once the model loads) and 1024 for Kandinsky 5. A changed "
        "length encodes the captions again (it is part of the text cache's fingerprint) and sets the text tokens "
        "of the memory plan. SimpleTuner's key; its defaults differ per model, difftune keeps each pipeline's.",
        "model", gt=0, advanced=True,
    )
    model_card_note: str | None = field(
        None, "A note placed near the top of the model card (README.md) written for push_to_hub: free text "
        "(Markdown), under the card's title. Empty: no note.", "output", advanced=True,
    )
    text_encoder_batch_size: int | None = field(
        None, "Default text_encoder_batch_size of every text_embeds entry that does not set its own: captions per "
        "text-encoder pass while the text cache fills. Also the batch of the default text cache (no text_embeds "
        "entry), else 32. Empty: each entry's own (its write_batch_size).", "memory", gt=0, advanced=True,
    )
    cache_dir_text: str | None = field(
        None, "SimpleTuner's config-level folder of the text cache: the folder of the default text cache, used when "
        "the dataset list has no text_embeds entry (an entry's cache_dir sets its own; this one is then unused, "
        "with a note). Empty: cache/text/<model_family>.", "data", advanced=True,
    )
    allow_dataset_oversubscription: bool = field(
        False, "Raise the repeats of each dataset too small for one optimizer step, instead of pruning its buckets: "
        "a dataset with an aspect bucket holding fewer images (with repeats) than train_batch_size x processes x "
        "gradient_accumulation_steps gets the smallest repeats with which every bucket holds that many. Only "
        "datasets whose entry leaves repeats out are raised (an entry that sets it, even to 0, keeps it, as in "
        "SimpleTuner); the data report names each raised dataset, from which repeats to which.", "data",
        advanced=True,
    )

    # SimpleTuner's own data pipeline (PIPELINE_KNOBS): accepted whatever the value, since none changes a result
    write_batch_size: int | None = field(
        None, "SimpleTuner's batch of cache writes (128 there). Changes nothing here: each cache entry is written as "
        "its own file, and the captions per text-encoder pass are a text_embeds entry's write_batch_size or "
        "text_encoder_batch_size. Accepted for SimpleTuner configs, with a note.", "data", gt=0, advanced=True,
    )
    max_workers: int | None = field(
        None, "SimpleTuner's worker threads of its data pipeline (32 there). Changes nothing here (difftune has no "
        "such setting). Accepted for SimpleTuner configs, with a note.", "data", gt=0, advanced=True,
    )
    metadata_update_interval: float | None = field(
        None, "Seconds between SimpleTuner's saves of its bucket metadata while scanning (3600 there). Changes "
        "nothing here: the datasets are scanned once at start-up. Accepted for SimpleTuner configs, with a note.",
        "data", ge=0, advanced=True,
    )

    aspect_bucket_rounding: int | None = field(
        None, "SimpleTuner's decimal places of the aspect ratios it groups images by (2 in its config.json.example). "
        "Changes nothing here: each image's bucket is a size in pixels on the family's 16-pixel grid, chosen from "
        "the image's own size. Accepted for SimpleTuner configs, with a note.", "data", ge=0, advanced=True,
    )

    aspect_bucket_alignment: int | None = field(
        None, "Bucket sides are multiples of this many pixels: a multiple of the family's grid (16 for Lumina2 and "
        "Kandinsky 5: the VAE's factor times the patch size), such as 32 or 64 for fewer, coarser buckets (more is "
        "cropped to reach them). Empty: 16. (SimpleTuner's default is 64.)", "data", gt=0, advanced=True,
    )
    aspect_bucket_disable_rebuild: bool | None = field(
        None, "SimpleTuner's switch between a new random crop aspect each epoch (false) and one per image (true) for "
        "datasets with crop_aspect 'random'. difftune draws one per image (true); false is accepted where no "
        "dataset has crop_aspect 'random', and refused where one has (not implemented yet).", "data",
        advanced=True,
    )
    preserve_data_backend_cache: bool | None = field(
        None, "SimpleTuner's switch to skip rescanning the datasets. Changes nothing here: each start reuses the "
        "datasets' scans (metadata.json) and caches while the files are unchanged and reads only what changed. "
        "Accepted for SimpleTuner configs (config-level or on an entry), with a note.", "data", advanced=True,
    )
    skip_file_discovery: str | list[str] | None = field(
        None, "SimpleTuner's list of discovery stages to skip (vae, aspect, text, metadata). Changes nothing here, as "
        "preserve_data_backend_cache. Accepted for SimpleTuner configs (config-level or on an entry), with a note.",
        "data", advanced=True,
    )

    @model_validator(mode="after")
    def _text_length_bound(self) -> Any:
        facts = FAMILY_FACTS.get(getattr(self, "model_family", ""))
        step = self.aspect_bucket_alignment
        if facts is not None and step is not None and step % facts.pixel_multiple:
            raise ValueError(f"aspect_bucket_alignment {step}: bucket sides must be multiples of {facts.pixel_multiple} "
                             f"for {facts.name} (the VAE's factor times the patch size); use a multiple of "
                             f"{facts.pixel_multiple} ({facts.pixel_multiple}, {2 * facts.pixel_multiple}, "
                             f"{4 * facts.pixel_multiple}), or remove it")
        n = self.tokenizer_max_length
        if facts is not None and n is not None and n > facts.max_text_length:
            raise ValueError(f"tokenizer_max_length {n} is more than {facts.name}'s pipeline takes (at most "
                             f"{facts.max_text_length} tokens); set it to {facts.max_text_length} or less, or remove it "
                             "for the pipeline's default")
        return self


# key -> SimpleTuner's default (no note at it: the config says what SimpleTuner does anyway)
PIPELINE_KNOBS = {"write_batch_size": 128, "max_workers": 32, "metadata_update_interval": 3600}


def pipeline_notes(cfg: Any) -> list[str]:
    """A note per data-pipeline knob set to another value than SimpleTuner's default: it changes nothing here."""
    notes = [f"{key} {getattr(cfg, key):g} changes nothing here (SimpleTuner's own data pipeline; difftune's results "
             "do not depend on it); remove it" for key, default in PIPELINE_KNOBS.items()
             if getattr(cfg, key) not in (None, default)]
    notes += [scan_skip_note(key, getattr(cfg, key)) for key, off in SPEED_ONLY.items()  # as on a dataset entry
              if getattr(cfg, key) not in (*off, [])]
    if cfg.aspect_bucket_rounding is not None:  # in SimpleTuner's config.json.example and most configs from it
        notes.append(f"aspect_bucket_rounding {cfg.aspect_bucket_rounding} not used: difftune buckets each image by "
                     "its size in pixels on a 16-pixel grid, not by a rounded aspect ratio (the data report shows "
                     "the buckets); remove it")
    return notes
