"""Where each part of the model loads from (config/model_source_keys.py): the main model
(`pretrained_model_name_or_path`: text encoders, tokenizers, scheduler, model_index.json and, by default, the
transformer and the VAE), a transformer from elsewhere (a diffusers-layout folder or hub repository, or one
`.safetensors` file in the original/ComfyUI key layout, which diffusers' `from_single_file` converts), a VAE from
elsewhere, and the hub `revision` and weight `variant` of the main model.

`ModelSource` is plain data (no torch at import): the config builds it, the families load from it. A family's
`load` takes a `ModelSource` or a plain source string (everything from one place, as before).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from difftune.models.hub import ComponentError

SINGLE_FILE_SUFFIX = ".safetensors"
COMFYUI_PREFIX = "model.diffusion_model."  # the transformer's keys in ComfyUI's checkpoint files


@dataclass(frozen=True)
class ModelSource:
    model: str  # pretrained_model_name_or_path (or the flavour's hub id, or the tiny model's folder)
    transformer: str | None = None  # pretrained_transformer_model_name_or_path
    transformer_subfolder: str | None = "transformer"  # pretrained_transformer_subfolder; None: the folder itself
    vae: str | None = None  # pretrained_vae_model_name_or_path
    revision: str | None = None  # of the main model (and of the transformer's hub repository)
    variant: str | None = None  # weight file variant: diffusion_pytorch_model.<variant>.safetensors

    @classmethod
    def of(cls, source: str | ModelSource) -> ModelSource:
        return source if isinstance(source, ModelSource) else cls(model=str(source))

    def single_file(self) -> bool:
        """The transformer is one .safetensors file (loaded with from_single_file)."""
        return self.transformer is not None and self.transformer.lower().endswith(SINGLE_FILE_SUFFIX)

    def transformer_identity(self) -> dict[str, Any]:
        """What decides the transformer's starting weights (a resumed run compares it with its checkpoint's)."""
        return {"model": self.model, "transformer": self.transformer, "subfolder": self.transformer_subfolder,
                "revision": self.revision, "variant": self.variant}

    def transformer_label(self) -> str:
        """Where the transformer comes from, for messages and the model card."""
        if self.transformer is None and self.transformer_subfolder == "transformer":
            return self.model
        where = self.transformer or self.model
        if self.single_file():
            return where
        return f"{where} ({self.transformer_subfolder + '/' if self.transformer_subfolder else 'the folder itself'})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_local(source: str) -> bool:
    return Path(source).expanduser().exists()


def hub_kwargs(where: ModelSource, source: str, weights: bool = True) -> dict[str, Any]:
    """revision (hub ids only: the config refuses one with a local main model) and variant (weight files only) for
    a from_pretrained of `source`."""
    kwargs: dict[str, Any] = {}
    if where.revision is not None and not is_local(source):
        kwargs["revision"] = where.revision
    if weights and where.variant is not None:
        kwargs["variant"] = where.variant
    return kwargs


class SourceError(ComponentError):
    """A model part that cannot be loaded from where the config says (names the key and the fix; exit 2)."""


def loading(what: str, key: str, where: ModelSource, call: Any) -> Any:
    """`call()`, with diffusers'/transformers' missing-file errors turned into one that names the config key. A
    missing variant file reads, in diffusers, as a missing `.bin` in the parent folder: say what is missing."""
    try:
        return call()
    except OSError as e:
        if where.variant is not None and f".{where.variant}." in str(e):
            raise SourceError(f"variant {where.variant!r}: {what} has no {where.variant} weight file (such as "
                              f"diffusion_pytorch_model.{where.variant}.safetensors or model.{where.variant}"
                              f".safetensors); remove variant, or give a model saved with that variant ({e})") from e
        raise SourceError(f"{key}: {what} cannot be loaded: {e}") from e


def load_transformer(cls: Any, where: ModelSource, dtype: Any) -> Any:
    """The transformer: from pretrained_transformer_model_name_or_path (else the main model) and its subfolder with
    from_pretrained, or from one .safetensors file with from_single_file, its config read from the main model's
    transformer/ (so nothing is fetched from the hub for it)."""
    if where.single_file():
        return _single_file(cls, where, dtype)
    source = where.transformer or where.model
    key = "pretrained_transformer_model_name_or_path" if where.transformer else "pretrained_model_name_or_path"
    kwargs = hub_kwargs(where, source)
    if where.transformer_subfolder:
        kwargs["subfolder"] = where.transformer_subfolder
    what = f"{source} ({where.transformer_subfolder or 'the folder itself'})"
    return loading(what, key, where, lambda: cls.from_pretrained(source, torch_dtype=dtype, **kwargs))


def _single_file(cls: Any, where: ModelSource, dtype: Any) -> Any:
    import torch

    path = str(Path(where.transformer).expanduser())
    if not hasattr(cls, "from_single_file"):  # the config refuses this first (config/model_source_keys.py)
        raise SourceError(f"pretrained_transformer_model_name_or_path: {path} is one file, but diffusers cannot "
                          f"load a {cls.__name__} from a single file; give a diffusers-layout folder or hub id")
    extra = {"config_revision": where.revision} if where.revision is not None and not is_local(where.model) else {}
    key = "pretrained_transformer_model_name_or_path"
    wrong = (f"{key}: {path} does not hold a {cls.__name__} matching {where.model}'s transformer/config.json; give "
             "a checkpoint of this model (original or ComfyUI key layout, or diffusers')")
    try:
        model = loading(path, key, where, lambda: cls.from_single_file(
            _transformer_tensors(path), config=where.model, subfolder="transformer", torch_dtype=dtype, **extra))
    except SourceError:
        raise
    except (NotImplementedError, KeyError, ValueError, RuntimeError) as e:
        # diffusers builds the model empty and fills in what the file holds: another model's file leaves weights on
        # the meta device (which its final cast refuses), or has tensors of other shapes
        raise SourceError(f"{wrong} ({type(e).__name__}: {str(e)[:300]})") from e
    missing = [name for name, p in [*model.named_parameters(), *model.named_buffers()] if p.device == torch.device("meta")]
    if missing:
        raise SourceError(f"{wrong}: {len(missing)} weights are missing (first: {missing[0]})")
    return model


def _transformer_tensors(path: str) -> dict[str, Any]:
    """The file's tensors, for from_single_file. ComfyUI's files put `model.diffusion_model.` before the transformer's
    keys (and may hold the VAE and text encoder too, under other prefixes): diffusers 0.42's Lumina2 conversion strips
    that prefix but then looks the keys up with it (KeyError), so the transformer's keys are taken here, unprefixed;
    a file without the prefix is passed whole."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        names = list(f.keys())
        prefixed = [n for n in names if n.startswith(COMFYUI_PREFIX)]
        return {n.removeprefix(COMFYUI_PREFIX): f.get_tensor(n) for n in (prefixed or names)}


