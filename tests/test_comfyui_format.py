"""ComfyUI LoRA export: the converted keys are ComfyUI's own module names, and the weight deltas ComfyUI computes from
the file equal the deltas of the diffusers LoRA, on the tiny Lumina2 and Kandinsky 5 models."""

from __future__ import annotations

import pytest
import torch
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

from difftune.adapters import comfyui
from difftune.adapters.kinds import LoraAdapter
from difftune.config.schema import TrainConfig
from difftune.models import get_family, tiny_model

RANK, ALPHA = 4, 12.0  # scale 3: a lost alpha (ComfyUI's default scale is 1) would show

# ---- ComfyUI's Linear modules, written down from its source ---------------------------------------------------------
# Comfy-Org/ComfyUI comfy/ldm/lumina/model.py: JointTransformerBlock has .attention = JointAttention (qkv: Linear(dim,
# (n_heads + 2 * n_kv_heads) * head_dim), out), .feed_forward = FeedForward (w1, w2, w3) and, when modulated,
# .adaLN_modulation = Sequential(SiLU, Linear). NextDiT: layers (modulated), noise_refiner (modulation=True),
# context_refiner (modulation=False), x_embedder, t_embedder (mmdit.TimestepEmbedder: mlp.0, mlp.2),
# cap_embedder = Sequential(RMSNorm, Linear), final_layer = FinalLayer (linear, adaLN_modulation.1).
COMFY_LUMINA2_BLOCK = ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
COMFY_LUMINA2_MODULATION = "adaLN_modulation.1"
COMFY_LUMINA2_TOP = ("x_embedder", "t_embedder.mlp.0", "t_embedder.mlp.2", "cap_embedder.1", "final_layer.linear",
                     "final_layer.adaLN_modulation.1")
# Comfy-Org/ComfyUI comfy/ldm/kandinsky5/model.py: TransformerEncoderBlock (text_modulation, self_attention,
# feed_forward), TransformerDecoderBlock (visual_modulation, self_attention, cross_attention, feed_forward);
# SelfAttention/CrossAttention: to_query, to_key, to_value, out_layer; FeedForward: in_layer, out_layer;
# Modulation: out_layer; Kandinsky5: time_embeddings (in_layer, out_layer), text_embeddings.in_layer,
# pooled_text_embeddings.in_layer, visual_embeddings.in_layer, out_layer (modulation.out_layer, out_layer).
COMFY_K5_ATTENTION = ("to_query", "to_key", "to_value", "out_layer")
COMFY_K5_FF = ("feed_forward.in_layer", "feed_forward.out_layer")
COMFY_K5_TOP = ("time_embeddings.in_layer", "time_embeddings.out_layer", "text_embeddings.in_layer",
                "pooled_text_embeddings.in_layer", "visual_embeddings.in_layer", "out_layer.modulation.out_layer",
                "out_layer.out_layer")


def comfy_lumina2_linears(n_layers: int, n_refiner_layers: int) -> set[str]:
    names = set(COMFY_LUMINA2_TOP)
    for group, count, modulated in (("layers", n_layers, True), ("noise_refiner", n_refiner_layers, True),
                                    ("context_refiner", n_refiner_layers, False)):
        for i in range(count):
            names |= {f"{group}.{i}.{m}" for m in COMFY_LUMINA2_BLOCK}
            if modulated:
                names.add(f"{group}.{i}.{COMFY_LUMINA2_MODULATION}")
    return names


def comfy_kandinsky5_linears(n_text: int, n_visual: int) -> set[str]:
    names = set(COMFY_K5_TOP)
    for i in range(n_text):
        names |= {f"text_transformer_blocks.{i}.self_attention.{m}" for m in COMFY_K5_ATTENTION}
        names |= {f"text_transformer_blocks.{i}.{m}" for m in (*COMFY_K5_FF, "text_modulation.out_layer")}
    for i in range(n_visual):
        for attn in ("self_attention", "cross_attention"):
            names |= {f"visual_transformer_blocks.{i}.{attn}.{m}" for m in COMFY_K5_ATTENTION}
        names |= {f"visual_transformer_blocks.{i}.{m}" for m in (*COMFY_K5_FF, "visual_modulation.out_layer")}
    return names


