"""LyCORIS (lycoris-lora) adapters on the tiny models: attach from a SimpleTuner-style lycoris_config, train one step
(only LyCORIS parameters change, the output changes), save in LyCORIS's format, load into a fresh transformer and get
the trained model's output back."""

from __future__ import annotations

import json
import re

import lycoris  # noqa: E402,F401 - a dependency: a missing install must fail, not skip
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from difftune.adapters.lycoris import attach_lycoris, load_lycoris, save_lycoris  # noqa: E402
from difftune.models import get_family, tiny_model
from difftune.train import objective

LycorisNetwork = lycoris.LycorisNetwork

# Attention projections that each family's LoRA targets (models/lumina2.py, models/kandinsky5_image.py).
ATTENTION = {
    "lumina2": r"(layers|noise_refiner|context_refiner)_\d+_attn_(to_q|to_k|to_v|to_out_0)",
    "kandinsky5-image": r"(text|visual)_transformer_blocks_\d+_(self|cross)_attention_(to_query|to_key|to_value|out_layer)",
}
PARAM_NAMES = {"lokr": "lokr_w1", "loha": "hada_w1_a", "locon": "lora_down.weight"}


def load(family_name):
    family = get_family(family_name)
    comps = family.load(str(tiny_model(family_name, "tiny-random")), torch.float32)
    return family, comps


def config_for(algo):
    config = {"algo": algo, "multiplier": 1.0, "linear_dim": 4, "linear_alpha": 2}
    if algo == "lokr":
        config["factor"] = 4
    return config


def predict(family, comps, net):
    torch.manual_seed(3)
    x = torch.randn(1, comps.vae.config.latent_channels, 4, 4)
    text = family.collate_text([family.encode_text(comps, ["a red square"])[0]])
    return family.predict(net, x, torch.tensor([0.5]), text)


@pytest.mark.parametrize(
    "family_name,algo",
    [("lumina2", "lokr"), ("lumina2", "loha"), ("lumina2", "locon"), ("kandinsky5-image", "lokr")],
)
def test_train_save_load_roundtrip(family_name, algo, tmp_path):
    family, comps = load(family_name)
    net = comps.transformer
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        base_out = predict(family, comps, net)

    config = config_for(algo)
    network, params = attach_lycoris(net, config)
    # default targets: exactly the attention projections, none twice
    names = [lora.lora_name for lora in network.loras]
    assert names and len(set(names)) == len(names)
    assert all(re.fullmatch(rf"lycoris_{ATTENTION[family_name]}", n) for n in names), names
    n_attn = sum(1 for n, m in net.named_modules() if type(m) is torch.nn.Linear
                 and re.fullmatch(ATTENTION[family_name], n.replace(".", "_")))
    assert len(names) == n_attn
    assert all(p.requires_grad for p in params) and not any(p.requires_grad for p in net.parameters())
    with torch.no_grad():
        torch.testing.assert_close(predict(family, comps, net), base_out)  # LyCORIS starts as the identity

    lyco_before = {k: v.clone() for k, v in network.state_dict().items()}
    opt = torch.optim.AdamW(params, lr=1e-2)
    loss = objective.flow_loss(predict(family, comps, net), torch.randn_like(base_out))
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    opt.step()

    # only LyCORIS parameters changed
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert set(net.state_dict()) == set(before)
    changed = [k for k, v in network.state_dict().items() if not torch.equal(v, lyco_before[k])]
    assert changed
    with torch.no_grad():
        trained_out = predict(family, comps, net)
    assert not torch.allclose(trained_out, base_out, atol=1e-6)

    path = save_lycoris(network, tmp_path / "lycoris.safetensors", {"difftune_step": 1})
    saved = load_file(str(path))
    assert set(saved) == set(network.state_dict())
    assert any(k.endswith(PARAM_NAMES[algo]) for k in saved)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert json.loads(meta["lycoris_config"]) == config and meta["difftune_step"] == "1"

    _, fresh_comps = load(family_name)
    fresh = fresh_comps.transformer
    loaded = load_lycoris(fresh, path)
    assert sorted(lora.lora_name for lora in loaded.loras) == sorted(names)
    with torch.no_grad():
        torch.testing.assert_close(predict(family, comps, fresh), trained_out, atol=1e-6, rtol=1e-6)


