"""`difftune plan` (memory_plan/): weights exact against the loaded, quantized tiny model; activations within
tolerance of what autograd really saves; monotone lever choice; the CLI's tables and exit status."""

from __future__ import annotations

import pytest
import torch

from conftest import write_config
from difftune.cli import PLAN_DOES_NOT_FIT, main
from difftune.config import load_config
from difftune.memory_plan import architecture as A
from difftune.memory_plan import measure
from difftune.memory_plan.levers import _valid, choose, ladder
from difftune.memory_plan.predict import (
    GIB,
    _transformer,
    activation_bytes,
    block_bytes,
    coefficients_for,
    predict,
    tokens_of,
)
from difftune.models.quantize import QUANTIZERS, weight_bytes


def loaded_transformer(cfg):
    from diffusers import Lumina2Transformer2DModel

    return Lumina2Transformer2DModel.from_pretrained(A.architecture_of(cfg).name, subfolder="transformer",
                                                     torch_dtype=torch.bfloat16)


@pytest.mark.parametrize("precision", ["no_change", "int8-quanto", "int8-torchao"])
def test_transformer_bytes_exact(tiny_cfg, precision):
    """The planner's bytes equal the whole loaded transformer's after models/quantize.py quantizes it."""
    cfg = tiny_cfg.train
    model = loaded_transformer(cfg)
    if precision != "no_change":
        from difftune.models.quantize import quantized_layers

        QUANTIZERS[precision](model, quantized_layers(model))
    predicted = _transformer(A.architecture_of(cfg), "bf16", precision)[0]
    assert predicted == weight_bytes(model)


def test_adapter_parameters_exact(tiny_cfg):
    """LoRA parameters: the count adapters/kinds.py trains on the loaded model."""
    from difftune.adapters.kinds import build_adapter
    from difftune.models import get_family

    cfg = tiny_cfg.train
    adapter = build_adapter(cfg, get_family(cfg.model_family), loaded_transformer(cfg))
    prediction = predict(cfg, None)
    line = next(li for li in prediction.phase("training").lines if li.label.startswith("adapter"))
    assert line.bytes == sum(p.numel() for p in adapter.parameters()) * 4


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_within_tolerance(tiny_cfg, checkpointing):
    """Saved activations predicted (fitted on 2 blocks per stack at two other token counts) against autograd's
    saved tensors in the whole tiny model at the bucket, computed for real in bf16."""
    cfg = tiny_cfg.train.model_copy(update={"gradient_checkpointing": checkpointing, "train_batch_size": 2})
    arch = A.architecture_of(cfg)
    blocks = _transformer(arch, "bf16", "no_change")[1]
    model = loaded_transformer(cfg)
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_rank,
                                 target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    latent, text = (1, 24, 16), 40
    measured = measure.saved_by_block(arch, model, latent, text, checkpointing, batch=2, backward=True)
    saved, transient, _ = activation_bytes(cfg, arch, blocks, tokens_of(arch, (128, 192)), text,
                                           coefficients_for(arch)[0])
    assert saved == pytest.approx(sum(measured.values()), rel=0.15)
    assert (transient > 0) == checkpointing


@pytest.mark.parametrize("family,checkpointing", [("lumina2", False), ("lumina2", True),
                                                  ("kandinsky5-video", False), ("kandinsky5-video", True)])
