"""Where the model loads from, beyond `pretrained_model_name_or_path` (SimpleTuner's names): a transformer from
another folder, hub repository or single `.safetensors` file, a VAE from elsewhere, a hub `revision` and a weight
`variant`. The fields, mixed into TrainConfig (import-light: no torch), and `check_model_sources`, which
config/load.py runs with the other path checks, so a wrong path fails before any model loads.
models/sources.py loads them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, field_validator

from difftune.config.fields import field
from difftune.models.registry import FAMILY_FACTS
from difftune.models.sources import SINGLE_FILE_SUFFIX, ModelSource

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")
TRANSFORMER = "pretrained_transformer_model_name_or_path"
SUBFOLDER = "pretrained_transformer_subfolder"
VAE = "pretrained_vae_model_name_or_path"


class ModelSourceKeys(BaseModel):
    pretrained_transformer_model_name_or_path: str | None = field(
        None, "Transformer to train from somewhere other than pretrained_model_name_or_path (a fine-tune of the same "
        "model): a hub id or local folder in diffusers layout (read from pretrained_transformer_subfolder), or, for "
        "Lumina2, one .safetensors file in the original or ComfyUI key layout (diffusers' from_single_file converts "
        "it; its config comes from the main model's transformer/). The text encoders, tokenizers, scheduler and VAE "
        "still come from pretrained_model_name_or_path. The saved LoRA is an adapter for this transformer (the model "
        "card names it as the base); a full fine-tune saves it in diffusers layout. Kandinsky 5 takes no single "
        "file (diffusers cannot convert one).", "model", advanced=True,
    )
    pretrained_transformer_subfolder: str | None = field(
        "transformer", "Subfolder of pretrained_transformer_model_name_or_path (else of pretrained_model_name_or_path) "
        "that holds the transformer's config.json and weights. 'none' or empty: the folder itself (a repository "
        "that holds only the transformer); this applies to pretrained_transformer_model_name_or_path only, since a "
        "pipeline folder keeps its transformer in a subfolder.", "model", advanced=True,
    )
    pretrained_vae_model_name_or_path: str | None = field(
        None, "VAE from somewhere other than pretrained_model_name_or_path (a fixed VAE, in diffusers layout): a hub "
        "id or local folder, read from its vae/ subfolder when it has one (a whole pipeline), else from the folder "
        "itself. vae_dtype applies to it. Latents are cached apart from the main VAE's.", "model", advanced=True,
    )
    revision: str | None = field(
        None, "Hub revision (branch, tag or commit) of pretrained_model_name_or_path, used for every component loaded "
        "from it, and for pretrained_transformer_model_name_or_path when that is a hub id. Needs a hub id: a local "
        "folder has no revisions.", "model", advanced=True,
    )
    variant: str | None = field(
        None, "Variant of the weights to load, such as 'fp16' (diffusion_pytorch_model.fp16.safetensors, "
        "model.fp16.safetensors), for every weight loaded with from_pretrained: the main model's, the transformer's "
        "and the VAE's from elsewhere. The weights are then cast to base_model_default_dtype as usual. A model "
        "without that variant's files is an error naming the component.", "model", advanced=True,
    )

    @field_validator(TRANSFORMER, VAE, "revision", "variant", mode="before")
    @classmethod
    def _empty_source(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator(SUBFOLDER, mode="before")
    @classmethod
    def _subfolder(cls, value: Any) -> Any:
        """SimpleTuner writes 'none' (or null) for "the folder itself"."""
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "")):
            return None
        return value.strip().strip("/") if isinstance(value, str) else value

    def model_sources(self, main: str) -> ModelSource:
        """Where each part loads from; `main`: the resolved pretrained_model_name_or_path (a tiny model's folder)."""
        own = self.pretrained_transformer_model_name_or_path
        subfolder = self.pretrained_transformer_subfolder if own is not None else \
            (self.pretrained_transformer_subfolder or "transformer")  # a pipeline keeps its transformer in one
        local = {name: str(Path(v).expanduser()) if v is not None and Path(v).expanduser().exists() else v
                 for name, v in (("transformer", own), ("vae", self.pretrained_vae_model_name_or_path))}
        return ModelSource(model=main, transformer=local["transformer"], transformer_subfolder=subfolder,
                           vae=local["vae"], revision=self.revision, variant=self.variant)


def check_model_sources(train: Any, where_of: Callable[[str], str], problems: list[str]) -> None:
    """Everything about these keys that can be known before a model loads."""
    _check_pipeline_class(train, where_of, problems)
    own, subfolder = train.pretrained_transformer_model_name_or_path, train.pretrained_transformer_subfolder
    if own is not None:
        _check_transformer(train, own, subfolder, where_of, problems)
    vae = train.pretrained_vae_model_name_or_path
    if vae is not None:
        local = Path(vae).expanduser()
        if local.is_file():
            problems.append(f"{where_of(VAE)}: {VAE}: {vae!r} is a file; give a folder or hub id of a diffusers VAE "
                            "(config.json and weights, or a pipeline with vae/)")
        elif local.is_dir() and not ((local / "vae" / "config.json").is_file() or (local / "config.json").is_file()):
            problems.append(f"{where_of(VAE)}: {VAE}: {vae!r} has neither vae/config.json nor config.json; give the "
                            "folder of a diffusers VAE or of a pipeline that has one")
        elif not local.exists():
            _check_hub_id(VAE, vae, where_of, problems)
    if train.revision is not None:
        main = train.pretrained_model_name_or_path
        if main is None and not FAMILY_FACTS[train.model_family].flavours.get(train.flavour()):
            problems.append(f"{where_of('revision')}: revision {train.revision!r}: the tiny model is built locally and "
                            "has no revisions; remove revision")
        elif main is not None and Path(main).expanduser().exists():
            problems.append(f"{where_of('revision')}: revision {train.revision!r}: pretrained_model_name_or_path "
                            f"{main!r} is a local folder, which has no revisions (it would be ignored); check out "
                            "the revision into that folder and remove revision, or give the hub id")


def _check_transformer(train: Any, own: str, subfolder: str | None, where_of: Callable[[str], str],
                       problems: list[str]) -> None:
    local = Path(own).expanduser()
    single = own.lower().endswith(SINGLE_FILE_SUFFIX)
    where = where_of(TRANSFORMER)
    if single and not FAMILY_FACTS[train.model_family].single_file_transformer:
        problems.append(f"{where}: {TRANSFORMER}: {own!r} is a single file, but diffusers cannot load a "
                        f"{train.model_family} transformer from one; give a diffusers-layout folder or hub id "
                        "(config.json and weights, in pretrained_transformer_subfolder)")
        return
    if local.is_file() and not single:
        problems.append(f"{where}: {TRANSFORMER}: {own!r} is a file but not a .safetensors one; give a .safetensors "
                        "checkpoint, or a diffusers-layout folder or hub id")
    elif single and not local.is_file():
        problems.append(f"{where}: {TRANSFORMER}: the file {own!r} does not exist; fix the path (a single file must "
                        "be local)")
    elif single:
        if subfolder not in (None, "transformer"):
            problems.append(f"{where_of(SUBFOLDER)}: {SUBFOLDER} {subfolder!r} does not apply to a single file "
                            f"({own!r}); remove it")
        if train.fsdp_enable and train.fsdp_cpu_ram_efficient_loading:
            problems.append(f"{where}: {TRANSFORMER}: a single file is read whole by every process, which "
                            "fsdp_cpu_ram_efficient_loading is there to avoid; set it false, or give a "
                            "diffusers-layout folder")
    elif local.is_dir():
        config = (local / subfolder if subfolder else local) / "config.json"
        if not config.is_file():
            inside = sorted(p.name for p in local.iterdir() if (p / "config.json").is_file())
            fix = (f"set {SUBFOLDER} to one of {inside}" if inside else
                   f"set {SUBFOLDER} to 'none' when the folder itself holds config.json") if subfolder else \
                f"set {SUBFOLDER} to the subfolder that holds it (such as 'transformer')"
            problems.append(f"{where_of(SUBFOLDER) if subfolder else where}: {TRANSFORMER}: {config} does not exist; "
                            f"{fix}")
    else:
        _check_hub_id(TRANSFORMER, own, where_of, problems)


def _check_hub_id(key: str, value: str, where_of: Callable[[str], str], problems: list[str]) -> None:
    if value.startswith(("/", ".", "~")) or "\\" in value:
        problems.append(f"{where_of(key)}: {key}: the folder {value!r} does not exist; fix the path, or give a hub "
                        "id such as owner/name")
    elif not _HUB_ID.fullmatch(value):
        problems.append(f"{where_of(key)}: {key}: {value!r} is neither an existing folder nor a hub id (owner/name, "
                        "one slash); fix the path")


def _check_pipeline_class(train: Any, where_of: Callable[[str], str], problems: list[str]) -> None:
    """A local pretrained_model_name_or_path's model_index.json names its pipeline: one of another family, or of
    the family's other kind (an image-to-video folder with a text-to-video flavour), is refused now rather than
    after loading."""
    from difftune.config.reporting_keys import PIPELINES

    source = train.pretrained_model_name_or_path
    index = Path(source).expanduser() / "model_index.json" if source else None
    if index is None or not index.is_file():
        return
    try:
        name = json.loads(index.read_text(encoding="utf-8-sig")).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return  # loading reports a damaged model_index.json with the library's own words
    text_to, image_to = PIPELINES[train.model_family]
    wants = image_to if FAMILY_FACTS[train.model_family].takes_input_image(train.flavour()) else text_to
    if not isinstance(name, str) or name == wants:
        return
    key = "pretrained_model_name_or_path"
    if name in (text_to, image_to):
        kind = "image-conditioned (i2i/i2v)" if name == image_to else "text-only"
        problems.append(f"{where_of(key)}: {key}: {source!r} holds a {name} ({kind}) model, but model_flavour "
                        f"{train.flavour()!r} trains {wants}; set model_flavour to a matching flavour of "
                        f"{train.model_family}")
    else:  # only another family's pipeline: an older name of this family's (Lumina2Text2ImgPipeline) still loads
        family = next((f for f, names in PIPELINES.items() if name in names), None)
        if family is not None:
            problems.append(f"{where_of(key)}: {key}: {source!r} holds a {name}, a {family} model, not a "
                            f"{train.model_family} one; set model_family to {family!r}, or give a "
                            f"{train.model_family} folder")
