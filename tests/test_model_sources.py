"""The model loaded from more than one place (config/model_source_keys.py, models/sources.py): a transformer from
another folder (any subfolder, or the folder itself), a Lumina2 transformer from one original-layout .safetensors
file, a VAE from elsewhere, a weight variant, and the refusals before any model loads."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, Lumina2Pipeline, Lumina2Transformer2DModel
from safetensors.torch import save_file

from conftest import config_problems, write_config
from difftune.config import load_config
from difftune.data.cache import fingerprint
from difftune.models import get_family
from difftune.models.sources import ModelSource, SourceError, hub_kwargs
from difftune.train.loop import train
from difftune.train.model_card import model_card
from difftune.train.setup import build_run

LUMINA = get_family("lumina2")


def _other_transformer(tiny: Path, seed: int, **changes) -> Lumina2Transformer2DModel:
    """The tiny model's transformer architecture (with `changes`), other random weights."""
    torch.manual_seed(seed)
    return Lumina2Transformer2DModel.from_config({**Lumina2Transformer2DModel.load_config(tiny, subfolder="transformer"),
                                                  **changes})


@pytest.fixture(scope="module")
def parts(lumina2_dir, tmp_path_factory) -> dict[str, Path]:
    """Model parts elsewhere: a transformer in a pipeline-layout folder (with a VAE of other weights beside it), one
    at the root of its folder (3 layers), one in subfolder 'dit', a standalone VAE, and the whole tiny pipeline saved
    with the fp16 weight variant."""
    root = tmp_path_factory.mktemp("parts")
    _other_transformer(lumina2_dir, 1).save_pretrained(root / "other" / "transformer")
    torch.manual_seed(2)
    vae = AutoencoderKL.from_config(AutoencoderKL.load_config(lumina2_dir, subfolder="vae"))
    vae.save_pretrained(root / "other" / "vae")
    vae.save_pretrained(root / "fixed_vae")
    _other_transformer(lumina2_dir, 3, num_layers=3).save_pretrained(root / "root_only")
    _other_transformer(lumina2_dir, 4).save_pretrained(root / "nested" / "dit")
    Lumina2Pipeline.from_pretrained(lumina2_dir).save_pretrained(root / "variant", variant="fp16")
    return {name: root / name for name in ("other", "fixed_vae", "root_only", "nested", "variant")}


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float() for k, v in module.state_dict().items()}


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_transformer_from_another_folder_and_subfolders(lumina2_dir, parts):
    tiny = str(lumina2_dir)
    default = LUMINA.load(tiny, torch.float32)
    for own, subfolder, layers in [(parts["other"], "transformer", 2), (parts["root_only"], None, 3),
                                   (parts["nested"], "dit", 2)]:
        comps = LUMINA.load(ModelSource(tiny, transformer=str(own), transformer_subfolder=subfolder), torch.float32)
        reference = Lumina2Transformer2DModel.from_pretrained(own, subfolder=subfolder)
        assert _same(comps.transformer, reference) and len(comps.transformer.layers) == layers
        assert not _same(comps.transformer, default.transformer)
        # the text encoder is the main model's: the text cache stays; so does the latent cache (same VAE)
        assert _same(comps.text["text_encoder"], default.text["text_encoder"])
        assert fingerprint(LUMINA.identity(comps)) == fingerprint(LUMINA.identity(default))
    # a subfolder of the main model itself (pretrained_transformer_subfolder alone)
    nested = parts["nested"].parent / "pipeline_dit"
    shutil.copytree(lumina2_dir, nested, ignore=shutil.ignore_patterns("transformer"))
    shutil.copytree(parts["nested"] / "dit", nested / "dit")
    comps = LUMINA.load(ModelSource(str(nested), transformer_subfolder="dit"), torch.float32)
    assert _same(comps.transformer, Lumina2Transformer2DModel.from_pretrained(parts["nested"], subfolder="dit"))