def vae_location(where: ModelSource) -> tuple[str, dict[str, Any]]:
    """(source, from_pretrained kwargs) of the VAE. From elsewhere: its vae/ subfolder when it has one (a whole
    pipeline repository), else the folder itself (a VAE repository such as a fixed VAE)."""
    if where.vae is None:
        return where.model, {"subfolder": "vae", **hub_kwargs(where, where.model)}
    kwargs = {"variant": where.variant} if where.variant is not None else {}
    return where.vae, ({"subfolder": "vae"} if _has_vae_subfolder(where.vae) else {}) | kwargs


def _has_vae_subfolder(source: str) -> bool:
    local = Path(source).expanduser()
    if local.exists():
        return (local / "vae" / "config.json").is_file()
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        hf_hub_download(source, "vae/config.json")
    except EntryNotFoundError:
        return False
    return True


def load_vae_from(cls: Any, where: ModelSource, dtype: Any) -> Any:
    key = "pretrained_vae_model_name_or_path" if where.vae else "pretrained_model_name_or_path"
    # looking for a hub repository's vae/ can fail too (no such repository, no network): named like a load
    source, kwargs = loading(str(where.vae or where.model), key, where, lambda: vae_location(where))
    what = f"{source} ({kwargs.get('subfolder', 'the folder itself')})"
    if where.vae is not None:  # from its config.json alone, before its weights download
        _check_latent_channels(cls, where, source, {k: v for k, v in kwargs.items() if k != "variant"})
    return loading(what, key, where, lambda: cls.from_pretrained(source, torch_dtype=dtype, **kwargs))


def _check_latent_channels(cls: Any, where: ModelSource, source: str, kwargs: dict[str, Any]) -> None:
    """A VAE from elsewhere must make the latents the model's own VAE makes: SimpleTuner configs carry an SDXL VAE
    (4 channels) in pretrained_vae_model_name_or_path (its configure tool writes one for every model), which a
    16-channel transformer would only refuse at its first step, after every latent was cached. Read from both
    config.json files, so the foreign VAE's weights are not downloaded for nothing. A config that cannot be read: the
    load that follows names what is missing; nothing to compare with (no vae/ of the model): the load stands."""
    try:
        theirs = cls.load_config(source, **kwargs)
        own = cls.load_config(where.model, subfolder="vae", **hub_kwargs(where, where.model, weights=False))
    except (OSError, ValueError):
        return
    want, got = own.get("latent_channels"), theirs.get("latent_channels")
    if want is not None and got is not None and want != got:
        raise SourceError(f"pretrained_vae_model_name_or_path: {where.vae} makes latents of {got} channels, but the "
                          f"model's own VAE ({where.model}, vae/) makes {want}, which its transformer takes; remove "
                          "pretrained_vae_model_name_or_path (SimpleTuner configs often carry an SDXL VAE there), or "
                          f"name a VAE of {want} latent channels")


def cache_origin(where: ModelSource, part: str) -> dict[str, Any]:
    """The source part of a cache identity (`part`: 'vae' or 'text'). Only what is set is added, so caches made
    without these keys keep their fingerprint; the transformer's source is in neither."""
    source = where.vae if part == "vae" and where.vae is not None else where.model
    origin: dict[str, Any] = {"source": source}
    if where.revision is not None and source == where.model:
        origin["revision"] = where.revision
    if where.variant is not None:
        origin["variant"] = where.variant
    if (stamps := local_stamps(source, part)) is not None:
        origin["files"] = stamps
    return origin


def local_stamps(source: str, part: str) -> dict[str, list[int]] | None:
    """Size and modification time of a local model folder's files that make this cache's entries (`part` 'vae':
    the VAE's; 'text': the text encoders' and tokenizers'), so new weights saved over old ones in the same folder
    make new entries, as a changed config does. None for a hub id (its revision names its files)."""
    path = Path(source).expanduser()
    if path.is_file():  # a single-file VAE
        files = [path]
    elif path.is_dir():
        if part == "vae":
            parts = [path / "vae"] if (path / "vae").is_dir() else [path]
        else:
            parts = [p for p in path.iterdir() if p.is_dir() and p.name.startswith(("text_encoder", "tokenizer"))]
        files = [f for folder in parts for f in folder.iterdir() if f.is_file() and not f.name.startswith(".")]
    else:
        return None
    stamps = {}
    for f in sorted(files):
        st = f.stat()
        stamps[f.name if f == path else str(f.relative_to(path))] = [st.st_size, st.st_mtime_ns]
    return stamps