def comfy_architecture(family: str, config) -> set[str]:
    if family == "lumina2":
        return comfy_lumina2_linears(config.num_layers, config.num_refiner_layers)
    return comfy_kandinsky5_linears(config.num_text_blocks, config.num_visual_blocks)


MODULE_OF = {"lumina2": comfyui.lumina2_module, "kandinsky5-image": comfyui.kandinsky5_module,
             "kandinsky5-video": comfyui.kandinsky5_module}


def comfy_apply(model_sd: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], strength: float = 1.0):
    """ComfyUI's path for these files, reduced to what they use: the generic key map of `model_lora_keys_unet`
    (comfy/lora.py: `diffusion_model.<m>` -> `diffusion_model.<m>.weight`), `LoRAAdapter.load` (lora_up/lora_down and
    `.alpha`) and `LoRAAdapter.calculate_weight` (comfy/weight_adapter/lora.py:
    W += strength * alpha / lora_down.shape[0] * (lora_up @ lora_down).reshape(W.shape)).
    Returns the patched weights and the keys ComfyUI would log as "lora key not loaded"."""
    key_map = {k[: -len(".weight")]: k for k in model_sd if k.startswith("diffusion_model.") and k.endswith(".weight")}
    patched = {k: v.clone() for k, v in model_sd.items()}
    loaded = set()
    for x, target in key_map.items():
        alpha = lora[f"{x}.alpha"].item() if f"{x}.alpha" in lora else None
        if alpha is not None:
            loaded.add(f"{x}.alpha")
        up_key, down_key = f"{x}.lora_up.weight", f"{x}.lora_down.weight"
        if up_key in lora:
            up, down = lora[up_key].float(), lora[down_key].float()
            loaded |= {up_key, down_key}
            scale = alpha / down.shape[0] if alpha is not None else 1.0
            w = patched[target]
            w += strength * scale * (up.flatten(1) @ down.flatten(1)).reshape(w.shape)
    return patched, set(lora) - loaded


def split_sizes(family: str, config) -> tuple[int, int, int] | None:
    if family != "lumina2":
        return None
    head_dim = config.hidden_size // config.num_attention_heads
    return config.hidden_size, config.num_kv_heads * head_dim, config.num_kv_heads * head_dim