def test_vae_from_elsewhere_changes_the_latent_cache_only(lumina2_dir, parts):
    tiny = str(lumina2_dir)
    default = LUMINA.load(tiny, torch.float32)
    for vae in (parts["fixed_vae"], parts["other"]):  # the folder itself, and a pipeline's vae/
        comps = LUMINA.load(ModelSource(tiny, vae=str(vae)), torch.float32, vae_dtype=torch.bfloat16)
        assert _same(comps.vae, AutoencoderKL.from_pretrained(parts["fixed_vae"], torch_dtype=torch.bfloat16))
        assert comps.vae.dtype == torch.bfloat16  # vae_dtype applies to it
        ident, base = LUMINA.identity(comps), LUMINA.identity(default)
        assert fingerprint(ident["text"]) == fingerprint(base["text"])
        assert fingerprint(ident["vae"]) != fingerprint(base["vae"]) and ident["vae"]["source"] == str(vae)


def test_a_vae_of_other_latent_channels_is_refused_at_load(lumina2_dir, tmp_path):
    """SimpleTuner configs carry an SDXL VAE (4 latent channels) in pretrained_vae_model_name_or_path: a VAE whose
    latents the transformer cannot take is an error naming the key when it loads, not a shape error after caching;
    from its config.json, before its weights are read (the folder below has none: downloading them was for nothing)."""
    config = AutoencoderKL.load_config(lumina2_dir, subfolder="vae")
    (tmp_path / "sdxl_like").mkdir()
    (tmp_path / "sdxl_like" / "config.json").write_text(json.dumps({**config, "latent_channels":
                                                                    config["latent_channels"] * 2}))
    with pytest.raises(SourceError, match=r"pretrained_vae_model_name_or_path: .*sdxl_like makes latents of "
                                          rf"{config['latent_channels'] * 2} channels.*makes {config['latent_channels']}"):
        LUMINA.load(ModelSource(str(lumina2_dir), vae=str(tmp_path / "sdxl_like")), torch.float32)


