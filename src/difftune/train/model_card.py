"""The model card (README.md) written beside the result for `push_to_hub`: what was trained, on what,
how, sample images from validation, and how to load it in diffusers and ComfyUI."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from difftune.config import RunConfig
from difftune.config.dataset_entry_keys import validation_video_fps, validation_video_frames
from difftune.config.reporting_keys import pipeline_name
from difftune.models.registry import FAMILY_FACTS

ADAPTER_FILE = "pytorch_lora_weights.safetensors"  # the LoRA file of a result (and of its ema/ folder)


def _dtype_keyword() -> str:
    """diffusers 0.40 takes `dtype=` in from_pretrained and from_single_file, and from 0.42 a pipeline warns that
    `torch_dtype` is deprecated (to be removed in 1.0): the card's code is written for the diffusers installed."""
    from importlib.metadata import version

    found = re.match(r"(\d+)\.(\d+)", version("diffusers"))
    return "dtype" if found and (int(found[1]), int(found[2])) >= (0, 40) else "torch_dtype"


DTYPE = _dtype_keyword()

MAX_CAPTIONS = 5
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")  # owner/name: the hub's base_model takes no paths


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


def _parts_elsewhere(cfg: Any) -> str:
    """Lines that put the transformer and the VAE the run trained with into the pipeline (model_source_keys.py)."""
    lines = ""
    own = cfg.pretrained_transformer_model_name_or_path
    if own is not None:
        if own.lower().endswith(".safetensors"):
            call = (f"from_single_file(\"{own}\", config=\"{_pipeline_base(cfg)}\", subfolder=\"transformer\",\n"
                    f"    {DTYPE}=torch.bfloat16)")
        else:
            sub = cfg.pretrained_transformer_subfolder
            subfolder = f', subfolder="{sub}"' if sub else ""
            call = f"from_pretrained(\"{own}\"{subfolder}, {DTYPE}=torch.bfloat16)"
        lines += f"pipe.transformer = type(pipe.transformer).{call}  # the base this was trained on\n"
    if cfg.pretrained_vae_model_name_or_path is not None:
        lines += (f"pipe.vae = type(pipe.vae).from_pretrained(\"{cfg.pretrained_vae_model_name_or_path}\", "
                  f"{DTYPE}=torch.bfloat16)  # add subfolder=\"vae\" for a whole pipeline's VAE\n")
    return lines


def _pipeline_base(cfg: Any) -> str:
    if cfg.pretrained_model_name_or_path or not cfg.flavour().startswith("tiny-random"):
        return cfg.model_source()
    return f"(tiny random {cfg.model_family} model, built offline)"


def _generate(run_cfg: RunConfig) -> str:
    """The lines that run the pipeline and keep its result, as the family's stock pipeline takes and returns them:
    an input image first for image-to-image and image-to-video, `.images` (Lumina2), `.image` (Kandinsky 5
    Image) or `.frames` (Kandinsky 5 Video, written with export_to_video)."""
    cfg = run_cfg.train
    width, height = cfg.validation_sizes()[0]
    video = "video" in cfg.model_family
    takes_image = FAMILY_FACTS[cfg.model_family].takes_input_image(cfg.flavour())
    args = ["image"] if takes_image else []
    args.append(repr(cfg.validation_prompt or "your prompt"))
    args += [f"height={height}", f"width={width}"]
    if video:
        args.append(f"num_frames={validation_video_frames(cfg, run_cfg.datasets)}")
    # the samples shown were made with it: the code reproduces them (an empty one too: Kandinsky 5 Video's
    # pipelines put a negative prompt of their own in place of none)
    args.append(f"negative_prompt={cfg.validation_negative_prompt!r}")
    args += [f"num_inference_steps={cfg.validation_num_inference_steps}", f"guidance_scale={cfg.guidance():g}"]
    if cfg.tokenizer_max_length is not None:  # the prompt length validation encoded and sampled at
        args.append(f"max_sequence_length={cfg.tokenizer_max_length}")
    if not cfg.validation_randomize:  # the first sample's seed: its noise drawn where validation draws it
        seed = cfg.validation_seed if cfg.validation_seed is not None else cfg.seed
        device = "cpu" if cfg.validation_seed_source == "cpu" else "cuda"
        args.append(f'generator=torch.Generator("{device}").manual_seed({seed})')
    head = ('image = load_image("input.png")  # the input image\n'
            f"# to cover {width}x{height}, center-cropped, as validation fits its input (the pipeline would stretch it)\n"
            f"image = ImageOps.fit(image, ({width}, {height}), Image.Resampling.LANCZOS)\n") if takes_image else ""
    if video:
        return (head + f"frames = pipe({', '.join(args)}).frames[0]\n"
                "# export_to_video needs imageio and imageio-ffmpeg (or opencv-python)\n"
                f'export_to_video(frames, "sample.mp4", fps={validation_video_fps(cfg, run_cfg.datasets):g})\n')
    if cfg.model_family == "lumina2":
        return head + f"result = pipe({', '.join(args)}).images[0]\nresult.save(\"sample.png\")\n"
    return (head + "# the pipeline snaps a size outside pipe.resolutions (its 1K buckets) to the closest of them\n"
            f"result = pipe({', '.join(args)}).image[0]\nresult.save(\"sample.png\")\n")


