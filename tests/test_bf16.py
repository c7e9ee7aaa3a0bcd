"""The user's path: bf16 (and fp16) mixed precision, with validation on, for every family, flavour kind
and adapter kind: caching, training, validation, checkpoint, resume after a crash, and the final save.

Every other test runs fp32; users run bf16. Validation must sample the plain module in the model's
dtype, as the stock pipeline does after `load_lora_weights`: the bf16 samples are compared with it.
"""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from safetensors.torch import load_file

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.data.images import fit
from difftune.data.video import decode_frames, probe_video, write_mp4
from difftune.train.loop import train
from difftune.train.setup import build_run
from families import CASES, case_data, wake_lora
from test_train import crash_then_resume, losses

KINDS = ["lora", "lycoris", "full"]
VALIDATION = dict(validation_prompt="a red circle", validation_negative_prompt="blurry",
                  validation_resolution="64x48", validation_num_inference_steps=2, validation_guidance=4.0,
                  validation_seed=11, validation_disable_unconditional=True)


def case_config(case, tmp_path, dataset, kind: str, precision: str = "bf16", **overrides):
    """A config for `case` trained as `kind` in `precision`, validating and checkpointing every 2 steps."""
    dataset, extra = case_data(case, tmp_path, dataset)
    if kind == "lycoris":
        lycoris = tmp_path / "lycoris.json"
        lycoris.write_text(json.dumps({"algo": "lokr", "linear_dim": 8, "linear_alpha": 4, "factor": 4}))
        extra |= {"lora_type": "lycoris", "lycoris_config": str(lycoris)}
    if kind == "full":
        extra |= {"model_type": "full", "optimizer": "adamw_bf16" if precision == "bf16" else "adamw"}
    settings = dict(model_family=case.family, model_flavour=case.flavour, mixed_precision=precision,
                    max_train_steps=4, checkpoint_step_interval=2, validation_step_interval=2,
                    resume_from_checkpoint="latest", learning_rate=1e-3, **VALIDATION, **extra)
    return write_config(tmp_path, dataset, **(settings | overrides)), dataset