def to_comfy_layout(family: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{diffusers module: weight} -> {diffusion_model.<ComfyUI module>.weight: weight}, fusing q/k/v rows."""
    out, pieces = {}, {}
    for name, w in weights.items():
        target, slot = MODULE_OF[family](name)
        if slot is None:
            out[f"diffusion_model.{target}.weight"] = w
        else:
            pieces.setdefault(target, {})[slot] = w
    for target, parts in pieces.items():
        out[f"diffusion_model.{target}.weight"] = torch.cat([parts[0], parts[1], parts[2]], dim=0)
    return out


def from_comfy_layout(family: str, config, comfy_sd: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        target, slot = MODULE_OF[family](name)
        w = comfy_sd[f"diffusion_model.{target}.weight"]
        out[name] = w if slot is None else torch.split(w, list(split_sizes(family, config)), dim=0)[slot]
    return out


def linear_weights(net) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in net.named_modules() if type(m) is torch.nn.Linear}


@pytest.fixture(params=["lumina2", "kandinsky5-image", "kandinsky5-video"], scope="module")
def trained(request, tmp_path_factory):
    """A tiny model with a LoRA whose lora_B is random, saved with the family's save_lora and read back."""
    family_name = request.param
    family = get_family(family_name)
    comps = family.load(str(tiny_model(family_name, "tiny-random")), torch.float32)
    net = comps.transformer
    base = linear_weights(net)
    torch.manual_seed(0)
    LoraAdapter(TrainConfig(model_family=family_name, max_train_steps=1, lora_rank=RANK, lora_alpha=ALPHA),
                family, net)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    folder = tmp_path_factory.mktemp(f"lora-{family_name}")
    path = family.save_lora(folder, get_peft_model_state_dict(net), net.peft_config["default"].to_dict())
    state_dict, alpha, rank = comfyui.read_diffusers_lora(path)
    return dict(family_name=family_name, family=family, comps=comps, net=net, base=base, path=path,
                state_dict=state_dict, alpha=alpha, rank=rank, folder=folder)


def test_alpha_and_rank_come_from_diffusers_metadata(trained):
    assert (trained["alpha"], trained["rank"]) == (ALPHA, RANK)
    assert all(k.startswith("transformer.") for k in trained["state_dict"])


def test_keys_are_comfyui_module_names(trained):
    fam, config = trained["family_name"], trained["net"].config
    converted = comfyui.to_comfyui(fam, trained["state_dict"], trained["alpha"], trained["rank"])
    stems = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in converted}
    # every stem has exactly lora_up, lora_down and alpha
    assert set(converted) == {f"{s}.{suffix}" for s in stems for suffix in ("lora_up.weight", "lora_down.weight", "alpha")}
    assert all(s.startswith("diffusion_model.") for s in stems)
    modules = {s[len("diffusion_model."):] for s in stems}

    # (1) the ComfyUI module set rebuilt from the diffusers model by the documented mapping ...
    rebuilt = {MODULE_OF[fam](n)[0] for n in trained["base"]}
    # (2) ... is exactly ComfyUI's own architecture (names from its source), and the LoRA keys are among them
    assert rebuilt == comfy_architecture(fam, config)
    assert modules <= rebuilt
    expected_targets = {MODULE_OF[fam](n)[0] for n, m in trained["net"].named_modules() if hasattr(m, "lora_A")}
    assert modules == expected_targets
    if fam == "lumina2":
        blocks = config.num_layers + 2 * config.num_refiner_layers
        assert len(modules) == 2 * blocks  # attention.qkv and attention.out per block
        assert all(m.endswith(("attention.qkv", "attention.out")) for m in modules)
    else:
        assert len(modules) == 4 * (config.num_text_blocks + 2 * config.num_visual_blocks)


def test_comfyui_fused_qkv_has_comfyui_shape(trained):
    if trained["family_name"] != "lumina2":
        pytest.skip("Kandinsky 5 has no fused projections")
    c = trained["net"].config
    comfy_sd = to_comfy_layout("lumina2", trained["base"])
    head_dim = c.hidden_size // c.num_attention_heads  # JointAttention: head_dim = dim // n_heads
    qkv_rows = (c.num_attention_heads + 2 * c.num_kv_heads) * head_dim
    assert comfy_sd["diffusion_model.layers.0.attention.qkv.weight"].shape == (qkv_rows, c.hidden_size)
    converted = comfyui.lumina2_to_comfyui(trained["state_dict"], trained["alpha"], trained["rank"])
    assert converted["diffusion_model.layers.0.attention.qkv.lora_up.weight"].shape == (qkv_rows, 3 * RANK)
    assert converted["diffusion_model.layers.0.attention.qkv.lora_down.weight"].shape == (3 * RANK, c.hidden_size)
    assert converted["diffusion_model.layers.0.attention.qkv.alpha"].item() == pytest.approx(3 * ALPHA)
    assert converted["diffusion_model.layers.0.attention.out.alpha"].item() == pytest.approx(ALPHA)


