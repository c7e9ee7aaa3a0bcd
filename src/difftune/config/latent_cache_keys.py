"""`vae_cache_ondemand` (SimpleTuner's key, config-level for every training dataset, or on a dataset entry): latents
are encoded during training, the first time each item is drawn, and written to the dataset's latent cache (the same
entries, keys and fingerprint as caching before training), instead of every file being encoded before the first
step. Training starts as soon as the text embeddings are cached; the first epoch pays the encoding, later epochs and
later runs read the cache. An entry that already exists is read as it is, so a resumed run trains on exactly the
latents the interrupted one wrote. The VAE stays on the accelerator during training (`difftune plan` counts it).

Checked here, before any model loads: not with vae_cache_disable (which writes nothing) or
vae_cache_clear_each_epoch (a new crop each epoch: nothing to keep) on the same level, nor on an eval dataset
(held out: cached before training, measured on every item each time), nor with crepa_drop_vae_encoder. A
config-level vae_cache_ondemand leaves the datasets that encode on the fly, and eval datasets, as they are.
`difftune cache` fills every dataset's latents at once whatever the key says (its whole purpose). Mixed into
TrainConfig; import-light: no torch. The dataset entry's field is in config/datasets.py; train/plan.py
`latents_on_demand` says which datasets encode this way.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator

from difftune.config.fields import field

ABOUT = ("Encode latents during training, the first time each image or clip is drawn, and write them to the latent "
         "cache, instead of encoding every file before the first step: training starts once the captions are "
         "encoded, the first epoch is slower, later epochs and runs read the cache. The VAE stays on the "
         "accelerator while training.")


class LatentCacheKeys(BaseModel):
    vae_cache_ondemand: bool = field(
        False, ABOUT + " For every training dataset that does not set its own (datasets with vae_cache_disable or "
        "vae_cache_clear_each_epoch, and eval datasets, are left as they are). `difftune cache` still encodes "
        "everything at once.", "data", advanced=True,
    )

    @model_validator(mode="after")
    def _ondemand_checks(self) -> LatentCacheKeys:
        ondemand_checks(self)
        return self


def ondemand_dataset_problems(cfg: Any, datasets: list[Any]) -> list[str]:
    """A dataset's own vae_cache_ondemand against the config's vae_cache_disable (config/load.py, before any model
    loads): that encodes every dataset on the fly and writes nothing, so the dataset's setting could not act."""
    if not getattr(cfg, "vae_cache_disable", False):
        return []
    return [f"dataset {ds.id!r}: vae_cache_ondemand, but the config's vae_cache_disable encodes every dataset on "
            "the fly and writes no latents; remove one of them" for ds in datasets if ds.vae_cache_ondemand]


def ondemand_checks(cfg: Any) -> None:
    if not cfg.vae_cache_ondemand:
        return
    if getattr(cfg, "vae_cache_disable", False):
        raise ValueError("vae_cache_ondemand with vae_cache_disable: vae_cache_disable encodes on the fly and writes "
                         "no latents, vae_cache_ondemand writes each one as it is first encoded; keep one")
    if getattr(cfg, "crepa_enabled", False) and getattr(cfg, "crepa_drop_vae_encoder", False) \
            and not getattr(cfg, "crepa_use_backbone_features", False):
        raise ValueError("crepa_drop_vae_encoder with vae_cache_ondemand: latents encoded during training need the "
                         "VAE's encoder, which crepa_drop_vae_encoder frees after caching; turn one of them off")