def _original_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' Lumina2 keys back to the original (Alpha-VLLM) layout, ComfyUI's prefix in front: the inverse of
    diffusers' convert_lumina2_to_diffusers (renamed keys, q/k/v fused into one qkv)."""
    renames = [("time_caption_embed.caption_embedder", "cap_embedder"),
               ("time_caption_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
               ("time_caption_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
               ("norm_out.linear_1", "final_layer.adaLN_modulation.1"), ("norm_out.linear_2", "final_layer.linear"),
               ("norm1.norm", "attention_norm1"), ("norm1.linear", "adaLN_modulation.1"),
               (".norm1.", ".attention_norm1."), (".norm2.", ".attention_norm2."),
               ("attn.to_out.0", "attention.out"), ("attn.norm_q", "attention.q_norm"),
               ("attn.norm_k", "attention.k_norm"), ("feed_forward.linear_", "feed_forward.w")]
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if re.search(r"attn\.to_[kv]\.", key):
            continue
        if ".attn.to_q." in key:
            value = torch.cat([value, state[key.replace("to_q", "to_k")], state[key.replace("to_q", "to_v")]])
            key = key.replace("attn.to_q", "attention.qkv")
        for new, old in renames:
            key = key.replace(new, old)
        out["model.diffusion_model." + key] = value.contiguous()
    out["model.diffusion_model.norm_final.weight"] = torch.ones(1)  # in the original files, unused
    return out


def test_lumina2_single_file_in_the_original_layout(lumina2_dir, tmp_path):
    """diffusers' conversion splits qkv at the real model's sizes (2304 + 768 + 768), so the transformer here has
    them: 24 heads of 96, 8 key/value heads, one block and a tiny feed-forward (bf16 on disk: 55 MB)."""
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    main = tmp_path / "main"  # the pipeline whose transformer/config.json describes the file
    shutil.copytree(lumina2_dir, main, ignore=shutil.ignore_patterns("transformer"))
    wide = _other_transformer(lumina2_dir, 5, hidden_size=2304, num_attention_heads=24, num_kv_heads=8,
                              axes_dim_rope=(32, 32, 32), num_layers=1, num_refiner_layers=0,
                              ffn_dim_multiplier=0.001).to(torch.bfloat16)
    wide.save_config(main / "transformer")
    original = _original_layout(wide.state_dict())
    prefix = "model.diffusion_model."  # diffusers' converter strips it, then looks the keys up with it: drop it here
    converted = convert_lumina2_to_diffusers({k.removeprefix(prefix): v for k, v in original.items()})
    assert converted.keys() == wide.state_dict().keys()  # the inversion is exact
    save_file(original, tmp_path / "finetune.safetensors")
    where = ModelSource(str(main), transformer=str(tmp_path / "finetune.safetensors"))
    comps = LUMINA.load(where, torch.bfloat16)
    assert _same(comps.transformer, wide)
    assert where.transformer_identity()["transformer"].endswith("finetune.safetensors")
    # a file of another model: refused, naming the key, not left half-loaded
    save_file({"model.diffusion_model.something.weight": torch.zeros(2)}, tmp_path / "wrong.safetensors")
    with pytest.raises(SourceError, match="pretrained_transformer_model_name_or_path: .* does not hold a Lumina2Transformer2DModel"):
        LUMINA.load(ModelSource(str(main), transformer=str(tmp_path / "wrong.safetensors")), torch.bfloat16)


def test_variant(lumina2_dir, parts):
    assert (parts["variant"] / "transformer" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    comps = LUMINA.load(ModelSource(str(parts["variant"]), variant="fp16"), torch.float32)
    default = LUMINA.load(str(lumina2_dir), torch.float32)
    assert _same(comps.transformer, default.transformer) and _same(comps.vae, default.vae)
    assert fingerprint(LUMINA.identity(comps)["vae"]) != fingerprint(LUMINA.identity(default)["vae"])
    with pytest.raises(SourceError, match="variant 'fp16'.*no fp16 weight file.*remove variant"):
        LUMINA.load(ModelSource(str(lumina2_dir), variant="fp16"), torch.float32)


def test_revision_goes_to_hub_ids_only():
    where = ModelSource("owner/model", transformer="owner/finetune", revision="abc123", variant="fp16")
    assert hub_kwargs(where, "owner/model") == {"revision": "abc123", "variant": "fp16"}
    assert hub_kwargs(where, "owner/model", weights=False) == {"revision": "abc123"}
    assert hub_kwargs(where, str(Path(__file__).parent)) == {"variant": "fp16"}  # a local folder: no revision


def test_refused_before_any_model_loads(tmp_path, dataset, parts, lumina2_dir):
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "k5.safetensors").write_bytes(b"x")
    transformer, subfolder, vae = ("pretrained_transformer_model_name_or_path", "pretrained_transformer_subfolder",
                                   "pretrained_vae_model_name_or_path")
    cases = [  # (keys, the key the problem names, what it says)
        ({transformer: str(tmp_path / "missing")}, transformer, "does not exist"),
        ({transformer: str(tmp_path / "missing.safetensors")}, transformer, "does not exist"),
        ({transformer: str(tmp_path / "weights.bin")}, transformer, "not a .safetensors"),
        ({transformer: str(parts["nested"])}, subfolder, "set pretrained_transformer_subfolder to one of ['dit']"),
        ({transformer: str(parts["other"]), subfolder: "none"}, transformer, f"set {subfolder} to the subfolder"),
        ({"model_family": "kandinsky5-image", transformer: str(tmp_path / "k5.safetensors")}, transformer,
         "diffusers cannot load a kandinsky5-image transformer from one"),
        ({transformer: str(tmp_path / "k5.safetensors"), subfolder: "dit"}, subfolder, "does not apply to a single"),
        ({vae: str(tmp_path / "weights.bin")}, vae, "is a file"),
        ({vae: str(tmp_path)}, vae, "neither vae/config.json nor config.json"),
        ({vae: "./nowhere"}, vae, "does not exist"),
        ({"revision": "main"}, "revision", "tiny model is built locally"),
        ({"revision": "main", "pretrained_model_name_or_path": str(lumina2_dir)}, "revision",
         "local folder, which has no revisions"),
    ]
    for keys, named, message in cases:
        text = config_problems(write_config(tmp_path / "c", dataset, **keys))
        assert message in text and f"{named}" in text, (keys, text)
    cfg = load_config(write_config(tmp_path / "ok", dataset, pretrained_transformer_model_name_or_path=str(
        parts["root_only"]), pretrained_transformer_subfolder="None", pretrained_vae_model_name_or_path=str(
        parts["fixed_vae"]), revision="", variant=""))
    assert cfg.train.pretrained_transformer_subfolder is None and cfg.train.revision is None


def test_train_with_a_transformer_from_elsewhere(tmp_path, dataset, parts):
    """A one-step run on another transformer and VAE with validation on: it trains those weights, samples with them,
    names them on the model card; `difftune plan` reads their config. Resumed on the main model's transformer: the
    caches are reused and the change is warned about."""
    from difftune.cli import main
    from difftune.memory_plan import architecture

    common = dict(max_train_steps=1, checkpoint_step_interval=1, resume_from_checkpoint="latest",
                  pretrained_vae_model_name_or_path=str(parts["fixed_vae"]))
    plan = write_config(tmp_path / "plan", dataset, pretrained_transformer_model_name_or_path=str(parts["root_only"]),
                        pretrained_transformer_subfolder="none")
    assert architecture.architecture_of(load_config(plan).train).config["num_layers"] == 3  # the plan's transformer
    assert main(["plan", "--config", str(plan), "--gpu-memory", "80"]) == 0
    path = write_config(tmp_path, dataset, **common, validation_prompt="a red circle", validation_resolution="32x32",
                        validation_num_inference_steps=1, validation_disable_unconditional=True,
                        pretrained_transformer_model_name_or_path=str(parts["other"]))
    run_cfg = load_config(path)
    run = build_run(run_cfg)
    trained = {k.replace(".base_layer", ""): v for k, v in run.comps.transformer.state_dict().items() if "lora" not in k}
    assert all(torch.equal(trained[k], v) for k, v in Lumina2Transformer2DModel.from_pretrained(
        parts["other"], subfolder="transformer").state_dict().items())
    assert _same(run.comps.vae, AutoencoderKL.from_pretrained(parts["fixed_vae"]))  # validation decodes with it
    train(run)
    assert [p.name for p in (run.output_dir / "validation").glob("*.png")] == ["final-step-000001-32x32.png"]
    card = model_card(run_cfg, run, [])
    assert f"transformer `{parts['other']}`" in card and f'from_pretrained("{parts["other"]}", subfolder=' in card
    assert (run.output_dir / "checkpoints" / "checkpoint-0000001" / "model_source.json").is_file()
    # resumed on the transformer of pretrained_model_name_or_path: warned, naming what changed; caches reused
    train(build_run(load_config(write_config(tmp_path, dataset, **{**common, "max_train_steps": 2}))))
    events = [json.loads(line) for line in (run.output_dir / "events.jsonl").read_text().splitlines()]
    warned = [e["message"] for e in events if e["event"] == "warning" and "another transformer" in e["message"]]
    assert len(warned) == 1 and f"transformer: '{parts['other']}' then, None now" in warned[0]
    cached = [e["message"] for e in events if e["event"] == "info" and "cache:" in e["message"]]
    assert cached[-2:] == ["text cache: 4 captions, 3 distinct: 3 from the cache, 0 newly encoded",
                           "latent cache: 4 files: 4 from the cache, 0 newly encoded"], cached


@pytest.mark.parametrize("family", ["kandinsky5-image", "kandinsky5-video"])
def test_kandinsky5_transformer_and_vae_from_elsewhere(family, tmp_path):
    from diffusers import Kandinsky5Transformer3DModel

    from difftune.models import tiny_model

    loader, tiny = get_family(family), str(tiny_model(family, "tiny-random"))
    torch.manual_seed(9)
    other = Kandinsky5Transformer3DModel.from_config(Kandinsky5Transformer3DModel.load_config(tiny, subfolder="transformer"))
    other.save_pretrained(tmp_path / "dit")
    default = loader.load(tiny, torch.float32)
    comps = loader.load(ModelSource(tiny, transformer=str(tmp_path / "dit"), transformer_subfolder=None, vae=tiny),
                        torch.float32)
    assert _same(comps.transformer, other) and not _same(comps.transformer, default.transformer)
    assert _same(comps.vae, default.vae)  # the pipeline folder's vae/
    assert fingerprint(loader.identity(comps)["text"]) == fingerprint(loader.identity(default)["text"])


def test_new_weights_saved_over_a_local_model_make_new_cache_entries(tmp_path, dataset):
    """A fine-tuned VAE or text encoder saved into the same local folder: the caches were keyed by the folder's
    path and the components' configs, so the old latents and embeddings were reused silently."""
    from safetensors.torch import load_file

    from difftune.cli import main
    from difftune.models import tiny_model

    folder = tmp_path / "model"
    shutil.copytree(tiny_model("lumina2", "tiny-random"), folder)
    path = write_config(tmp_path, dataset, pretrained_model_name_or_path=str(folder))

    def cache_lines() -> list[str]:
        assert main(["cache", "--config", str(path)]) == 0
        events = [json.loads(line) for line in (tmp_path / "output" / "events.jsonl").read_text().splitlines()]
        return [e["message"] for e in events if e["event"] == "info" and "cache:" in e["message"]][-2:]

    assert cache_lines()[1] == "latent cache: 4 files: 0 from the cache, 4 newly encoded"
    assert cache_lines()[1] == "latent cache: 4 files: 4 from the cache, 0 newly encoded"
    weights = next((folder / "vae").glob("*.safetensors"))
    save_file({k: v * 1.5 for k, v in load_file(weights).items()}, weights)
    text, latents = cache_lines()
    assert latents == "latent cache: 4 files: 0 from the cache, 4 newly encoded"
    assert "0 newly encoded" in text  # the text encoders did not change
    encoder = next((folder / "text_encoder").glob("*.safetensors"))
    save_file({k: v * 1.5 for k, v in load_file(encoder).items()}, encoder)
    text, latents = cache_lines()
    assert text.endswith("0 from the cache, 3 newly encoded") and latents.endswith("4 from the cache, 0 newly encoded")


def test_check_reads_a_local_folders_pipeline_class_before_loading(tmp_path, dataset, no_model_loads):
    """An image-to-video folder with a text-to-video flavour passed `check` and failed only after loading; a
    Kandinsky 5 folder given as Lumina2 failed deep in loading. Both are config errors now."""
    from difftune.models import tiny_model

    i2v = tiny_model("kandinsky5-video", "tiny-random-i2v")
    text = config_problems(write_config(tmp_path, dataset, model_family="kandinsky5-video",
                                        pretrained_model_name_or_path=str(i2v)))
    assert "holds a Kandinsky5I2VPipeline (image-conditioned (i2i/i2v)) model, but model_flavour " \
           "'tiny-random' trains Kandinsky5T2VPipeline" in text
    text = config_problems(write_config(tmp_path, dataset, pretrained_model_name_or_path=str(i2v)))
    assert "a kandinsky5-video model, not a lumina2 one; set model_family to 'kandinsky5-video'" in text
    older = tmp_path / "lumina"  # diffusers' earlier name of Lumina2's pipeline: not refused
    older.mkdir()
    (older / "model_index.json").write_text(json.dumps({"_class_name": "Lumina2Text2ImgPipeline"}))
    from difftune.config.model_source_keys import _check_pipeline_class

    found: list[str] = []
    _check_pipeline_class(load_config(write_config(tmp_path, dataset)).train.model_copy(
        update={"pretrained_model_name_or_path": str(older)}), lambda key: "here", found)
    assert found == []


@pytest.mark.parametrize("error,said", [
    ("LocalEntryNotFoundError", "cannot reach the Hugging Face hub, and the model is not in the local cache"),
    ("RepositoryNotFoundError", "no such repository on the Hugging Face hub, or a private one"),
    ("GatedRepoError", "a gated repository: accept its terms on https://huggingface.co/owner/name"),
    ("RevisionNotFoundError", "revision 'v9' does not exist there")])
def test_hub_failures_of_the_first_download_are_one_line_with_the_fix(monkeypatch, error, said):
    """No network (an offline node) ended `difftune train` in a huggingface_hub traceback after `check` said OK."""
    import huggingface_hub
    from huggingface_hub import errors

    from difftune.models.hub import ComponentError, model_index

    def fails(*args, **kwargs):
        if error == "LocalEntryNotFoundError":
            raise errors.LocalEntryNotFoundError("the library's own words")
        import httpx

        response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/owner/name"))
        raise getattr(errors, error)("the library's own words", response=response)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fails)
    with pytest.raises(ComponentError) as info:
        model_index("owner/name", revision="v9")
    assert str(info.value).startswith("owner/name: ") and said in str(info.value)