def test_tread_lowers_activations_as_autograd_sees(tiny_cfg, family, checkpointing):
    """tread_config: the routed blocks save at the tokens they keep (checkpointed: a route's first block keeps its
    full-size input). What the route saves (the whole tiny model's autograd-saved bytes without it less with it,
    TREAD hooked as training hooks it) matches the planner's difference; before TREAD was planned, the prediction
    did not move at all. Lumina2 (2 joint blocks, the last routed), Kandinsky 5 video (4 visual blocks, 3 routed)."""
    import diffusers
    from peft import LoraConfig

    from difftune.config.experimental import TreadConfig
    from difftune.models import get_family
    from difftune.train import tread

    route = TreadConfig(routes=[{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -1}])
    plain_cfg = tiny_cfg.train.model_copy(update={"gradient_checkpointing": checkpointing, "train_batch_size": 2,
                                                  "model_family": family})
    routed_cfg = plain_cfg.model_copy(update={"tread_config": route})
    arch = A.architecture_of(plain_cfg)
    blocks = _transformer(arch, "bf16", "no_change")[1]
    fam = get_family(family)
    latent, text = (3, 24, 16), 40  # Lumina2 96 image tokens (48 routed), K5 video 3 latent frames of 96
    bucket = (128, 192, 9) if family == "kandinsky5-video" else (128, 192)
    measured = {}
    for name, cfg in (("plain", plain_cfg), ("routed", routed_cfg)):
        cls = getattr(diffusers, A.TRANSFORMER_CLASS[family])
        model = cls.from_pretrained(arch.name.removesuffix("/transformer"), subfolder="transformer",
                                    torch_dtype=torch.bfloat16)
        model.requires_grad_(False)
        targets = fam.lora_target_modules
        model.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_rank,
                                     target_modules=targets if isinstance(targets, str) else list(targets)))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        model.train()  # TREAD routes only training calls
        if cfg.tread_config is not None:
            tread.attach(cfg.tread_config, fam, model, torch.Generator().manual_seed(0), False)
        measured[name] = sum(measure.saved_by_block(arch, model, latent, text, checkpointing, batch=2).values())
    coefficients = coefficients_for(arch)[0]
    tokens = tokens_of(arch, bucket)
    plain, plain_transient, _ = activation_bytes(plain_cfg, arch, blocks, tokens, text, coefficients)
    routed, routed_transient, note = activation_bytes(routed_cfg, arch, blocks, tokens, text, coefficients)
    assert f"TREAD: {blocks.count[predict_stack(family)] - 1} of" in note
    assert plain - routed == pytest.approx(measured["plain"] - measured["routed"], rel=0.2)
    assert routed == pytest.approx(measured["routed"], rel=0.15)
    assert routed_transient == plain_transient  # block 0 is not routed: the largest recomputed block is unchanged
    if not (family == "lumina2" and checkpointing):  # there the one routed block keeps its full input: no saving
        assert measured["plain"] - measured["routed"] > 0.05 * measured["plain"]
        assert predict(routed_cfg, None).phase("training").total < predict(plain_cfg, None).phase("training").total


def test_tread_never_routes_the_input_frame_of_image_to_video(tiny_cfg):
    """Kandinsky 5 Video Lite at real size (meta), 768x512x81f (21 latent frames of 1536 tokens): TREAD 0.5 keeps
    half of all 32256 tokens for text-to-video, and the input frame plus half of the rest for image-to-video."""
    from types import SimpleNamespace as NS

    from difftune.config.experimental import TreadConfig

    route = TreadConfig(routes=[{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}])
    found = [NS(held_out=False, regularisation=False, on_the_fly=False, samples=[NS(group=(768, 512, 81))])]
    for flavour, kept in (("t2v-lite-sft-5s", 16128), ("i2v-lite-5s", 1536 + 15360)):
        cfg = tiny_cfg.train.model_copy(update={"model_family": "kandinsky5-video", "model_flavour": flavour,
                                                "tread_config": route, "lora_rank": 16})
        line = next(li for li in predict(cfg, found).phase("training").lines if li.label == "saved activations")
        assert f"TREAD: 29 of 32 visual_transformer_blocks at {kept} image tokens" in line.note


def predict_stack(family):
    from difftune.memory_plan.predict import TREAD_STACK
    from difftune.models import get_family

    return TREAD_STACK[get_family(family).tread_layout]


def test_no_lever_when_it_fits(tiny_cfg):
    cfg = tiny_cfg.train
    peak = predict(cfg, None).peak
    choice = choose(cfg, None, peak / GIB * 1.01)
    assert choice.fits and choice.steps == []


