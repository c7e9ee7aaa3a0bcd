"""Adapter kinds end to end: full fine-tune, LyCORIS, LoRA options, ComfyUI format; save/reload."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Lumina2Pipeline, Lumina2Transformer2DModel
from PIL import Image
from safetensors.torch import load_file

from conftest import write_config
from difftune.adapters.lycoris import load_lycoris
from difftune.config import load_config
from difftune.models import get_family
from difftune.train.loop import train
from difftune.train.setup import build_run
from test_train import crash_then_resume, losses

VALIDATION = dict(validation_prompt="a red circle", validation_negative_prompt="blurry",
                  validation_resolution="64x48", validation_num_inference_steps=3, validation_guidance=4.0,
                  validation_seed=11)


def stock_image(pipe):
    return np.asarray(pipe("a red circle", negative_prompt="blurry", height=48, width=64, num_inference_steps=3,
                           guidance_scale=4.0, generator=torch.Generator().manual_seed(11)).images[0])


def test_full_finetune_saves_a_transformer_the_stock_pipeline_loads(tmp_path, dataset):
    path = write_config(tmp_path, dataset, model_type="full", max_train_steps=3, learning_rate=1e-3, **VALIDATION)
    run = build_run(load_config(path))
    before = {k: v.clone() for k, v in run.comps.transformer.state_dict().items()}
    train(run)
    folder = run.output_dir / "transformer"
    transformer = Lumina2Transformer2DModel.from_pretrained(folder)
    changed = [k for k, v in transformer.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) > len(before) // 2  # the whole network trained, not an adapter
    pipe = Lumina2Pipeline.from_pretrained(run.comps.source, transformer=transformer)
    ours = np.asarray(Image.open(run.output_dir / "validation" / "final-step-000003-64x48.png"))
    assert np.abs(ours.astype(int) - stock_image(pipe).astype(int)).max() <= 1


def test_lycoris_trains_saves_loads_and_resumes(tmp_path, dataset, monkeypatch):
    config = tmp_path / "lycoris.json"
    config.write_text(json.dumps({"algo": "lokr", "multiplier": 1.0, "linear_dim": 8, "linear_alpha": 4, "factor": 4}))
    common = dict(lora_type="lycoris", lycoris_config=str(config), max_train_steps=5, checkpoint_step_interval=2,
                  resume_from_checkpoint="latest", learning_rate=1e-2)
    run = build_run(load_config(write_config(tmp_path / "a", dataset, **common)))
    train(run)
    saved = tmp_path / "a" / "output" / "pytorch_lora_weights.safetensors"
    assert any("lokr" in k for k in load_file(saved))
    fresh = get_family("lumina2").load(run.comps.source, torch.float32).transformer
    load_lycoris(fresh, saved)
    x = torch.randn(1, 4, 4, 4)
    text = {"prompt_embeds": torch.randn(1, 5, 32), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    family = get_family("lumina2")
    with torch.no_grad():
        torch.testing.assert_close(family.predict(fresh, x, torch.tensor([0.5]), text),
                                   family.predict(run.comps.transformer, x, torch.tensor([0.5]), text))
    expected = losses(tmp_path / "a" / "output")
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", dataset, **common), at_step=3)
    resumed = losses(tmp_path / "b" / "output")
    assert all(resumed[s] == pytest.approx(expected[s], rel=1e-6, abs=1e-7) for s in expected)


def test_lora_options_targets_dropout_init_and_comfyui(tmp_path, dataset):
    path = write_config(tmp_path / "a", dataset, max_train_steps=2, lora_target_modules="to_q,to_v",
                        lora_dropout=0.1, lora_format="comfyui", learning_rate=1e-2)
    run = build_run(load_config(path))
    wrapped = {n.rsplit(".", 1)[-1] for n, m in run.comps.transformer.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"to_q", "to_v"}
    assert run.comps.transformer.peft_config["default"].lora_dropout == 0.1
    train(run)
    comfy = load_file(tmp_path / "a" / "output" / "comfyui_lora.safetensors")
    # the diffusers file is the result (the done event, the console), the ComfyUI file named beside it
    from difftune.cli import result_line

    (done,) = [e for e in map(json.loads, (tmp_path / "a" / "output" / "events.jsonl").read_text().splitlines())
               if e["event"] == "done"]
    assert done["adapter"].endswith("pytorch_lora_weights.safetensors")
    assert result_line(run.cfg, Path(done["adapter"])).endswith(
        f"pytorch_lora_weights.safetensors, and for ComfyUI to {tmp_path / 'a' / 'output' / 'comfyui_lora.safetensors'}")
    assert comfy and all(k.startswith("diffusion_model.") for k in comfy)
    assert any(k.endswith(".alpha") for k in comfy)
    # init_lora: a new run starts from the saved adapter, weight for weight.
    first = load_file(tmp_path / "a" / "output" / "pytorch_lora_weights.safetensors")
    again = build_run(load_config(write_config(tmp_path / "b", dataset, max_train_steps=1, lora_target_modules="to_q,to_v",
                                               init_lora=str(tmp_path / "a" / "output"))))
    live = {k: v for k, v in again.comps.transformer.named_parameters() if "lora_" in k}
    for key, value in first.items():
        name = key.removeprefix("transformer.").replace(".weight", ".default.weight")
        torch.testing.assert_close(live[name].detach(), value)


def test_adapter_config_errors(tmp_path, dataset):
    from difftune.config import ConfigError

    with pytest.raises(ConfigError, match="lycoris_config"):
        load_config(write_config(tmp_path, dataset, lora_type="lycoris"))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="algo"):
        load_config(write_config(tmp_path, dataset, lora_type="lycoris", lycoris_config=str(bad)))
    with pytest.raises(ConfigError, match="comfyui"):
        load_config(write_config(tmp_path, dataset, model_type="full", lora_format="comfyui"))
    full = tmp_path / "full.json"
    full.write_text('{"algo": "full"}')  # it replaces the weights; LyCORIS has no bypass mode for it
    with pytest.raises(ConfigError, match="algo 'full' trains the weights themselves"):
        load_config(write_config(tmp_path, dataset, lora_type="lycoris", lycoris_config=str(full),
                                 base_model_precision="int8-quanto"))
    with pytest.raises(ConfigError, match="init_lora"):
        load_config(write_config(tmp_path, dataset, init_lora=str(tmp_path / "nope")))
    # LyCORIS' weight decomposition is left out beside quantized weights (bypass mode): it trained as without it
    for dora in ({"algo": "locon", "dora_wd": True},
                 {"algo": "lokr", "apply_preset": {"module_algo_map": {"Attention": {"algo": "lokr", "dora_wd": True}}}}):
        decomposed = tmp_path / "dora.json"
        decomposed.write_text(json.dumps(dora))
        with pytest.raises(ConfigError, match="dora_wd .weight decomposition. is not trained on a quantized base"):
            load_config(write_config(tmp_path, dataset, lora_type="lycoris", lycoris_config=str(decomposed),
                                     base_model_precision="int8-quanto"))
        assert load_config(write_config(tmp_path, dataset, lora_type="lycoris", lycoris_config=str(decomposed)))
    ia3 = tmp_path / "ia3.json"
    ia3.write_text('{"algo": "ia3"}')  # trains, but lycoris-lora cannot load its file back
    with pytest.raises(ConfigError, match="cannot load its saved file back"):
        load_config(write_config(tmp_path, dataset, lora_type="lycoris", lycoris_config=str(ia3)))


def test_lora_target_modules_that_name_no_layer_are_refused_before_any_model_loads(tmp_path, dataset, capsys):
    """`to_q,to_kk` trained to_q alone without a word; a list naming nothing passed check and crashed in peft after
    caching (exit 1, a traceback); a block's name crashed in peft too."""
    from difftune.cli import main

    for targets, said in (("to_q,to_kk", "lora_target_modules 'to_kk' matches no module of the lumina2 transformer"),
                          ("nothing,to_kk", "'nothing', 'to_kk' match no module"),
                          ("attn", "'attn' names whole blocks (Attention), not layers")):
        config = write_config(tmp_path, dataset, lora_target_modules=targets if "," in targets else [targets])
        for command in ("check", "train"):
            assert main([command, "--config", str(config)]) == 2, (targets, command)
            err = capsys.readouterr().err
            assert said in err and "Traceback" not in err, err
    assert "its linear layers are named" in err and "to_out.0, to_q" in err
    assert not (tmp_path / "cache").exists()  # refused before caching (on the transformer built without weights)
    # a JSON list on the command line is a list (it was one name, '["to_q"]', which matched no module)
    assert main(["check", "--config", str(config), "--lora_target_modules", '["to_q", "to_v"]']) == 0, \
        capsys.readouterr().err


def test_lora_target_modules_are_checked_on_the_loaded_transformer(tmp_path, dataset):
    """A transformer not known before it loads (a local folder, several processes) is checked when peft wraps it."""
    from difftune.adapters.kinds import LoraAdapter
    from difftune.adapters.targets import LoraTargetsError

    cfg = load_config(write_config(tmp_path, dataset, lora_target_modules=["to_q", "to_kk"])).train
    from difftune.memory_plan.architecture import architecture_of

    transformer = Lumina2Transformer2DModel.from_pretrained(architecture_of(cfg).name, subfolder="transformer")
    with pytest.raises(LoraTargetsError, match="'to_kk' matches no module"):
        LoraAdapter(cfg, get_family("lumina2"), transformer)