def test_preset_targets_replace_the_default_and_class_state_is_restored():
    family, comps = load("lumina2")
    net = comps.transformer
    state = {a: getattr(LycorisNetwork, a) for a in ("TARGET_REPLACE_MODULE", "TARGET_REPLACE_NAME", "MODULE_ALGO_MAP")}
    config = {"algo": "lokr", "linear_dim": 10000, "linear_alpha": 1, "factor": 4,
              "apply_preset": {"target_module": ["LuminaFeedForward"],
                               "module_algo_map": {"LuminaFeedForward": {"factor": 8}}}}
    network, _ = attach_lycoris(net, config)
    names = {lora.lora_name for lora in network.loras}
    assert names and all("_feed_forward_linear_" in n for n in names)
    assert len(names) == 3 * 4  # linear_1/2/3 in 2 layers + 2 refiner blocks
    assert {a: getattr(LycorisNetwork, a) for a in state} == state

    # a preset naming targets by name (regex), with the LyCORIS default algo map left out
    net2 = load("lumina2")[1].transformer
    network2, _ = attach_lycoris(net2, {"algo": "locon", "apply_preset": {"target_name": [r"layers\.1\.attn\.to_v$"]}})
    assert [lora.lora_name for lora in network2.loras] == ["lycoris_layers_1_attn_to_v"]


def test_bad_configs_are_refused(tmp_path):
    _, comps = load("lumina2")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \[.linera_dim.\]"):
        attach_lycoris(comps.transformer, {"algo": "lokr", "linera_dim": 4})
    with pytest.raises(ValueError, match="matched no module"):
        attach_lycoris(comps.transformer, {"algo": "lokr", "apply_preset": {"target_name": ["nothing_here"]}})
    # a file for another architecture does not load silently
    _, k_comps = load("kandinsky5-image")
    network, _ = attach_lycoris(k_comps.transformer, {"algo": "locon"})
    path = save_lycoris(network, tmp_path / "k.safetensors")
    with pytest.raises(ValueError, match="modules not in"):
        load_lycoris(load("lumina2")[1].transformer, path)


def test_lycoris_warnings_become_warning_events(tmp_path, dataset, capfd):
    """SimpleTuner's lycoris_config.json.example targets Attention and FeedForward; Lumina2 has no FeedForward class
    (its feed-forward is LuminaFeedForward). LyCORIS's warning about it is a warning event of the run, not only a
    line on stdout."""
    from conftest import write_config
    from difftune.config import load_config
    from difftune.train.setup import build_run

    config = tmp_path / "lycoris_config.json"
    config.write_text(json.dumps({"algo": "lokr", "linear_dim": 4, "linear_alpha": 1, "factor": 4,
                                  "apply_preset": {"target_module": ["Attention", "FeedForward"]}}))
    run = build_run(load_config(write_config(tmp_path, dataset, lora_type="lycoris", lycoris_config=str(config),
                                             validation_prompt=None)))
    run.events.close()
    log = [json.loads(line) for line in (run.output_dir / "events.jsonl").read_text().splitlines()]
    (warning,) = [e["message"] for e in log if e["event"] == "warning"]
    assert "No modules matched the following target module classes: ['FeedForward']" in warning
    assert "(this transformer's classes of that name: LuminaFeedForward)" in warning  # what to write instead
    assert str(config) in warning
    console = capfd.readouterr()
    assert (console.out + console.err).count("No modules matched") == 1  # said once: the run's warning
    assert {lora.lora_name for lora in run.adapter.network.loras}  # Attention still matched


@pytest.mark.parametrize("algo", ["full", "glora", "lokr"])
def test_a_stopped_lycoris_run_resumes_exactly(tmp_path, dataset, monkeypatch, algo):
    """Every algo resumes with the losses of the uninterrupted run (a `full` module's state_dict() names its
    weight `diff`: its checkpoints could not be resumed)."""
    from conftest import write_config
    from difftune.config import load_config
    from difftune.train.loop import train
    from difftune.train.setup import build_run
    from test_train import crash_then_resume, losses

    lycoris_config = tmp_path / "lycoris_config.json"
    lycoris_config.write_text(json.dumps(config_for(algo)))
    common = dict(lora_type="lycoris", lycoris_config=str(lycoris_config), max_train_steps=4,
                  checkpoint_step_interval=2, train_batch_size=2, resume_from_checkpoint="latest",
                  validation_prompt=None)
    train(build_run(load_config(write_config(tmp_path / "a", dataset, **common))))
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", dataset, **common), at_step=3)
    assert losses(tmp_path / "b" / "output") == losses(tmp_path / "a" / "output")
    a, b = (load_file(tmp_path / x / "output" / "pytorch_lora_weights.safetensors") for x in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_checkpoint_of_the_old_layout_loads():
    """Checkpoints written before the fix hold `full` modules' `diff` (weight minus the base): read as weights."""
    from difftune.adapters.kinds import _full_diffs_as_weights

    _, comps = load("lumina2")
    network, params = attach_lycoris(comps.transformer, {"algo": "full"})
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.01)
    old = network.state_dict()
    assert any(k.endswith(".diff") for k in old)
    live = dict(network.named_parameters())
    restored = _full_diffs_as_weights(network, old)
    weights = {k: v for k, v in restored.items() if k in live and live[k].requires_grad}
    assert weights and set(weights) == {n for n, p in live.items() if p.requires_grad}
    assert all(torch.allclose(weights[k], live[k].detach(), atol=1e-6) for k in weights)