def test_levers_monotone_and_cheapest_first(tiny_cfg):
    """Lumina2 2.0 at real size (meta models, no weights): more memory never needs more levers, every answer's
    predicted peak fits, the free rung comes first, checkpointing saves the most, and at 24 GiB it alone is
    enough."""
    cfg = tiny_cfg.train.model_copy(update={"model_flavour": "2.0", "validation_resolution": "1024x1024",
                                            "lora_rank": 16})
    before = predict(cfg, None)
    assert 20 * GIB < before.peak < 40 * GIB  # 2.6B bf16 (~4.9 GiB) + ~20 GiB of activations at 1024 px
    assert ladder(cfg, before, 1)[:2] == [[{"offload_during_startup": True}],
                                          [{"offload_during_startup": True, "gradient_checkpointing": True}]]
    counts = []
    for gigabytes in (80, 32, 24, 12, 8, 6, 4, 2):
        choice = choose(cfg, None, gigabytes, 1, before)
        if not choice.fits:
            assert gigabytes <= 4 and "nothing fits" in choice.message
            continue
        assert choice.after.peak <= gigabytes * GIB
        counts.append(len(choice.steps))
        if choice.steps:  # checkpointing is always among them, and saves the most (~20 GiB of activations)
            assert max(choice.steps, key=lambda s: s.saving).key == "gradient_checkpointing"
            assert choice.settings()["gradient_checkpointing"] is True
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] >= 2
    assert choose(cfg, None, 24, 1, before).settings() == {"gradient_checkpointing": True}