def test_comfyui_deltas_equal_diffusers_deltas(trained, tmp_path):
    fam = trained["family_name"]
    out = comfyui.convert_file(trained["path"], tmp_path / "comfy.safetensors", fam)
    lora = load_file(str(out))
    comfy_sd = to_comfy_layout(fam, trained["base"])
    patched, not_loaded = comfy_apply(comfy_sd, lora)
    assert not not_loaded  # ComfyUI would load every key of the file

    # the diffusers LoRA's deltas (B @ A * alpha / r), mapped onto ComfyUI's (fused) layout
    scale = ALPHA / RANK
    merged = dict(trained["base"])
    for name, (a, b) in comfyui.lora_pairs(trained["state_dict"]).items():
        merged[name] = merged[name] + scale * (b.float() @ a.float())
    expected = to_comfy_layout(fam, merged)
    assert set(expected) == set(patched)
    changed = 0
    for key in expected:
        torch.testing.assert_close(patched[key], expected[key], atol=1e-6, rtol=1e-5)
        changed += not torch.equal(patched[key], comfy_sd[key])
    assert changed == len({k.rsplit(".", 2)[0] for k in lora if k.endswith("lora_up.weight")})


def test_comfyui_patched_model_predicts_like_the_lora_model(trained):
    """End to end: ComfyUI's patched weights, put back into a fresh diffusers transformer, predict what the peft model
    predicts."""
    fam, family, comps = trained["family_name"], trained["family"], trained["comps"]
    lora = comfyui.to_comfyui(fam, trained["state_dict"], trained["alpha"], trained["rank"])
    patched, _ = comfy_apply(to_comfy_layout(fam, trained["base"]), lora)
    fresh = family.load(str(tiny_model(fam, "tiny-random")), torch.float32).transformer
    weights = from_comfy_layout(fam, fresh.config, patched, list(trained["base"]))
    with torch.no_grad():
        for n, m in fresh.named_modules():
            if n in weights:
                m.weight.copy_(weights[n])
    torch.manual_seed(1)
    shape = (2, 4, 4) if family.facts.video else (4, 4)  # video: [B, C, T, h, w]
    x = torch.randn(1, comps.vae.config.latent_channels, *shape)
    text = family.collate_text([family.encode_text(comps, ["a red square"])[0]])
    with torch.no_grad():
        ours = family.predict(trained["net"], x, torch.tensor([0.4]), text)
        theirs = family.predict(fresh, x, torch.tensor([0.4]), text)
        base = family.predict(family.load(str(tiny_model(fam, "tiny-random")), torch.float32).transformer, x,
                              torch.tensor([0.4]), text)
    assert not torch.allclose(ours, base, atol=1e-4)  # the LoRA matters
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-4)


def test_lumina2_table_inverts_diffusers_single_file_converter():
    """Every ComfyUI NextDiT Linear goes through diffusers' own original->diffusers converter to the diffusers module
    that our table maps back to it (qkv splits into to_q, to_k, to_v in that order)."""
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    for comfy_name in sorted(comfy_lumina2_linears(n_layers=2, n_refiner_layers=2)):
        fused = comfy_name.endswith("attention.qkv")
        # the converter splits qkv with Lumina-Image-2.0's sizes [2304, 768, 768]
        converted = convert_lumina2_to_diffusers({f"{comfy_name}.weight": torch.zeros(3840 if fused else 1, 1)})
        names = [k[: -len(".weight")] for k in converted]
        assert all(k.endswith(".weight") for k in converted)
        if fused:
            assert [n.rsplit(".", 1)[1] for n in names] == ["to_q", "to_k", "to_v"]
            assert [comfyui.lumina2_module(n) for n in names] == [(comfy_name, 0), (comfy_name, 1), (comfy_name, 2)]
        else:
            assert [comfyui.lumina2_module(n) for n in names] == [(comfy_name, None)]