def test_fp16_glora_and_full_on_the_cpu_are_refused_before_any_model_loads(tmp_path, dataset):
    """accelerate has no fp16 autocast on the CPU: their fp32 weights met fp16 activations at step 1."""
    from conftest import write_config
    from difftune.config import load_config
    from difftune.train.setup import build_run

    for algo in ("full", "glora"):
        config = tmp_path / f"{algo}.json"
        config.write_text(json.dumps(config_for(algo)))
        with pytest.raises(ValueError, match=f"LyCORIS algo '{algo}' with mixed_precision 'fp16' on the CPU"):
            build_run(load_config(write_config(tmp_path, dataset, lora_type="lycoris", lycoris_config=str(config),
                                               mixed_precision="fp16", validation_prompt=None)))


def test_the_files_algorithms_are_lycoris_own():
    import lycoris.wrapper

    from difftune.config.lycoris_file import ALGOS

    assert sorted(ALGOS) == sorted(lycoris.wrapper.network_module_dict)


SIMPLETUNER_GENERIC = {"algo": "lokr", "multiplier": 1.0, "linear_dim": 10000, "linear_alpha": 1, "factor": 4,
                       "apply_preset": {"target_module": ["Attention", "FeedForward"],
                                        "module_algo_map": {"Attention": {"factor": 4}, "FeedForward": {"factor": 4}}}}


def test_a_lycoris_config_that_cannot_build_fails_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """An unknown algo (a KeyError inside lycoris), an unknown key, and a preset that matches no module of the
    transformer (SimpleTuner's generic example on Kandinsky 5, whose classes are Kandinsky5Attention, ...) passed
    check and failed with a traceback once the caches had filled."""
    from conftest import write_config
    from difftune.adapters.lycoris import LycorisConfigError
    from difftune.cli import main
    from difftune.config import ConfigError, load_config
    from difftune.demo import make_dataset
    from difftune.train.setup import build_run

    make_dataset(tmp_path / "images", count=2)

    def config(name, content, **keys):
        (tmp_path / f"{name}.json").write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        return write_config(tmp_path / name, tmp_path / "images", lora_type="lycoris",
                            lycoris_config=str(tmp_path / f"{name}.json"), **keys)

    with pytest.raises(ConfigError, match=r"foo.json: algo 'foo' is not a LyCORIS algorithm; use one of boft, "):
        load_config(config("foo", {"algo": "foo", "linear_dim": 4}))
    with pytest.raises(ConfigError, match=r"bogus.json: unknown key\(s\) \['bogus_key'\]"):
        load_config(config("bogus", {"algo": "lokr", "bogus_key": 1}))
    load_config(config("case", {"algo": "LoKr", "factor": 4}))  # lycoris lower-cases it: LoKr trains LoKr
    # saved by a Windows editor: a byte-order mark is read as without it, at load and when the network is built
    (tmp_path / "prompts.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"cat": "a cat"}).encode())
    bom = config("bom", b"\xef\xbb\xbf" + json.dumps(SIMPLETUNER_GENERIC).encode(),
                 user_prompt_library=str(tmp_path / "prompts.json"))
    assert load_config(bom).train.validation_prompts() == [("cat", "a cat")]
    assert main(["check", "--config", str(bom)]) == 0  # Lumina2's attention class is diffusers' own Attention
    generic = config("generic", SIMPLETUNER_GENERIC, model_family="kandinsky5-video")
    assert main(["check", "--config", str(generic)]) == 2
    err = capsys.readouterr().err
    assert "generic.json: its apply_preset matches no module of the kandinsky5-video transformer" in err
    assert "(this transformer's classes of that name: Kandinsky5Attention, Kandinsky5FeedForward)" in err

    def no_caching(*args, **kwargs):
        raise AssertionError("the preset is checked before the caches fill")

    monkeypatch.setattr("difftune.train.setup.fill_caches", no_caching)
    with pytest.raises(LycorisConfigError, match="matches no module"):
        build_run(load_config(generic))
    # the real Kandinsky 5 Pro (known architecture, built on the meta device: no weights, no download)
    pro = config("pro", SIMPLETUNER_GENERIC, model_family="kandinsky5-video", model_flavour="t2v-pro-sft-5s-hd")
    assert main(["check", "--config", str(pro)]) == 2
    assert "matches no module of the kandinsky5-video transformer" in capsys.readouterr().err
    # lycoris-lora's own refusal (BOFT's factor against the tiny Lumina2's 48-wide layers): said with the file, by check
    boft = config("boft", {"algo": "boft", "linear_dim": 4, "factor": 4})
    assert main(["check", "--config", str(boft)]) == 2
    assert "boft.json: lycoris-lora cannot build this network on the lumina2 transformer (ValueError: It is " \
        "impossible to decompose 48" in capsys.readouterr().err
    assert main(["check", "--config", str(config("full", {"algo": "full"}))]) == 0  # reads weights: checked at load