def test_cli_plan_output_and_exit(tiny_cfg, capsys, tmp_path):
    from difftune.demo import make_dataset

    make_dataset(tmp_path / "images", count=2)
    path = write_config(tmp_path, tmp_path / "images", mixed_precision="bf16", validation_resolution="64x64",
                        validation_prompt="a cat")
    assert main(["plan", "--config", str(path), "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    for phase in ("caching: text", "caching: latents", "training", "validation", "predicted peak"):
        assert phase in out
    assert "no lever needed" in out
    # without a prompt nothing is sampled: no validation phase to plan levers for (K5 Pro at 16 GiB was planned
    # 48 swapped blocks for a sampling phase that never ran)
    unprompted = write_config(tmp_path, tmp_path / "images", mixed_precision="bf16", validation_resolution="64x64")
    assert main(["plan", "--config", str(unprompted), "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "predicted: validation" not in out and "no validation phase: no validation_prompt" in out
    assert main(["plan", "--config", str(path), "--gpu-memory", "0.0001"]) == PLAN_DOES_NOT_FIT
    assert "nothing fits" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("family,flavour", [("lumina2", "2.0"), ("kandinsky5-image", "t2i-lite-sft")])
def test_real_size_blocks_match_measurement(family, flavour):
    """At real width, per-block saved activations computed for real (bf16, matmuls emulated in fp32) at a token
    count the coefficients were not fitted on: within 15% of coefficients.py."""
    name, config = A.real_architecture(family, flavour)
    arch = A.Architecture(family, name, config, known=True)
    coefficients = coefficients_for(arch)[0]
    model = measure.reduced_model(arch, "lora")
    latent, text = measure.CHECK_LAYOUT
    tokens = measure.image_tokens(family, config, latent)
    for checkpointing in (False, True):
        found = measure.per_stack(measure.saved_by_block(arch, model, latent, text, checkpointing))
        table = coefficients["checkpointed" if checkpointing else "lora"]
        for stack, size in found.items():
            if stack == "outside":
                continue
            predicted = block_bytes(table, stack, tokens, text)
            print(f"{name} {stack} checkpointing={checkpointing}: measured {size / 2**20:.2f} MiB, "
                  f"predicted {predicted / 2**20:.2f} MiB")
            assert predicted == pytest.approx(size, rel=0.15), (stack, checkpointing)


def test_web_ui_plans_the_edited_config(tmp_path):
    """POST /api/config/plan: the planner's prediction and choice for the form's config; a config with problems
    is not planned."""
    import json

    from fastapi.testclient import TestClient

    from difftune.demo import make_dataset
    from difftune.ui.server import create_app

    root = tmp_path / "root"
    make_dataset(root / "images", count=2)
    path = write_config(root, root / "images", mixed_precision="bf16", validation_resolution="64x64",
                        train_batch_size=16,  # the training step's activations are the peak
                        allow_dataset_oversubscription=True)  # 2 images fill a batch of 16 (else no bucket trains)
    client = TestClient(create_app([root], state_dir=tmp_path / "state"), raise_server_exceptions=False, base_url="http://localhost")
    body = {"path": str(path), "config": json.loads(path.read_text()),
            "datasets": json.loads((root / "config" / "multidatabackend.json").read_text())}
    answer = client.post("/api/config/plan", json=body).json()
    assert answer["ok"] and answer["plan"]["peak_bytes"] > 0 and "choice" not in answer["plan"]
    peak = answer["plan"]["peak_bytes"]
    tight = client.post("/api/config/plan", json={**body, "gpu_memory": peak * 0.8 / GIB}).json()["plan"]["choice"]
    assert tight["fits"] and tight["settings"] == {"gradient_checkpointing": True}
    assert tight["peak_bytes_after"] <= peak * 0.8
    body["config"]["learning_rate"] = "fast"
    refused = client.post("/api/config/plan", json=body).json()
    assert not refused["ok"] and refused["plan"] is None


# --- real size (the CREPA lines: test_memory_plan_crepa.py) ---------------------------------------------


def test_vae_dtype_sizes_the_vae(real_cfg):
    """vae_dtype fp32 on bf16 weights: the VAE lines of caching and validation count it in fp32 (twice bf16)."""
    def vae_lines(cfg):
        prediction = predict(cfg, None)
        return [line.bytes for phase in prediction.phases for line in phase.lines if line.label == "VAE"]

    bf16, fp32 = vae_lines(real_cfg), vae_lines(real_cfg.model_copy(update={"vae_dtype": "fp32"}))
    assert bf16 and len(bf16) == len(fp32) and all(b == 2 * a for a, b in zip(bf16, fp32, strict=True))


def test_activation_offload_moves_the_checkpointed_inputs_off_the_accelerator(real_cfg):
    """gradient_checkpointing_backend 'unsloth': the checkpointed blocks' inputs leave the saved activations; the
    backward holds two of them (the recomputed block's and the prefetched one)."""
    offloaded = real_cfg.model_copy(update={"gradient_checkpointing_backend": "unsloth"})
    arch = A.architecture_of(real_cfg)
    blocks = _transformer(arch, "bf16", "no_change")[1]
    coefficients = coefficients_for(arch)[0]
    tokens, text = tokens_of(arch, (1024, 1024)), 256
    saved, transient, _ = activation_bytes(real_cfg, arch, blocks, tokens, text, coefficients)
    saved_off, transient_off, note = activation_bytes(offloaded, arch, blocks, tokens, text, coefficients)
    batch = real_cfg.train_batch_size
    entering = [block_bytes(coefficients["checkpointed"], s, tokens, text) * batch for s, n in blocks.count.items()
                for _ in range(n)]
    assert saved - saved_off == pytest.approx(sum(entering), rel=1e-6)
    assert transient_off - transient == pytest.approx(2 * max(entering), rel=1e-6)
    assert "CPU memory" in note
    assert predict(offloaded, None).phase("training").total < predict(real_cfg, None).phase("training").total


def test_levers_take_activation_offload_before_int8(real_cfg):
    """Activation offload costs no quality: tried right after checkpointing, and chosen alone where it is enough."""
    real_cfg = real_cfg.model_copy(update={"train_batch_size": 8})  # activations, not text caching, set the peak
    offloaded = real_cfg.model_copy(update={"gradient_checkpointing_backend": "unsloth"})
    rungs = ladder(real_cfg, predict(real_cfg, None), 1)
    keys = [next(iter(r[0].keys() - rungs[i - 1][0].keys()), None) if i else None for i, r in enumerate(rungs)]
    assert keys.index("gradient_checkpointing_backend") + 1 == keys.index("base_model_precision")
    high, low = predict(real_cfg, None).peak, predict(offloaded, None).peak
    assert low < high
    choice = choose(real_cfg, None, (high + low) / 2 / GIB)
    assert choice.fits and choice.settings() == {"gradient_checkpointing_backend": "unsloth"}
    assert "overlap" in choice.steps[0].why


def test_dora_on_bf16_weights_is_planned_with_the_quantization_it_takes(real_cfg):
    """DoRA on bf16 weights refuses optimum-quanto (config/lora_keys.py): the ladder carried int8-quanto into every
    later rung, so none was valid and "nothing fits" where int8-torchao fits, and streaming too."""
    dora = real_cfg.model_copy(update={"use_dora": True, "mixed_precision": "bf16",
                                       "base_model_default_dtype": "bf16"})
    assert dora.weight_dtype_name() == "bf16"
    rungs = ladder(dora, predict(dora, None), 1)
    assert all(_valid(dora, changes) is not None for rung in rungs for changes in rung)
    assert {c.get("base_model_precision") for rung in rungs for c in rung} >= {"int8-torchao", "nf4-bnb"}
    choice = choose(dora, None, 6)
    assert choice.fits and choice.settings()["base_model_precision"] == "int8-torchao", choice.message
    plain = real_cfg.model_copy(update={"mixed_precision": "bf16", "base_model_default_dtype": "bf16"})
    assert choose(plain, None, 6).settings()["base_model_precision"] == "int8-quanto"  # quanto first elsewhere


def test_optimizer_offload_moves_the_state_off_the_accelerator_and_is_the_full_fine_tunes_last_rung(real_cfg):
    """optimizer_cpu_offload_method 'cpu': the training and validation phases lose exactly the optimizer state; a
    full fine-tune that 8-bit state does not fit gets it (Lumina2 at 1024 px in 16 GiB, the spec's full fine-tune)."""
    full = real_cfg.model_copy(update={"model_type": "full", "optimizer": "adamw_bf16"})
    offloaded = full.model_copy(update={"optimizer_cpu_offload_method": "cpu"})
    plain, off = predict(full, None), predict(offloaded, None)
    state = next(line.bytes for line in plain.phase("training").lines if line.label.startswith("optimizer state"))
    assert state == 3 * next(line.bytes for line in plain.phase("training").lines if line.label == "gradients")
    line = next(line for line in off.phase("training").lines if line.label.startswith("optimizer state"))
    assert line.bytes == 0 and "CPU memory" in line.note
    for phase in ("training", "validation"):
        assert plain.phase(phase).total - off.phase(phase).total == state
    assert predict(full.model_copy(update={"optimizer": "adamw8bit"}), None).peak > 16 * GIB > off.peak
    choice = choose(full, None, 16)
    assert choice.fits and choice.settings() == {"optimizer_cpu_offload_method": "cpu"}
    assert not choose(real_cfg, None, 16).settings().get("optimizer_cpu_offload_method")  # LoRA: never proposed


def test_offloaded_gradients_leave_the_training_phase_and_are_the_next_alternative(real_cfg):
    full = real_cfg.model_copy(update={"model_type": "full", "optimizer": "adamw_bf16",
                                       "optimizer_cpu_offload_method": "cpu"})
    both = full.model_copy(update={"optimizer_offload_gradients": True})
    grads = next(line.bytes for line in predict(full, None).phase("training").lines if line.label == "gradients")
    line = next(line for line in predict(both, None).phase("training").lines if line.label == "gradients")
    assert grads > 0 and line.bytes == 0 and "CPU memory" in line.note
    assert predict(full, None).phase("training").total - predict(both, None).phase("training").total == grads
    plain = full.model_copy(update={"optimizer_cpu_offload_method": "none"})
    limit = (predict(both, None).peak + predict(full, None).peak) / 2 / GIB  # only the gradients' rung fits
    choice = choose(plain, None, limit)
    assert choice.fits and choice.settings() == {"optimizer_cpu_offload_method": "cpu",
                                                 "optimizer_offload_gradients": True}
    assert choose(plain, None, limit, processes=2).settings().get("optimizer_offload_gradients") is None


def test_building_the_measured_model_prints_no_diffusers_cast_warning(tiny_cfg):
    """diffusers' ModelMixin.to warns "should be kept in float32" on every dtype cast; the wizard's memory step
    printed it twice between its questions. The planner casts with torch's own `to` and keeps diffusers' fp32
    modules itself (as from_pretrained(bf16) does), so the model measured is the same."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        model = measure.build_real(A.architecture_of(tiny_cfg.train))
    finally:
        logger.removeHandler(handler)
    assert not [r.getMessage() for r in records if "kept in float32" in r.getMessage()]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("flavour", ["i2i-lite-sft", "i2i-lite-pretrain"])
def test_image_to_image_flavours_plan_with_the_text_to_image_measurement(flavour):
    """Their only difference, visual_cond, widens the patch embedder's input: `difftune plan` refused them ("too
    large to measure now") with advice no command could follow."""
    arch = A.real_architecture("kandinsky5-image", flavour)
    assert arch is not None and arch[0] == "K5 Image Lite (i2i)" and arch[1]["visual_cond"] is True
    coefficients, source = coefficients_for(A.Architecture("kandinsky5-image", arch[0], arch[1], known=True))
    from difftune.memory_plan.coefficients import COEFFICIENTS

    assert source == "measured on K5 Image Lite (coefficients.py)" and coefficients is COEFFICIENTS["K5 Image Lite"]


def test_choose_drops_checkpointing_a_later_rung_made_needless(tmp_path):
    """K5 Video Pro at 24 GiB: int8 and offload_during_startup fit without checkpointing. One pruning pass kept
    checkpointing because activation offload (a later rung, which needs it) was still in the set when it was tried."""
    from families import make_clips

    clips = make_clips(tmp_path / "clips")
    cfg = load_config(write_config(
        tmp_path, clips, model_family="kandinsky5-video", model_flavour="t2v-pro-sft-10s-hd", mixed_precision="bf16",
        validation_resolution="32x32", validation_num_video_frames=5,
        dataset={"dataset_type": "video", "resolution": 64, "video": {"num_frames": 9}})).train
    choice = choose(cfg, None, 24)
    assert choice.fits and not choice.settings().get("gradient_checkpointing"), choice.settings()
    assert choice.settings() == {"offload_during_startup": True, "base_model_precision": "int8-quanto"}


def test_nothing_fits_names_the_phase_still_over_and_what_helps_it(tmp_path):
    """K5 Image at 12 GiB on 4 processes: the text encoders' caching phase is over, which FSDP does not divide;
    the message said to add processes."""
    from difftune.demo import make_dataset

    make_dataset(tmp_path / "images", count=2)
    cfg = load_config(write_config(tmp_path, tmp_path / "images", model_family="kandinsky5-image",
                                   model_flavour="t2i-lite-sft", mixed_precision="bf16")).train
    choice = choose(cfg, None, 12, 4)
    assert not choice.fits and "GiB (caching: text)" in choice.message
    assert "more processes do not divide the text encoders" in choice.message and "fsdp_enable" not in choice.message


def test_plan_takes_world_size_as_check_does(tmp_path, monkeypatch, capsys):
    """`WORLD_SIZE=2 difftune plan` planned one process (and its buckets) while `difftune check` planned two."""
    from difftune.demo import make_dataset

    make_dataset(tmp_path / "images", count=8)
    path = write_config(tmp_path, tmp_path / "images", train_batch_size=5)
    assert main(["plan", "--config", str(path)]) == 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["plan", "--config", str(path)]) == 2
    assert "buckets planned for 2 process(es) (WORLD_SIZE)" in capsys.readouterr().err


def test_full_fine_tune_of_bf16_weights_is_planned_with_a_kahan_optimizer(real_cfg):
    """The planner advised adamw8bit for a bf16 full fine-tune, and training then warned that it loses small
    updates (use adamw_bf16): the advice now follows the trainer's rule, and 8-bit state is kept for fp32 weights."""
    from difftune.memory_plan.levers import lossless_optimizer

    full = real_cfg.model_copy(update={"model_type": "full", "optimizer": "adamw"})
    assert full.weight_dtype_name() == "bf16" and lossless_optimizer(full) == {"optimizer": "adamw_bf16"}
    for gigabytes in (16, 24, 80):
        choice = choose(full, None, gigabytes)
        assert choice.fits and choice.settings()["optimizer"] == "adamw_bf16", gigabytes
        assert choice.steps[0].key == "optimizer" and "loses small updates" in choice.steps[0].why
        assert choice.after.peak <= gigabytes * GIB
    assert choose(full.model_copy(update={"optimizer": "lion"}), None, 80).settings() == {"optimizer": "optimi-lion"}
    assert lossless_optimizer(full.model_copy(update={"optimizer": "adamw_bf16"})) == {}
    assert lossless_optimizer(real_cfg) == {}  # LoRA: the base weights are frozen
    fp32 = full.model_copy(update={"mixed_precision": "no"})
    assert fp32.weight_dtype_name() == "fp32" and lossless_optimizer(fp32) == {}
    rungs = ladder(fp32, predict(fp32, None), 1)
    assert any(r[0].get("optimizer") == "adamw8bit" for r in rungs)
    assert not any(r[0].get("optimizer") == "adamw8bit" for r in ladder(full, predict(full, None), 1))


def test_gpu_memory_keeps_room_for_the_cuda_context(real_cfg):
    """`--gpu-memory 16` on a config whose predicted peak is a hair under 16 GiB is not "fits": the CUDA context
    and fragmentation are not predicted, so the user-facing planners keep reserve_for(GiB) free."""
    from difftune.memory_plan.levers import reserve_for

    assert reserve_for(24) == 1.0 and reserve_for(16) == pytest.approx(0.8) and reserve_for(0.001) < 0.0001
    before = predict(real_cfg, None)
    card = before.peak / GIB + 0.1  # the prediction fits the card with 0.1 GiB to spare
    assert choose(real_cfg, None, card, 1, before).steps == []  # to the byte: as it is
    kept = choose(real_cfg, None, card, 1, before, reserve_for(card))
    assert kept.fits and kept.steps and kept.after.peak <= (card - reserve_for(card)) * GIB
    assert kept.reserve == reserve_for(card)


def test_fsdp_keeps_the_cheaper_levers_and_nothing_fits_says_the_lowest_set(tmp_path, capsys):
    """On 8 processes FSDP's rung dropped offload_during_startup (and the rest chosen before it): a K5 Image full
    fine-tune that fits in 24 GiB was "nothing fits" (28.23 GiB: the transformer beside the text encoder while
    caching), and that message named the last set tried, not the lowest, without printing it."""
    from difftune.demo import make_dataset
    from difftune.memory_plan.render import render

    make_dataset(tmp_path / "images", count=2)
    cfg = load_config(write_config(tmp_path, tmp_path / "images", model_family="kandinsky5-image",
                                   model_flavour="t2i-lite-sft", mixed_precision="bf16", model_type="full",
                                   optimizer="adamw_bf16", train_batch_size=8, dataset={"resolution": 1024})).train
    choice = choose(cfg, None, 24, 8)
    assert choice.fits and choice.settings() == {"offload_during_startup": True, "gradient_checkpointing": True,
                                                 "fsdp_enable": True}, choice.settings()
    tight = choose(cfg, None, 4, 8)
    assert not tight.fits and tight.frugal
    lowest = predict(cfg.model_copy(update=tight.frugal), None, 8).peak
    assert f"still need {lowest / GIB:.2f} GiB" in tight.message
    for settings in (dict(s) for rung in ladder(cfg, predict(cfg, None, 8), 8) for s in rung):
        candidate = _valid(cfg, settings)
        assert candidate is None or predict(candidate, None, 8).peak >= lowest - 1  # none tried is lower
    render(predict(cfg, None, 8), tight)
    out = capsys.readouterr().out
    assert "the most frugal settings tried:" in out and '"fsdp_enable": true' in out


def test_fsdp_ram_efficient_loading_keeps_the_transformer_out_of_the_caching_phases(real_cfg):
    """train/setup.py leaves the transformer in process 0's CPU memory (meta elsewhere) until it is sharded; the
    planner counted it resident while the caches filled (Kandinsky 5 Pro: 40 GiB)."""
    cfg = real_cfg.model_copy(update={"fsdp_enable": True, "model_type": "full", "optimizer": "adamw_bf16"})

    def resident(cfg, processes):
        phases = [p for p in predict(cfg, None, processes).phases if p.name.startswith("caching")]
        return [any("resident" in line.label for line in p.lines) for p in phases]

    assert resident(cfg, 4) == [True, True]
    efficient = cfg.model_copy(update={"fsdp_cpu_ram_efficient_loading": True})
    assert resident(efficient, 4) == [False, False] and resident(efficient, 1) == [True, True]
