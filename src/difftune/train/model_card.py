"""The model card (README.md) written beside the result for `push_to_hub`: what was trained, on what,
how, sample images from validation, and how to load it in diffusers and ComfyUI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from difftune.config import RunConfig
from difftune.config.reporting_keys import pipeline_name

MAX_CAPTIONS = 5


def captions_of(run: Any) -> list[str]:
    """A few distinct training captions, in dataset order."""
    seen: list[str] = []
    for item in run.data.items:
        caption = item.sample.caption.strip()
        if caption and caption not in seen:
            seen.append(caption)
        if len(seen) == MAX_CAPTIONS:
            break
    return seen


def instance_prompts(run_cfg: RunConfig) -> list[str]:
    return sorted({d.instance_prompt for d in run_cfg.datasets.images if d.instance_prompt})


def _usage(cfg: Any, repo: str, pipeline: str, base: str) -> str:
    prompt = cfg.validation_prompt or "your prompt"
    if cfg.model_type == "full":
        return (f"```python\nimport torch\nfrom diffusers import {pipeline}\n\n"
                f"pipe = {pipeline}.from_pretrained(\"{base}\", torch_dtype=torch.bfloat16)\n"
                f"pipe.transformer = type(pipe.transformer).from_pretrained(\"{repo}\", subfolder=\"transformer\",\n"
                f"    torch_dtype=torch.bfloat16)\npipe.to(\"cuda\")\nimage = pipe({prompt!r}).images[0]\n```\n")
    if cfg.lora_type == "lycoris":
        return ("This is a LyCORIS network (`pytorch_lora_weights.safetensors`, with its `lycoris_config` in the "
                "file's metadata). diffusers' `load_lora_weights` does not read LyCORIS algorithms: apply it with "
                "the `lycoris-lora` package (`create_lycoris_from_weights`) on the pipeline's transformer.\n")
    return (f"```python\nimport torch\nfrom diffusers import {pipeline}\n\n"
            f"pipe = {pipeline}.from_pretrained(\"{base}\", torch_dtype=torch.bfloat16)\n"
            f"pipe.load_lora_weights(\"{repo}\")\npipe.to(\"cuda\")\n"
            f"image = pipe({prompt!r}, num_inference_steps={cfg.validation_num_inference_steps}, "
            f"guidance_scale={cfg.guidance():g}).images[0]\n```\n")


def _comfyui(cfg: Any) -> str:
    if cfg.model_type != "lora" or cfg.lora_type != "standard":
        return "No ComfyUI file: ComfyUI's LoRA loader takes standard LoRAs.\n"
    if cfg.lora_format == "comfyui":
        return ("Put `comfyui_lora.safetensors` in `ComfyUI/models/loras/` and load it with a `LoraLoaderModelOnly` "
                "node after the model loader (the file is in ComfyUI's key layout; no conversion needed).\n")
    return ("The file here is in diffusers' layout. Train with `lora_format: comfyui` to get "
            "`comfyui_lora.safetensors` as well, loadable by ComfyUI's `LoraLoaderModelOnly` without conversion.\n")


def model_card(run_cfg: RunConfig, run: Any, samples: list[Path]) -> str:
    cfg = run_cfg.train
    repo = cfg.hub_model_id or "your-name/your-model"
    base = cfg.model_source() if cfg.pretrained_model_name_or_path or cfg.flavour() != "tiny-random" else \
        f"(tiny random {cfg.model_family} model, built offline)"
    pipeline = pipeline_name(cfg)
    triggers = instance_prompts(run_cfg)
    kind = "full fine-tune" if cfg.model_type == "full" else ("LyCORIS" if cfg.lora_type == "lycoris" else "LoRA")
    tags = ["difftune", cfg.model_family, "text-to-video" if "video" in cfg.model_family else "text-to-image",
            "lora" if cfg.model_type == "lora" else "full-finetune", "diffusers"]
    front = ["---", f"base_model: {base}" if "/" in base else "", "library_name: diffusers", "tags:",
             *[f"- {t}" for t in tags]]
    if triggers:
        front.append(f"instance_prompt: {triggers[0]!r}")
    lines = [line for line in front if line] + ["---", "", f"# {repo}", "",
             f"A {kind} of **{cfg.model_family}** (flavour `{cfg.flavour()}`, base `{base}`), trained with difftune.",
             ""]
    if triggers:
        lines += ["## Trigger", "", *[f"- `{t}`" for t in triggers], ""]
    captions = captions_of(run)
    if captions:
        lines += ["## Example training captions", "", *[f"- {c}" for c in captions], ""]
    rows = [("steps", run.state.step), ("learning rate", f"{cfg.learning_rate:g}"), ("lr scheduler", cfg.lr_scheduler),
            ("optimizer", cfg.optimizer), ("batch size", cfg.train_batch_size),
            ("gradient accumulation", cfg.gradient_accumulation_steps), ("mixed precision", cfg.mixed_precision),
            ("base model precision", cfg.base_model_precision), ("seed", cfg.seed)]
    if cfg.model_type == "lora":
        rows[1:1] = [("rank", cfg.lora_rank), ("alpha", f"{cfg.effective_lora_alpha():g}")]
    if cfg.use_ema:
        rows.append(("EMA decay", cfg.ema_decay))
    lines += ["## Training settings", "", "| setting | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], ""]
    if samples:
        lines += ["## Samples", "", f"Validation samples at step {run.state.step}"
                  + (f" for \"{cfg.validation_prompt}\"" if cfg.validation_prompt else "") + ":", ""]
        lines += [f"![{p.stem}]({p.as_posix()})" for p in samples] + [""]
    lines += ["## Use with diffusers", "", _usage(cfg, repo, pipeline, base), "## Use with ComfyUI", "", _comfyui(cfg)]
    return "\n".join(lines)