def test_fused_qkv_with_missing_projections_and_unknown_modules():
    torch.manual_seed(0)
    dim, kv, r = 8, 4, 2
    a_q, b_q = torch.randn(r, dim), torch.randn(dim, r)
    a_v, b_v = torch.randn(r, dim), torch.randn(kv, r)
    sd = {"layers.0.attn.to_q.lora_A.weight": a_q, "layers.0.attn.to_q.lora_B.weight": b_q,
          "layers.0.attn.to_v.lora_A.weight": a_v, "layers.0.attn.to_v.lora_B.weight": b_v}
    out = comfyui.lumina2_to_comfyui(sd, alpha=2.0, rank=r)
    up = out["diffusion_model.layers.0.attention.qkv.lora_up.weight"]
    down = out["diffusion_model.layers.0.attention.qkv.lora_down.weight"]
    delta = out["diffusion_model.layers.0.attention.qkv.alpha"].item() / down.shape[0] * (up @ down)
    expected = torch.cat([b_q @ a_q, torch.zeros(kv, dim), b_v @ a_v]) * (2.0 / r)
    torch.testing.assert_close(delta, expected)

    with pytest.raises(ValueError, match="kv_dim"):
        comfyui.lumina2_to_comfyui({k: v for k, v in sd.items() if "to_q" in k}, alpha=2.0, rank=r)
    only_q = comfyui.lumina2_to_comfyui({k: v for k, v in sd.items() if "to_q" in k}, 2.0, r, kv_dim=kv)
    assert only_q["diffusion_model.layers.0.attention.qkv.lora_up.weight"].shape == (dim + 2 * kv, r)
    with pytest.raises(ValueError, match="no ComfyUI Lumina2"):
        comfyui.lumina2_to_comfyui({"context_refiner.0.norm1.linear.lora_A.weight": a_q,
                                    "context_refiner.0.norm1.linear.lora_B.weight": b_q}, 2.0, r)
    with pytest.raises(ValueError, match="no ComfyUI Kandinsky5"):
        comfyui.kandinsky5_to_comfyui({"blocks.0.attn.to_q.lora_A.weight": a_q,
                                       "blocks.0.attn.to_q.lora_B.weight": b_q}, 2.0, r)
    with pytest.raises(ValueError, match="rank"):
        comfyui.lumina2_to_comfyui(sd, alpha=2.0, rank=r + 1)


def test_a_lumina2_lora_on_to_q_alone_saves_for_comfyui(tmp_path):
    """lora_target_modules without to_k and to_v: the fused qkv gets zero k and v rows of to_k's width (the save
    failed at the run's first checkpoint, asking for a kv_dim no key could give)."""
    family = get_family("lumina2")
    comps = family.load(str(tiny_model("lumina2", "tiny-random")), torch.float32)
    net = comps.transformer
    cfg = TrainConfig(model_family="lumina2", max_train_steps=1, lora_rank=RANK, lora_alpha=ALPHA,
                      lora_format="comfyui", lora_target_modules=["to_q", "to_out.0"])
    adapter = LoraAdapter(cfg, family, net)
    path = adapter.save(tmp_path)
    saved = load_file(path.with_name("comfyui_lora.safetensors"))
    hidden, kv = net.config.hidden_size, net.config.num_kv_heads * net.config.hidden_size // \
        net.config.num_attention_heads
    assert saved["diffusion_model.layers.0.attention.qkv.lora_up.weight"].shape == (hidden + 2 * kv, RANK)
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()


def test_the_card_says_how_comfyui_reads_a_kandinsky5_diffusers_file():
    """ComfyUI maps Kandinsky 5's diffusers keys as they are but not the alpha in the metadata: at strength 1 it
    applies rank/alpha times the trained LoRA (and drops a DoRA's magnitudes)."""
    from difftune.train.model_card import _comfyui

    def card(**keys):
        return _comfyui(TrainConfig(max_train_steps=1, lora_rank=4, **keys))

    assert "set the strength to 2" in card(model_family="kandinsky5-image", lora_alpha=8)
    assert "DoRA magnitudes" in card(model_family="kandinsky5-video", lora_alpha=4, use_dora=True)
    assert "strength" not in card(model_family="kandinsky5-image", lora_alpha=4)
    assert "strength" not in card(model_family="lumina2", lora_alpha=8)
