"""Regularisation datasets (`is_regularisation_data` on an image or video entry; `is_regularization_data` is
the same key, config/compat.py renames it): the checks between that key, the rest of the dataset list and the
training config, run by config/load.py before any model loads. What the key does is in train/regularisation.py.
"""

from __future__ import annotations

from typing import Any

KEY = "is_regularisation_data"
DATASET_KEY_ALIASES = {"is_regularization_data": KEY}

# On entries that are not trained on (text_embeds, conditioning) the key is accepted only at its "off" value,
# through config/load.py's pending-key path: SimpleTuner reads it on every entry, so a false there is harmless.
NOT_ON_OTHER_ENTRIES: dict[str, tuple[tuple[Any, ...], str]] = {
    KEY: ((False, None), "only image and video datasets are trained on, so only they can be regularisation data "
          "(a conditioning dataset's images are the inputs of the image dataset that names it: mark that one); "
          "remove it here"),
}


def regularisation_problems(train: Any, plan: Any) -> list[str]:
    """Misuse of is_regularisation_data, each naming the dataset, the key and the fix."""
    problems = [f"dataset {ds.id!r}: {KEY}: this dataset is only the validation input of an image-to-video run "
                f"(eval_dataset_id) and is not trained on; remove {KEY}"
                for ds in plan.validation_only.values() if ds.is_regularisation_data]
    marked = [ds for ds in plan.images if ds.is_regularisation_data]
    if not marked:
        return problems
    if train.model_type == "full":
        # Decision: SimpleTuner trains such data as ordinary images in a full fine-tune; accepting the key and
        # ignoring it would hide that, so the user says so by removing it.
        problems += [f"dataset {ds.id!r}: {KEY}: a full fine-tune trains the base model's own weights, so no frozen "
                     "base model is left to give the targets (SimpleTuner then trains these images as ordinary "
                     f"data); remove {KEY} to do the same, or train model_type 'lora'" for ds in marked]
    elif len(marked) == len(plan.images):
        problems.append(f"{KEY}: every dataset is regularisation data ({', '.join(repr(ds.id) for ds in marked)}): "
                        "the adapter would only be held at the base model and learn nothing; add the dataset of "
                        f"your subject without {KEY}")
    return problems