def _imports(run_cfg: RunConfig, pipeline: str) -> str:
    cfg = run_cfg.train
    utils = (["load_image"] if FAMILY_FACTS[cfg.model_family].takes_input_image(cfg.flavour()) else []) + \
        (["export_to_video"] if "video" in cfg.model_family else [])
    needs = "# Kandinsky 5's Qwen2.5-VL processor needs torchvision installed\n" if cfg.model_family != "lumina2" else ""
    pil = "from PIL import Image, ImageOps\n" if "load_image" in utils else ""
    return (f"{needs}import torch\nfrom diffusers import {pipeline}\n"
            + (f"from diffusers.utils import {', '.join(utils)}\n" if utils else "") + pil + "\n")


def _usage(run_cfg: RunConfig, repo: str, pipeline: str, base: str) -> str:
    cfg = run_cfg.train
    if cfg.model_type == "full":
        return (f"```python\n{_imports(run_cfg, pipeline)}"
                f"pipe = {pipeline}.from_pretrained(\"{base}\", {DTYPE}=torch.bfloat16)\n"
                f"{_parts_elsewhere(cfg) if cfg.pretrained_vae_model_name_or_path else ''}"
                f"pipe.transformer = type(pipe.transformer).from_pretrained(\"{repo}\", subfolder=\"transformer\",\n"
                f"    {DTYPE}=torch.bfloat16)\npipe.to(\"cuda\")\n{_generate(run_cfg)}```\n")
    if cfg.lora_type == "lycoris":
        multiplier, prefix = _lycoris_multiplier(cfg), _lycoris_prefix(cfg)
        return ("This is a LyCORIS network (`pytorch_lora_weights.safetensors`, with its `lycoris_config` in the "
                "file's metadata). diffusers' `load_lora_weights` does not read LyCORIS algorithms: apply it with "
                "the `lycoris-lora` package on the pipeline's transformer (or with difftune's "
                "`difftune.adapters.lycoris.load_lycoris(pipe.transformer, path)`, which does the same).\n\n"
                f"```python\n{_imports(run_cfg, pipeline)}from huggingface_hub import hf_hub_download\n"
                f"from lycoris import {'LycorisNetwork, ' if prefix else ''}create_lycoris_from_weights\n\n"
                f"pipe = {pipeline}.from_pretrained(\"{base}\", {DTYPE}=torch.bfloat16)\n{_parts_elsewhere(cfg)}"
                "pipe.to(\"cuda\")\n"
                f"path = hf_hub_download(\"{repo}\", \"pytorch_lora_weights.safetensors\")\n"
                + (f"LycorisNetwork.apply_preset({{\"lora_prefix\": {json.dumps(prefix)}}})  # the prefix its keys "
                   "were saved with\n" if prefix else "") +
                f"network, _ = create_lycoris_from_weights({multiplier:g}, path, pipe.transformer)  # the multiplier "
                "it trained with\n"
                "network.apply_to()  # hooks it into the transformer's layers: without this it changes nothing\n"
                "# beside the transformer, not in it: moved on its own, in the pipeline's dtype (its full and glora "
                "modules do not cast their fp32 weights)\n"
                "network.to(device=\"cuda\", dtype=pipe.transformer.dtype)\n"
                f"{_generate(run_cfg)}```\n")
    return (f"```python\n{_imports(run_cfg, pipeline)}"
            f"pipe = {pipeline}.from_pretrained(\"{base}\", {DTYPE}=torch.bfloat16)\n{_parts_elsewhere(cfg)}"
            # named: the EMA copy (ema/) and a ComfyUI file are .safetensors too, which diffusers could pick instead
            f"pipe.load_lora_weights(\"{repo}\", weight_name=\"pytorch_lora_weights.safetensors\")\n"
            f"pipe.to(\"cuda\")\n{_generate(run_cfg)}```\n")


def _lycoris_multiplier(cfg: Any) -> float:
    return float(_lycoris_config(cfg).get("multiplier", 1.0))


def _lycoris_prefix(cfg: Any) -> str | None:
    """The lora_prefix of the config's apply_preset when it is not the library's default (the keys' prefix:
    create_lycoris_from_weights finds no module of a file saved with another one)."""
    from difftune.adapters.lycoris import LIBRARY_PREFIX

    prefix = (_lycoris_config(cfg).get("apply_preset") or {}).get("lora_prefix")
    return prefix if prefix and prefix != LIBRARY_PREFIX else None


def _lycoris_config(cfg: Any) -> dict[str, Any]:
    return json.loads(Path(cfg.lycoris_config).read_text(encoding="utf-8-sig"))


