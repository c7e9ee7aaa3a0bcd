"""DoRA (`use_dora`) and `lora_init_type` on peft's LoRA (adapters/kinds.py, adapters/dora.py): config checks,
training in bf16, resume, the saved adapter in the stock pipelines and in ComfyUI's layout, and the interactions
with other features."""

from __future__ import annotations

import json
import math

import pytest
import torch
from peft import LoraConfig
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import write_config
from difftune.adapters import comfyui
from difftune.adapters.kinds import LoraAdapter
from difftune.config import ConfigError, load_config
from difftune.config.schema import TrainConfig
from difftune.models import get_family, tiny_model
from difftune.train.loop import train
from difftune.train.setup import build_run
from families import Case
from test_train import crash_then_resume, losses

MAGNITUDE = "lora_magnitude_vector"
FAMILIES = ["lumina2", "kandinsky5-image", "kandinsky5-video"]


def problems(path, **overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def dora_file(path, dora: bool = True):
    key = "transformer.layers.0.attn.to_q." + (MAGNITUDE if dora else "lora_A.weight")
    save_file({key: torch.ones(4)}, str(path))
    return path


def test_config_checks_name_both_keys(tmp_path, dataset):
    def text(**keys):
        return problems(write_config(tmp_path, dataset, **keys))

    # off values (and SimpleTuner's null) change nothing and load
    cfg = load_config(write_config(tmp_path, dataset, use_dora=False, lora_init_type=None)).train
    assert (cfg.use_dora, cfg.lora_init_type) == (False, "default")
    load_config(write_config(tmp_path, dataset, model_type="full", use_dora=False, lora_init_type="default"))
    for init in ("pissa", "olora", "loftq"):
        message = text(lora_init_type=init)
        assert "lora_init_type" in message and "base" in message and "'gaussian'" in message, message
    assert "unknown lora_init_type 'kaiming'" in text(lora_init_type="kaiming")
    lycoris = tmp_path / "lycoris.json"
    lycoris.write_text(json.dumps({"algo": "lokr"}))
    message = text(use_dora=True, lora_type="lycoris", lycoris_config=str(lycoris))
    assert "use_dora" in message and "lora_type 'lycoris'" in message and "dora_wd" in message
    assert "model_type 'full'" in text(use_dora=True, model_type="full")
    assert "lora_type 'lycoris'" in text(lora_init_type="gaussian", lora_type="lycoris", lycoris_config=str(lycoris))
    assert "model_type 'full'" in text(lora_init_type="gaussian", model_type="full")
    message = text(use_dora=True, base_model_precision="int8-quanto", mixed_precision="bf16")
    assert "use_dora" in message and "'int8-quanto'" in message and "int8-torchao" in message
    load_config(write_config(tmp_path, dataset, use_dora=True, base_model_precision="int8-quanto"))  # fp32 weights
    load_config(write_config(tmp_path, dataset, use_dora=True, base_model_precision="int8-torchao",
                             mixed_precision="bf16"))
    for key, value in (("fsdp_enable", True), ("enable_group_offload", True), ("musubi_blocks_to_swap", 1)):
        message = text(use_dora=True, lora_format="comfyui", **{key: value})
        assert "use_dora" in message and "comfyui" in message and key in message, message
    plain, dora = dora_file(tmp_path / "plain.safetensors", dora=False), dora_file(tmp_path / "dora.safetensors")
    assert "lora_init_type 'gaussian' with init_lora" in text(lora_init_type="gaussian", init_lora=str(plain))
    assert "set use_dora true" in text(init_lora=str(dora))
    load_config(write_config(tmp_path, dataset, init_lora=str(plain)))
    load_config(write_config(tmp_path, dataset, init_lora=str(dora), use_dora=True))
    # difftune's other files are refused by name (they failed after the caches filled, asking about targets)
    from safetensors.torch import save_file

    for name, key, kind in (("lycoris.safetensors", "lycoris_layers_0_attn_to_q.lokr_w1", "a LyCORIS network"),
                            ("comfyui_lora.safetensors", "diffusion_model.layers.0.attention.qkv.lora_down.weight",
                             "a LoRA in ComfyUI's or kohya's layout")):
        save_file({key: torch.zeros(2, 2)}, str(tmp_path / name))
        message = text(init_lora=str(tmp_path / name))
        assert f"init_lora {tmp_path / name} is {kind}" in message, message


def tiny(family_name: str, dtype=torch.float32):
    family = get_family(family_name)
    return family, family.load(str(tiny_model(family_name, "tiny-random")), dtype)


def inputs(family, comps, case: Case):
    torch.manual_seed(1)
    x = case.latents(comps.vae.config.latent_channels, 4, 4)
    return x, family.collate_text([family.encode_text(comps, ["a red square"])[0]])


def predict(family, net, x, text):
    with torch.no_grad():
        return family.predict(net, x, torch.tensor([0.4]), text, None)


def wake(net, seed: int = 0) -> None:
    """Trained-looking DoRA weights: random lora_B, and magnitudes moved off the base weights' row norms."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
            if MAGNITUDE in name:
                p.mul_(torch.rand(p.shape, generator=generator) * 0.4 + 0.8)


def merged_weight(layer) -> torch.Tensor:
    """The weight peft's layer applies, W' [out, in], read from its own forward (no dropout: eval mode)."""
    base = layer.get_base_layer()
    with torch.no_grad():
        out = layer(torch.eye(base.in_features))
        return (out - (base.bias if base.bias is not None else 0)).T


def comfy_dora_patch(weight, up, down, alpha, dora_scale) -> torch.Tensor:
    """ComfyUI's patched weight for a LoRA with dora_scale at strength 1, written from its math
    (comfy/weight_adapter: LoRAAdapter.calculate_weight, then weight_decompose on the output axis, on an fp32 copy of
    the weight): W_calc = W + alpha / rank · up @ down; W' = W_calc · dora_scale / (|W| + eps), |W| the base weight's
    row norms."""
    weight = weight.float()
    calc = weight + alpha / down.shape[0] * (up.float() @ down.float())
    assert dora_scale.shape == (weight.shape[0], 1)  # ComfyUI takes the output axis when shape[0] is W's rows
    return calc * dora_scale / (torch.linalg.norm(weight, dim=1, keepdim=True) + torch.finfo(torch.float32).eps)


MODULE_OF = {"lumina2": comfyui.lumina2_module, "kandinsky5-image": comfyui.kandinsky5_module,
             "kandinsky5-video": comfyui.kandinsky5_module}


def check_comfyui_file(family_name: str, net, path) -> int:
    """Every dora_scale is [out, 1] fp32 and ComfyUI's patch of the base weights equals peft's merged weights
    (Lumina2: q, k, v fused in one qkv); returns how many ComfyUI modules were checked."""
    lora = load_file(path)
    layers = {n: m for n, m in net.named_modules() if hasattr(m, "lora_magnitude_vector") and m.lora_A}
    groups: dict[str, dict] = {}
    for name in layers:
        target, slot = MODULE_OF[family_name](name)
        groups.setdefault(target, {})[slot or 0] = name
    for target, slots in groups.items():
        stem = f"diffusion_model.{target}"
        names = [slots[s] for s in sorted(slots)]
        base = torch.cat([layers[n].get_base_layer().weight.detach().float() for n in names])
        peft = torch.cat([merged_weight(layers[n]) for n in names])
        scale = lora[f"{stem}.dora_scale"]
        assert scale.dtype == torch.float32 and scale.shape == (base.shape[0], 1)
        ours = comfy_dora_patch(base, lora[f"{stem}.lora_up.weight"], lora[f"{stem}.lora_down.weight"],
                                lora[f"{stem}.alpha"].item(), scale)
        torch.testing.assert_close(ours, peft, rtol=1e-5, atol=1e-6)
        # and it is not the plain LoRA's patch: the magnitudes act
        assert (ours - (base + lora[f"{stem}.alpha"].item() / lora[f"{stem}.lora_down.weight"].shape[0]
                        * lora[f"{stem}.lora_up.weight"] @ lora[f"{stem}.lora_down.weight"])).abs().max() > 1e-3
    assert all(k.rsplit(".", 1)[0].removesuffix(".lora_up").removesuffix(".lora_down") in
               {f"diffusion_model.{t}" for t in groups} for k in lora)
    return len(groups)


@pytest.mark.parametrize("family_name", FAMILIES)
def test_saved_dora_loads_into_the_stock_pipeline_and_comfyui(tmp_path, family_name):
    """The adapter's own save: the diffusers file loads with the stock pipeline's load_lora_weights (DoRA detected
    from the file) and gives the trained transformer's output; the ComfyUI file reproduces peft's weights."""
    family, comps = tiny(family_name)
    case = Case(family_name, "tiny-random")
    x, text = inputs(family, comps, case)
    base = predict(family, comps.transformer, x, text)
    torch.manual_seed(0)
    adapter = LoraAdapter(TrainConfig(model_family=family_name, max_train_steps=1, lora_rank=4, lora_alpha=12,
                                      use_dora=True, lora_format="comfyui"), family, comps.transformer)
    net = comps.transformer
    assert torch.equal(predict(family, net, x, text), base)  # B = 0 and m = |W|: the base model, bit for bit
    wake(net)
    ours = predict(family, net, x, text)
    assert (ours - base).abs().max() > 1e-2
    adapter.save(tmp_path)
    saved = load_file(tmp_path / "pytorch_lora_weights.safetensors")
    magnitudes = {k: v for k, v in saved.items() if k.endswith(MAGNITUDE)}
    assert len(magnitudes) == sum(k.endswith("lora_A.weight") for k in saved) > 0
    pipe = case.stock(tiny_model(family_name, "tiny-random"))
    pipe.load_lora_weights(tmp_path)
    config = pipe.transformer.peft_config[next(iter(pipe.transformer.peft_config))]
    assert config.use_dora
    torch.testing.assert_close(predict(family, pipe.transformer, x, text), ours)
    net.eval()
    assert check_comfyui_file(family_name, net, tmp_path / "comfyui_lora.safetensors") > 0


def test_dora_trains_in_bf16_and_its_magnitudes_change(tmp_path, dataset):
    run = build_run(load_config(write_config(tmp_path, dataset, use_dora=True, mixed_precision="bf16",
                                             max_train_steps=3, learning_rate=1e-2)))
    model = run.accelerator.unwrap_model(run.transformer)
    magnitudes = {n: p for n, p in model.named_parameters() if MAGNITUDE in n}
    assert magnitudes and all(p.dtype == torch.float32 and p.requires_grad for p in magnitudes.values())
    assert {id(p) for p in magnitudes.values()} <= {id(p) for p in run.params}  # the optimizer steps them
    before = {n: p.detach().clone() for n, p in magnitudes.items()}
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer.weight" in n}
    assert {p.dtype for p in base.values()} == {torch.bfloat16}
    train(run)
    assert all(math.isfinite(v) for v in losses(run.output_dir).values())
    changed = [n for n, p in magnitudes.items() if not torch.equal(p.detach(), before[n])]
    assert len(changed) == len(magnitudes)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)  # the base is frozen
    path = run.output_dir / "pytorch_lora_weights.safetensors"
    saved = load_file(path)
    for name, p in magnitudes.items():
        key = "transformer." + name.replace(f"{MAGNITUDE}.default.weight", MAGNITUDE)
        assert saved[key].dtype == torch.float32 and torch.equal(saved[key], p.detach().cpu())
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["lora_adapter_metadata"])["transformer.use_dora"] is True


def test_resume_gives_the_same_losses_and_adapter(tmp_path, dataset, monkeypatch):
    common = dict(use_dora=True, max_train_steps=4, checkpoint_step_interval=2, resume_from_checkpoint="latest",
                  learning_rate=1e-2)
    train(build_run(load_config(write_config(tmp_path / "a", dataset, **common))))
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", dataset, **common), at_step=3)
    expected, resumed = losses(tmp_path / "a" / "output"), losses(tmp_path / "b" / "output")
    assert sorted(resumed) == sorted(expected) == [1, 2, 3, 4]
    assert resumed == expected
    trainable = load_file(tmp_path / "b" / "output" / "checkpoints" / "checkpoint-0000002" / "trainable.safetensors")
    assert any(MAGNITUDE in k for k in trainable)
    a, b = (load_file(tmp_path / r / "output" / "pytorch_lora_weights.safetensors") for r in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def lora_a(net) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters() if "lora_A" in n}


def test_lora_init_type(tmp_path):
    """'default' is peft's init_lora_weights=True, as before the key existed; 'gaussian' draws lora_A from
    N(0, 1/r); both keep lora_B at zero, so the model starts as the base model."""
    family, comps = tiny("lumina2")
    x, text = inputs(family, comps, Case("lumina2", "tiny-random"))
    base = predict(family, comps.transformer, x, text)
    targets = list(family.lora_target_modules)
    starts = {}
    for init in ("default", "gaussian"):
        _, fresh = tiny("lumina2")
        torch.manual_seed(0)
        LoraAdapter(TrainConfig(model_family="lumina2", max_train_steps=1, lora_rank=4, lora_init_type=init),
                    family, fresh.transformer)
        assert not any(MAGNITUDE in n for n, _ in fresh.transformer.named_parameters())  # use_dora off: plain LoRA
        assert all(p.abs().max() == 0 for n, p in fresh.transformer.named_parameters() if "lora_B" in n)
        assert torch.equal(predict(family, fresh.transformer, x, text), base)
        starts[init] = lora_a(fresh.transformer)
    _, plain = tiny("lumina2")
    torch.manual_seed(0)
    plain.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=True, target_modules=targets))
    peft_default = lora_a(plain.transformer)
    assert all(torch.equal(starts["default"][n], peft_default[n].float()) for n in peft_default)
    gaussian = torch.cat([v.flatten() for v in starts["gaussian"].values()])
    default = torch.cat([v.flatten() for v in starts["default"].values()])
    assert abs(gaussian.std().item() - 1 / 4) < 0.02  # N(0, 1/r), r = 4
    assert default.abs().max() <= 1 / math.sqrt(32) + 1e-6  # Kaiming-uniform(a=sqrt(5)) on 32 inputs: U(+-1/sqrt(32))
    saved = LoraAdapter(TrainConfig(model_family="lumina2", max_train_steps=1, lora_rank=4, lora_init_type="gaussian"),
                        family, comps.transformer).save(tmp_path)
    with safe_open(str(saved), framework="pt") as f:  # load_lora_weights builds its LoraConfig from this
        assert json.loads(f.metadata()["lora_adapter_metadata"])["transformer.init_lora_weights"] == "gaussian"


def test_init_lora_into_dora(tmp_path):
    """A plain LoRA continued as DoRA starts as that LoRA (magnitudes = |W + s·B·A|); a DoRA file continues with
    its own magnitudes, tensor for tensor."""
    family, comps = tiny("lumina2")
    x, text = inputs(family, comps, Case("lumina2", "tiny-random"))
    keys = dict(model_family="lumina2", max_train_steps=1, lora_rank=4, lora_alpha=8)
    plain = LoraAdapter(TrainConfig(**keys), family, comps.transformer)
    wake(comps.transformer)
    plain.save(tmp_path / "plain")
    plain_out = predict(family, comps.transformer, x, text)
    _, fresh = tiny("lumina2")
    LoraAdapter(TrainConfig(**keys, use_dora=True, init_lora=str(tmp_path / "plain")), family, fresh.transformer)
    assert any(MAGNITUDE in n for n, _ in fresh.transformer.named_parameters())
    torch.testing.assert_close(predict(family, fresh.transformer, x, text), plain_out, rtol=1e-5, atol=1e-5)

    _, first = tiny("lumina2")
    dora = LoraAdapter(TrainConfig(**keys, use_dora=True), family, first.transformer)
    wake(first.transformer, seed=3)
    dora.save(tmp_path / "dora")
    _, again = tiny("lumina2")
    LoraAdapter(TrainConfig(**keys, use_dora=True, init_lora=str(tmp_path / "dora")), family, again.transformer)
    trained = dict(first.transformer.named_parameters())
    for name, p in again.transformer.named_parameters():
        if "lora_" in name:
            assert torch.equal(p, trained[name]), name


@pytest.mark.slow  # about 5 s each on 2 cores
@pytest.mark.parametrize("precision,mixed", [("int8-torchao", "bf16"), ("int8-quanto", "no")])
def test_dora_on_a_quantized_base_loads_into_the_unquantized_pipeline(tmp_path, dataset, precision, mixed):
    """torchao (and bitsandbytes) layers take DoRA on bf16 weights; quanto's only on fp32 weights (on bf16 the
    config refuses it, see above). Validation samples on the quantized base; the stock, unquantized pipeline loads the
    adapter, magnitudes included."""
    run = build_run(load_config(write_config(
        tmp_path, dataset, use_dora=True, base_model_precision=precision, mixed_precision=mixed, max_train_steps=2,
        learning_rate=1e-2, validation_prompt="a red circle", validation_resolution="32x32",
        validation_num_inference_steps=2, validation_disable_unconditional=True)))
    model = run.accelerator.unwrap_model(run.transformer)
    assert any(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in model.parameters())  # quantized
    before = {n: p.detach().clone() for n, p in model.named_parameters() if MAGNITUDE in n}
    result = train(run)
    assert all(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if n in before)
    assert (run.output_dir / "validation" / "final-step-000002-32x32.png").exists()
    pipe = Case("lumina2", "tiny-random").stock(run.comps.source)
    pipe.load_lora_weights(result.parent)
    layers = [m for m in pipe.transformer.modules() if hasattr(m, "lora_magnitude_vector") and m.lora_A]
    assert layers and all(type(m.get_base_layer().weight) is torch.nn.Parameter for m in layers)
    saved = load_file(result)
    for name, module in pipe.transformer.named_modules():
        if module in layers:
            magnitude = module.lora_magnitude_vector[next(iter(module.lora_magnitude_vector))].weight
            torch.testing.assert_close(magnitude, saved[f"transformer.{name}.{MAGNITUDE}"])


@pytest.mark.slow  # about 5 s on 2 cores
def test_dora_with_tread_and_ema(tmp_path, dataset):
    """TREAD routes tokens around blocks whose projections carry DoRA (other losses than without it); the EMA
    averages the magnitudes with the LoRA weights and its checkpointed adapter holds them."""
    common = dict(use_dora=True, max_train_steps=3, learning_rate=1e-2, train_batch_size=2)
    plain = build_run(load_config(write_config(tmp_path / "a", dataset, **common)))
    train(plain)
    run = build_run(load_config(write_config(
        tmp_path / "b", dataset, use_ema=True, ema_decay=0.5, checkpoint_step_interval=3,
        tread_config={"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -1}]}, **common)))
    magnitudes = [p for n, p in run.accelerator.unwrap_model(run.transformer).named_parameters() if MAGNITUDE in n]
    assert {id(p) for p in magnitudes} <= {id(p) for p in run.ema.params}
    train(run)
    assert losses(run.output_dir).keys() == losses(plain.output_dir).keys()
    assert losses(run.output_dir)[2] != losses(plain.output_dir)[2]
    live = load_file(run.output_dir / "pytorch_lora_weights.safetensors")
    averaged = load_file(run.output_dir / "checkpoints" / "checkpoint-0000003" / "ema" / "pytorch_lora_weights.safetensors")
    keys = [k for k in live if k.endswith(MAGNITUDE)]
    assert keys and all(k in averaged for k in keys)
    assert any(not torch.equal(live[k], averaged[k]) for k in keys)


@pytest.mark.slow  # 25 to 40 s on 2 cores
def test_fsdp_dora_two_processes_equal_one(tmp_path):
    """FSDP2 shards the magnitudes with the LoRA weights: the same losses and adapter as one process."""
    from difftune.demo import make_dataset
    from test_distributed import finish, launch

    make_dataset(tmp_path / "images", count=8)
    settings = dict(max_train_steps=2, lr_scheduler="linear", use_dora=True, learning_rate=1e-2)
    two = write_config(tmp_path / "two", tmp_path / "images", train_batch_size=1, fsdp_enable=True, **settings)
    one = write_config(tmp_path / "one", tmp_path / "images", train_batch_size=2, **settings)
    finish(launch(two, 29683))
    finish(launch(one, 0, processes=1))
    a, b = losses(tmp_path / "one" / "output"), losses(tmp_path / "two" / "output")
    assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=1e-5) for k in a)
    wa, wb = (load_file(tmp_path / r / "output" / "pytorch_lora_weights.safetensors") for r in ("one", "two"))
    assert wa.keys() == wb.keys() and any(k.endswith(MAGNITUDE) for k in wa)
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # about 10 s on 2 cores
def test_bf16_validation_equals_the_stock_bf16_pipeline(tmp_path, dataset):
    """The validation sample of a bf16 DoRA run (magnitudes cast to bf16 while sampling, as load_lora_weights puts
    them in the base layer's dtype) is the stock bf16 pipeline's with the saved file."""
    import numpy as np
    from PIL import Image

    run = build_run(load_config(write_config(
        tmp_path, dataset, use_dora=True, mixed_precision="bf16", max_train_steps=2, learning_rate=1e-2,
        validation_prompt="a red circle", validation_negative_prompt="blurry", validation_resolution="64x48",
        validation_num_inference_steps=3, validation_guidance=4.0, validation_seed=11)))
    train(run)
    ours = np.asarray(Image.open(run.output_dir / "validation" / "final-step-000002-64x48.png")).astype(int)
    case = Case("lumina2", "tiny-random")
    pipe = case.stock(run.comps.source, torch_dtype=torch.bfloat16)
    pipe.load_lora_weights(run.output_dir)
    theirs = np.asarray(case.stock_sample(pipe, "a red circle", "blurry", 64, 48, 3, 4.0, 11,
                                           device=run.accelerator.device)[0]).astype(int)
    assert ours.shape == theirs.shape and ours.std() > 0
    assert np.abs(ours - theirs).max() <= 2


@pytest.mark.slow  # about 6 s on 2 cores
def test_block_streaming_equals_resident(tmp_path, dataset):
    """DoRA reads each base weight in its forward: block streaming installs it first, so the losses and the
    adapter equal a resident run's bit for bit (with gradient checkpointing's recomputation)."""
    common = dict(use_dora=True, max_train_steps=3, learning_rate=1e-2, gradient_checkpointing=True)
    resident = build_run(load_config(write_config(tmp_path / "a", dataset, **common)))
    train(resident)
    streamed = build_run(load_config(write_config(tmp_path / "b", dataset, enable_group_offload=True,
                                                  group_offload_blocks_per_group=1, **common)))
    assert streamed.streamer is not None and streamed.streamer.streamed_bytes() > 0
    train(streamed)
    assert losses(streamed.output_dir) == losses(resident.output_dir)
    a, b = (load_file(r.output_dir / "pytorch_lora_weights.safetensors") for r in (resident, streamed))
    assert a.keys() == b.keys() and any(k.endswith(MAGNITUDE) for k in a) and all(torch.equal(a[k], b[k]) for k in a)
