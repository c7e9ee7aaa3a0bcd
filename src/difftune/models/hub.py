"""Load pipeline components the way the stock pipeline's `from_pretrained` does: by the class that
`model_index.json` names for each component, from a local folder or a hub repository.

A repository may, for example, ship a plain Qwen2 tokenizer where another ships the Qwen2-VL
processor; the stock pipeline loads either, so difftune must too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ComponentError(ValueError):
    """A component that the model folder does not have in a usable form (names the folder and the fix)."""


def model_index(source: str, revision: str | None = None) -> dict[str, Any]:
    """`model_index.json` of a local folder or hub repository (at `revision`, for a hub repository)."""
    folder = Path(source)
    if folder.is_dir():
        index = folder / "model_index.json"
        if not index.is_file():
            raise ComponentError(f"{source}: no model_index.json; give the folder of a diffusers pipeline "
                                 "(the hub layout: model_index.json, transformer/, vae/, text_encoder/, ...)")
    else:
        index = _download_index(source, revision)
    return json.loads(index.read_text(encoding="utf-8"))


def _download_index(source: str, revision: str | None) -> Path:
    """model_index.json of a hub repository, its failures said in one line with the fix (the first file a run
    fetches: no network, a gated or missing repository, a wrong revision end here, not in a traceback)."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(hf_hub_download(source, "model_index.json", revision=revision))
    except GatedRepoError as e:
        raise ComponentError(f"{source}: a gated repository: accept its terms on https://huggingface.co/{source} "
                             "and log in (`hf auth login` or HF_TOKEN)") from e
    except RepositoryNotFoundError as e:
        raise ComponentError(f"{source}: no such repository on the Hugging Face hub, or a private one you cannot "
                             "see; check the name, log in (`hf auth login` or HF_TOKEN), or give a local folder") from e
    except RevisionNotFoundError as e:
        raise ComponentError(f"{source}: revision {revision!r} does not exist there; fix revision") from e
    except LocalEntryNotFoundError as e:  # no connection (or HF_HUB_OFFLINE), and not in the local cache
        raise ComponentError(
            f"{source}: cannot reach the Hugging Face hub, and the model is not in the local cache "
            f"({constants.HF_HUB_CACHE}); check the connection (or unset HF_HUB_OFFLINE), download it once with "
            f"`hf download {source}` where there is one, or give a local folder as pretrained_model_name_or_path"
        ) from e


def component_class(index: dict[str, Any], name: str) -> str | None:
    """The class name model_index.json gives for component `name` (None when it lists none)."""
    entry = index.get(name)
    return entry[1] if isinstance(entry, list) and len(entry) == 2 and entry[1] else None


def is_processor(class_name: str | None) -> bool:
    return bool(class_name) and class_name.endswith("Processor")


def load_component(source: str, name: str, index: dict[str, Any], fallback: type, dtype: Any = None,
                   **kwargs: Any) -> Any:
    """Component `name` as the class in model_index.json names it (`fallback` when it names none).
    Qwen2-VL processors load without torchvision (see tiny_kandinsky5.load_qwen_processor). `kwargs` go to
    from_pretrained (revision, variant)."""
    import diffusers
    import transformers

    class_name = component_class(index, name)
    if is_processor(class_name) and "Qwen2" in class_name:
        from difftune.models.tiny_kandinsky5 import load_qwen_processor

        try:
            return load_qwen_processor(source, name, **kwargs)
        except (OSError, ValueError) as e:
            raise ComponentError(f"{source}: {name}/ should hold a {class_name} (model_index.json says so) but it "
                                 f"cannot be loaded: {e}") from e
    cls = (getattr(transformers, class_name, None) or getattr(diffusers, class_name, None)) if class_name else None
    cls = cls or fallback
    if dtype is not None:
        kwargs["torch_dtype"] = dtype
    return cls.from_pretrained(source, subfolder=name, **kwargs)