def _comfyui(cfg: Any) -> str:
    if cfg.model_type != "lora":
        return ("No ComfyUI file: a full fine-tune is saved as a diffusers transformer folder, which ComfyUI's "
                "model loaders do not read as it is.\n")
    lycoris = cfg.lora_type == "lycoris"
    if cfg.lora_format == "comfyui":
        strength = _lycoris_multiplier(cfg) if lycoris else 1.0
        return ("Put `comfyui_lora.safetensors` in `ComfyUI/models/loras/` and load it with a `LoraLoaderModelOnly` "
                "node after the model loader (the file is in ComfyUI's key layout; no conversion needed"
                + (f"; strength {strength:g}, the LyCORIS multiplier it trained with" if strength != 1 else "")
                + ").\n")
    if lycoris:
        return ("ComfyUI does not map this LyCORIS file's keys for this model. Train with `lora_format: comfyui` to "
                "get `comfyui_lora.safetensors` as well, in ComfyUI's key layout.\n")
    text = ("The file here is in diffusers' layout. Train with `lora_format: comfyui` to get "
            "`comfyui_lora.safetensors` as well, loadable by ComfyUI's `LoraLoaderModelOnly` without conversion.")
    alpha = cfg.effective_lora_alpha()
    if cfg.model_family != "lumina2" and (alpha != cfg.lora_rank or cfg.use_dora):
        # ComfyUI maps Kandinsky 5's diffusers keys as they are, without the alpha kept in the file's metadata
        text += (" ComfyUI also reads this file's Kandinsky 5 keys, but not "
                 + ("its DoRA magnitudes: use the ComfyUI file." if cfg.use_dora else
                    f"its alpha: at strength 1 it applies the LoRA {cfg.lora_rank / alpha:g} times as strongly as "
                    f"trained; set the strength to {alpha / cfg.lora_rank:g}, or use the ComfyUI file."))
    return text + "\n"


def model_card(run_cfg: RunConfig, run: Any, samples: list[Path]) -> str:
    cfg = run_cfg.train
    repo = cfg.hub_model_id or "your-name/your-model"
    base = _pipeline_base(cfg)
    # the transformer trained on, when it came from elsewhere: the base of this adapter (or fine-tune)
    trained_on = cfg.pretrained_transformer_model_name_or_path or base
    pipeline = pipeline_name(cfg)
    triggers = instance_prompts(run_cfg)
    kind = "full fine-tune" if cfg.model_type == "full" else ("LyCORIS" if cfg.lora_type == "lycoris" else "LoRA")
    takes_image = FAMILY_FACTS[cfg.model_family].takes_input_image(cfg.flavour())
    task = ("image-to-" if takes_image else "text-to-") + ("video" if "video" in cfg.model_family else "image")
    tags = ["difftune", cfg.model_family, task,
            "lora" if cfg.model_type == "lora" else "full-finetune", "diffusers"]
    if not cfg.model_card_safe_for_work:
        tags.append("not-for-all-audiences")  # the hub shows a content warning before the repository
    hub_base = trained_on if _HUB_ID.fullmatch(trained_on) and not Path(trained_on).expanduser().exists() else ""
    front = ["---", f"base_model: {hub_base}" if hub_base else "", "library_name: diffusers", "tags:",
             *[f"- {t}" for t in tags]]
    if triggers:
        front.append(f"instance_prompt: {triggers[0]!r}")
    lines = [line for line in front if line] + ["---", "", f"# {repo}", ""]
    if not cfg.model_card_safe_for_work:
        lines += ["> **Warning:** this model may generate content that is not safe for work (NSFW).", ""]
    if cfg.model_card_note and cfg.model_card_note.strip():  # the user's own words first, as written
        lines += [cfg.model_card_note.strip(), ""]
    on = f"transformer `{trained_on}` with pipeline `{base}`" if trained_on != base else f"base `{base}`"
    lines += [f"A {kind} of **{cfg.model_family}** (flavour `{cfg.flavour()}`, {on}), trained with difftune.", ""]
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
        # a file name ending in -ema is the EMA weights' sample (train/validation.py names them)
        ema = any(p.stem.endswith("-ema") for p in samples)
        lines += ["## Samples", "", f"Validation samples at step {run.state.step} (the file names say the prompt "
                  "and size" + ("; those ending in -ema are the EMA weights', in ema/" if ema else "") + "):", ""]
        lines += [f"![{p.stem}]({p.as_posix()})" for p in samples] + [""]
    lines += ["## Use with diffusers", "", _usage(run_cfg, repo, pipeline, base)]
    if cfg.use_ema and cfg.model_type == "lora":
        how = (f'hf_hub_download("{repo}", "ema/{ADAPTER_FILE}")' if cfg.lora_type == "lycoris" else
               f'load_lora_weights("{repo}", subfolder="ema", weight_name="{ADAPTER_FILE}")')
        lines += [f"The EMA weights are in `ema/` beside them: load `ema/{ADAPTER_FILE}` in their place "
                  f"(`{how}`).", ""]
    elif cfg.use_ema:  # a full fine-tune's EMA transformer, saved as the transformer is
        lines += ["The EMA weights are in `ema/transformer` beside them: load them in their place "
                  f'(`type(pipe.transformer).from_pretrained("{repo}", subfolder="ema/transformer", '
                  f"{DTYPE}=torch.bfloat16)`).", ""]
    lines += ["## Use with ComfyUI", "", _comfyui(cfg)]
    return "\n".join(lines)
