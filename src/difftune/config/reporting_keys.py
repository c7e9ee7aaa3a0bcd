"""Config checks of trackers (report_to), the hub upload (push_to_hub), CLIP evaluation and the
validation extras. Import-light: only `importlib.util.find_spec` looks at installed packages, so a
missing optional package is a config error at `difftune check` time, not a crash at step 0."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from difftune.models.registry import FAMILY_FACTS

if TYPE_CHECKING:
    from difftune.config.schema import TrainConfig

# report_to value -> the accelerate trackers it starts (accelerate's own names)
TRACKERS: dict[str, tuple[str, ...]] = {"none": (), "tensorboard": ("tensorboard",), "wandb": ("wandb",),
                                        "all": ("tensorboard", "wandb")}
INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb"}
# SimpleTuner's other trackers (accelerate's names), which difftune does not send to
OTHER_TRACKERS = ("comet_ml", "aim", "clearml", "mlflow", "dvclive", "swanlab", "trackio")


def project_name(v: str | None) -> str | None:
    """tracker_project_name: TensorBoard writes under output_dir/tensorboard/<this>, so a path here wrote outside
    output_dir (and past the web UI's roots, which confine paths, not names); W&B refuses some characters."""
    if v is not None and (any(c in v for c in "/\\\0") or v.strip() in (".", "..")):
        raise ValueError(f"{v!r} is a path; tracker_project_name is a name (TensorBoard's logs go to "
                         "output_dir/tensorboard/<name>, W&B's project is named so): use letters, digits, '-', '_', "
                         "'.', and move the whole run with output_dir")
    if v is not None and (bad := sorted({c for c in v if c in "#?%:"})):
        raise ValueError(f"{v!r} has {' '.join(bad)}, which W&B does not take in a project name; use letters, "
                         "digits, '-', '_', '.'")
    return v


def tracker_choice(value: object) -> object:
    """report_to as SimpleTuner writes it, as one of difftune's values: null (or empty) is 'none', and a comma list
    ("wandb,tensorboard", SimpleTuner's way to name several) the value that starts those trackers ('all' for both).
    Anything else is returned for the schema to refuse with the allowed values."""
    if value is None:
        return "none"
    if not isinstance(value, str):
        return value
    names = {part.strip().lower() for part in value.split(",")} - {""}
    other = sorted(names & set(OTHER_TRACKERS))
    if other:
        raise ValueError(f"{', '.join(map(repr, other))}: not implemented yet (difftune sends to W&B and TensorBoard "
                         "only); use 'wandb' or 'tensorboard' (the JSONL event log is always written)")
    if not names <= set(TRACKERS):
        return value
    started = {tracker for name in names for tracker in TRACKERS[name]}  # "" starts none
    return next(name for name, trackers in TRACKERS.items() if set(trackers) == started)


# The stock pipeline each family samples with, (text-to-X, X-to-X). Their __call__ takes no guidance_rescale in
# diffusers 0.42 (tests/test_reporting.py checks these signatures, so a diffusers that adds it shows up).
PIPELINES: dict[str, tuple[str, str]] = {
    "lumina2": ("Lumina2Pipeline", "Lumina2Pipeline"),
    "kandinsky5-image": ("Kandinsky5T2IPipeline", "Kandinsky5I2IPipeline"),
    "kandinsky5-video": ("Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline"),
}


def pipeline_name(cfg: TrainConfig) -> str:
    text_to, image_to = PIPELINES[cfg.model_family]
    return image_to if FAMILY_FACTS[cfg.model_family].takes_input_image(cfg.flavour()) else text_to


def reporting_checks(cfg: TrainConfig) -> None:
    missing = [name for name in TRACKERS[cfg.report_to] if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"report_to {cfg.report_to!r} needs the {' and '.join(missing)} package: install it with "
                         f"`pip install 'difftune[trackers]'` (or `{'; '.join(INSTALL[m] for m in missing)}`), or "
                         "set report_to to 'none'")
    hub = [k for k in ("push_to_hub", "push_checkpoints_to_hub") if getattr(cfg, k)]
    if hub and not cfg.hub_model_id:
        raise ValueError(f"{hub[0]} needs hub_model_id: the hub repository to upload to ('user/name')")
    if hub and cfg.hub_model_id:  # the hub's own rule, offline: a bad name failed only at the upload's start
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(cfg.hub_model_id)
        except HFValidationError as e:
            raise ValueError(f"hub_model_id {cfg.hub_model_id!r} is not a hub repository name: {e} Write it as "
                             "'user/name' or 'name'") from None
    if cfg.push_checkpoints_to_hub and not cfg.push_to_hub:
        raise ValueError("push_checkpoints_to_hub uploads to push_to_hub's repository; set push_to_hub to true "
                         "(or push_checkpoints_to_hub to false)")
    if cfg.evaluation_type == "clip" and not cfg.validation_prompts():
        raise ValueError("evaluation_type 'clip' scores validation samples against their prompts: set "
                         "validation_prompt (or a prompt library), or set evaluation_type to 'none'")
    if cfg.validation_guidance_rescale:
        raise ValueError(f"validation_guidance_rescale {cfg.validation_guidance_rescale:g}: {cfg.model_family} "
                         f"samples with diffusers' {pipeline_name(cfg)}, whose __call__ takes no guidance_rescale; "
                         "set validation_guidance_rescale to 0.0")