def sample_names(case) -> list[str]:
    frames = ("@17" if case.i2v else "@9") if case.video else ""
    return [f"step-000002-64x48{frames}.png", f"final-step-000004-64x48{frames}.png"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bf16_trains_validates_checkpoints_resumes_and_saves(case, kind, tmp_path, dataset, monkeypatch):
    config, _ = case_config(case, tmp_path, dataset, kind)
    crash_then_resume(monkeypatch, config, at_step=3)  # dies after step 3, resumes from the step-2 checkpoint
    out = tmp_path / "output"
    seen = losses(out)
    assert sorted(seen) == [1, 2, 3, 4] and all(math.isfinite(v) for v in seen.values())
    for name in sample_names(case):
        image = np.asarray(Image.open(out / "validation" / name))
        assert image.std() > 0, f"{name} is a flat image: the sample was not finite"
    if kind == "full":
        folder = out / "transformer"
        weights = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
        dtypes = {v.dtype for v in weights.values()}  # bf16, and fp32 where the class keeps modules fp32
        assert weights and torch.bfloat16 in dtypes and dtypes <= {torch.bfloat16, torch.float32}
        assert all(torch.isfinite(v.float()).all() for v in weights.values())
    else:
        saved = load_file(out / "pytorch_lora_weights.safetensors")
        assert saved and all(torch.isfinite(v.float()).all() for v in saved.values())
        assert any(("lokr" if kind == "lycoris" else "lora_A") in k for k in saved)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "done" for e in events)
    assert not [e for e in events if e["event"] == "warning" and "not finite" in e.get("message", "")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bf16_validation_equals_the_stock_bf16_pipeline(case, tmp_path, dataset, monkeypatch):
    """Our bf16 sample is the one a user gets from the stock pipeline in bf16 with load_lora_weights."""
    config, data = case_config(case, tmp_path, dataset, "lora", max_train_steps=2, validation_step_interval=0,
                               checkpoint_step_interval=0, resume_from_checkpoint=None)
    run_cfg = load_config(config)
    run = build_run(run_cfg)
    wake_lora(run.transformer)
    train(run)
    name = sample_names(case)[1].replace("000004", "000002")
    ours = np.asarray(Image.open(tmp_path / "output" / "validation" / name)).astype(int)
    pipe = case.stock(run.comps.source, torch_dtype=torch.bfloat16)  # as a user loads it
    pipe.load_lora_weights(tmp_path / "output")
    image = original = None
    if case.i2i:
        original = Image.open(sorted((tmp_path / "inputs").glob("*.png"))[0]).convert("RGB")
    if case.i2v:
        original = decode_frames(sorted(data.glob("*.mp4"))[0], [0.0])[0]
    if original is not None:
        image = fit(original, (64, 48), "center", (0.5, 0.5))  # fitted to the sample's size, as validation fits it
        # the card's code fits the input itself (ImageOps.fit): the same picture
        card_fit = ImageOps.fit(original, (64, 48), Image.Resampling.LANCZOS)
        assert np.abs(np.asarray(card_fit).astype(int) - np.asarray(image).astype(int)).max() <= 2
    kw = {"num_frames": 17 if case.i2v else 9} if case.video else {}
    theirs = case.stock_sample(pipe, "a red circle", "blurry", 64, 48, 2, 4.0, 11, image=image,
                               device=run.accelerator.device, **kw)[0]
    if case.video:
        from difftune.data.video import contact_sheet

        theirs = contact_sheet(theirs)
    theirs = np.asarray(theirs).astype(int)
    assert ours.shape == theirs.shape and ours.std() > 0
    assert np.abs(ours - theirs).max() <= 2
    run_card_usage(run_cfg, run, tmp_path, monkeypatch, original, (64, 48, (17 if case.i2v else 9) if case.video else None),
                   ours)


def run_card_usage(run_cfg, run, tmp_path, monkeypatch, image, size, ours) -> None:
    """The model card's diffusers code, run as written against the stock pipeline (the base and repo names
    pointed at the local folders, cuda at the run's device): it loads the LoRA and writes the sample, which is the
    validation sample (negative prompt, steps, guidance and seed as validation had them) where the pipeline keeps
    the size."""
    from types import SimpleNamespace

    from difftune.train.model_card import model_card

    card = model_card(run_cfg, SimpleNamespace(data=SimpleNamespace(items=[]), state=run.state), [])
    code = card.split("## Use with diffusers")[1].split("```python\n")[1].split("```")[0]
    code = re.sub(r'from_pretrained\("[^"]*"', f'from_pretrained({str(run.comps.source)!r}', code, count=1)
    code = code.replace('"your-name/your-model"', repr(str(tmp_path / "output")))
    code = code.replace('"cuda"', repr(str(run.accelerator.device)))
    for ext in ("png", "mp4"):
        code = code.replace(f'"sample.{ext}"', repr(str(tmp_path / f"card-sample.{ext}")))
    if image is not None:
        image.save(tmp_path / "input.png")
        code = code.replace('load_image("input.png")', f'load_image({str(tmp_path / "input.png")!r})')
    def export_to_video(frames, path, fps):  # diffusers' needs imageio-ffmpeg or OpenCV, not installed here
        write_mp4(frames, Path(path), fps)

    monkeypatch.setattr("diffusers.utils.export_to_video", export_to_video)
    # a LyCORIS card downloads its file: here the repo is the local output folder
    monkeypatch.setattr("huggingface_hub.hf_hub_download", lambda repo, name: str(Path(repo) / name))
    names = {}
    if run.cfg.model_family != "lumina2":  # without torchvision, Qwen2VLProcessor needs the image-only processor
        from difftune.models.tiny_kandinsky5 import load_qwen_processor

        names["processor"] = load_qwen_processor(run.comps.source)
        code = code.replace("dtype=torch.bfloat16)", "dtype=torch.bfloat16, tokenizer=processor)", 1)
    assert "torch_dtype" not in code  # deprecated for pipelines from diffusers 0.42: the card writes dtype=
    exec(compile(code, "model card", "exec"), names)
    width, height, frames = size
    if frames is None:
        size = Image.open(tmp_path / "card-sample.png").size
        # Kandinsky 5 Image's pipeline snaps a size outside its 1K buckets (pipe.resolutions), as the card says
        assert size == (width, height) if run.cfg.model_family == "lumina2" else size[0] % 16 == size[1] % 16 == 0
        if run.cfg.model_family == "lumina2":
            card = np.asarray(Image.open(tmp_path / "card-sample.png")).astype(int)
            assert np.abs(card - ours).max() <= 2
    else:
        info = probe_video(tmp_path / "card-sample.mp4")
        assert (info.width, info.height, info.frames) == (width, height, frames)


@pytest.mark.parametrize("index,algo", [(0, "full"), (0, "glora"), (0, "lokr"), (1, "full")])
def test_bf16_lycoris_validation_equals_load_lycoris_in_the_stock_bf16_pipeline(index, algo, tmp_path, dataset,
                                                                              monkeypatch):
    """A LyCORIS network samples in the base's dtype, as load_lycoris puts it into a bf16 pipeline. `full` and
    `glora` multiply their own weights with the activations: in fp32 beside a bf16 base, validation crashed (on
    Kandinsky 5 too, whose fp32 modulations outweighed the bf16 weights a `full` network leaves)."""
    from difftune.adapters.lycoris import load_lycoris

    case = CASES[index]
    config, _ = case_config(case, tmp_path, dataset, "lora", max_train_steps=2, validation_step_interval=0,
                            checkpoint_step_interval=0, resume_from_checkpoint=None)
    lycoris = tmp_path / "lycoris.json"
    # lokr: saved with its own key prefix, which the model card's code sets before loading
    preset = {"apply_preset": {"lora_prefix": "mine"}} if algo == "lokr" else {}
    lycoris.write_text(json.dumps({"algo": algo, "linear_dim": 4, "linear_alpha": 2, **preset}))
    run_cfg = load_config(config, {"lora_type": "lycoris", "lycoris_config": str(lycoris)})
    run = build_run(run_cfg)
    train(run)
    ours = np.asarray(Image.open(tmp_path / "output" / "validation" / "final-step-000002-64x48.png")).astype(int)
    if algo == "lokr":  # the model card's lycoris code, run as written (without apply_to it sampled the base)
        assert all(k.startswith("mine_") for k in load_file(tmp_path / "output" / "pytorch_lora_weights.safetensors"))
        from lycoris import LycorisNetwork

        monkeypatch.setattr(LycorisNetwork, "LORA_PREFIX", LycorisNetwork.LORA_PREFIX)  # the card's code sets it
        run_card_usage(run_cfg, run, tmp_path, monkeypatch, None, (64, 48, None), ours)
    pipe = case.stock(run.comps.source, torch_dtype=torch.bfloat16)
    network = load_lycoris(pipe.transformer, tmp_path / "output" / "pytorch_lora_weights.safetensors")
    assert {p.dtype for p in network.parameters()} == {torch.bfloat16}
    theirs = np.asarray(case.stock_sample(pipe, "a red circle", "blurry", 64, 48, 2, 4.0, 11,
                                          device=run.accelerator.device)[0]).astype(int)
    assert ours.shape == theirs.shape and ours.std() > 0
    if algo == "full":  # the file stores the difference to the base weight: bf16 rounds base + difference anew
        assert np.abs(ours - theirs).mean() < 1.5 and np.abs(ours - theirs).max() <= 12
    else:
        assert np.abs(ours - theirs).max() <= 2


# Lumina2 in `make test`; the other families' fp16 runs (about 30 s together) in `make test-slow`: their
# mixed-precision path is the one the bf16 matrix covers, with another autocast dtype.
FP16 = [pytest.param(case, "lora", id=f"{case.id}-lora", marks=[pytest.mark.slow] if i else [])
        for i, case in enumerate(CASES)] + [pytest.param(CASES[0], "full", id=f"{CASES[0].id}-full")]


@pytest.mark.parametrize("case,kind", FP16)
def test_fp16_trains_validates_and_resumes(case, kind, tmp_path, dataset, monkeypatch):
    """fp16 autocast, every family with LoRA; a full fine-tune keeps fp32 weights (fp16 weights cannot be
    trained: a config error)."""
    extra = {"base_model_default_dtype": "fp32"} if kind == "full" else {}
    if kind == "full":
        with pytest.raises(ConfigError, match="full fine-tune cannot update fp16 weights"):
            load_config(case_config(case, tmp_path / "refused", dataset, kind, precision="fp16")[0])
    config, _ = case_config(case, tmp_path, dataset, kind, precision="fp16", **extra)
    crash_then_resume(monkeypatch, config, at_step=3)
    seen = losses(tmp_path / "output")
    assert sorted(seen) == [1, 2, 3, 4] and all(math.isfinite(v) for v in seen.values())
    for name in sample_names(case):
        assert np.asarray(Image.open(tmp_path / "output" / "validation" / name)).std() > 0
