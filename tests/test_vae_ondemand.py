"""vae_cache_ondemand (config/latent_cache_keys.py, data/batches.py, train/caching.py): latents encoded as each item is
first drawn and written to the cache, the same entries as caching before training, so the losses equal a run that
cached first, a resumed run reads what the interrupted one wrote, a file that fails in training is left out with the
reason, and `difftune cache` still encodes everything."""

from __future__ import annotations

import json

import pytest

from conftest import config_problems as problems
from conftest import write_config
from difftune.config import load_config
from difftune.train.loop import train
from difftune.train.plan import latents_on_demand
from difftune.train.setup import build_run
from test_train import crash_then_resume, losses


def entries(root) -> list:
    return sorted(p for p in (root / "cache" / "vae").rglob("*")
                  if p.is_file() and p.name not in ("metadata.json", "fingerprint.json"))


def events(root) -> list[dict]:
    return [json.loads(x) for x in (root / "output" / "events.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(vae_cache_ondemand=True, vae_cache_disable=True), "vae_cache_ondemand with vae_cache_disable"),
    (dict(dataset={"vae_cache_ondemand": True, "vae_cache_disable": True}),
     "vae_cache_ondemand on dataset 'train' with its vae_cache_disable"),
    (dict(dataset={"vae_cache_ondemand": True, "vae_cache_clear_each_epoch": True, "crop": True,
                   "crop_style": "random"}), "with its vae_cache_clear_each_epoch"),
    (dict(vae_cache_ondemand=True, crepa_enabled=True, crepa_drop_vae_encoder=True, crepa_encoder="dinov2_vits14"),
     "crepa_drop_vae_encoder with vae_cache_ondemand"),
])
def test_config_refusals(tmp_path, dataset, overrides, message) -> None:
    assert message in problems(write_config(tmp_path, dataset, **overrides))


def test_eval_datasets_and_on_the_fly_ones_are_left_as_they_are(tmp_path, dataset) -> None:
    held = {"id": "held", "type": "local", "dataset_type": "eval", "instance_data_dir": str(dataset),
            "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel_area"}
    fly = {**held, "id": "fly", "dataset_type": "image", "vae_cache_disable": True}
    run_cfg = load_config(write_config(tmp_path, dataset, vae_cache_ondemand=True, extra_datasets=[held, fly]))
    on = {ds.id: latents_on_demand(run_cfg.train, ds) for ds in run_cfg.datasets.discovered()}
    assert on == {"train": True, "held": False, "fly": False}
    assert "an eval dataset is cached before training" in problems(
        write_config(tmp_path, dataset, extra_datasets=[{**held, "vae_cache_ondemand": True}]))


def test_training_starts_with_no_latent_and_trains_exactly_as_after_caching(tmp_path, dataset) -> None:
    """Nothing is encoded before the first step; each entry is written when first drawn; the losses are those of the
    run that cached everything first (the same entries, read back the same way)."""
    common = dict(max_train_steps=6, train_batch_size=2)
    train(build_run(load_config(write_config(tmp_path / "first", dataset, **common))))
    run = build_run(load_config(write_config(tmp_path / "ondemand", dataset, vae_cache_ondemand=True, **common)))
    assert entries(tmp_path / "ondemand") == []  # nothing encoded yet
    said = [e["message"] for e in events(tmp_path / "ondemand") if e["event"] == "info"]
    assert any("dataset 'train': 4 of 4 latents are encoded during training as each is first drawn" in m for m in said)
    train(run)
    assert losses(tmp_path / "ondemand" / "output") == losses(tmp_path / "first" / "output")
    assert len(entries(tmp_path / "ondemand")) == len(entries(tmp_path / "first")) == 4
    # the next start finds them all
    build_run(load_config(write_config(tmp_path / "ondemand", dataset, vae_cache_ondemand=True, **common)))
    said = [e["message"] for e in events(tmp_path / "ondemand") if e["event"] == "info"]
    assert any("dataset 'train': 0 of 4 latents are encoded during training" in m for m in said)


def test_a_resumed_run_repeats_the_uninterrupted_one(tmp_path, dataset, monkeypatch) -> None:
    common = dict(max_train_steps=5, checkpoint_step_interval=2, resume_from_checkpoint="latest",
                  vae_cache_ondemand=True)
    train(build_run(load_config(write_config(tmp_path / "a", dataset, **common))))
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", dataset, **common), at_step=3)
    assert losses(tmp_path / "b" / "output") == losses(tmp_path / "a" / "output")


def test_a_file_that_fails_in_training_is_left_out_with_the_reason(tmp_path, dataset) -> None:
    run = build_run(load_config(write_config(tmp_path, dataset, dataset={"vae_cache_ondemand": True},
                                             max_train_steps=4)))
    gone = sorted(dataset.glob("*.png"))[0]
    gone.unlink()  # after discovery and planning: found out when it is drawn
    train(run)
    warned = [e["message"] for e in events(tmp_path) if e["event"] == "warning"]
    assert any(m.startswith(f"left out {gone}: filesystem error") for m in warned), warned
    assert sorted(losses(tmp_path / "output")) == [1, 2, 3, 4]


def test_difftune_cache_encodes_everything(tmp_path, dataset, capsys) -> None:
    from difftune.cli import main

    path = write_config(tmp_path, dataset, vae_cache_ondemand=True)
    assert main(["cache", "--config", str(path)]) == 0
    assert "vae_cache_ondemand ('train'): difftune cache encodes every latent now" in capsys.readouterr().out
    assert len(entries(tmp_path)) == 4


def test_a_damaged_entry_is_encoded_again_and_a_complete_cache_keeps_no_vae(tmp_path, dataset) -> None:
    """A start checks the entries as caching does: a damaged one is written again when drawn (not read, deleted and
    left out); once every entry is whole, a start is a cached run (no VAE kept, read-ahead on)."""
    common = dict(vae_cache_ondemand=True)
    train(build_run(load_config(write_config(tmp_path, dataset, **common, max_train_steps=4))))
    victim = entries(tmp_path)[0]
    victim.write_bytes(victim.read_bytes()[:40])
    run = build_run(load_config(write_config(tmp_path, dataset, **common, max_train_steps=8)))
    said = [e["message"] for e in events(tmp_path) if e["event"] == "info"]
    assert any("dataset 'train': 1 of 4 latents are encoded during training" in m for m in said)
    train(run)
    assert not [e for e in events(tmp_path) if e["event"] == "warning" and "left out" in e["message"]]
    assert sorted(losses(tmp_path / "output")) == list(range(1, 9))  # every step trained, nothing left out
    complete = build_run(load_config(write_config(tmp_path, dataset, **common, max_train_steps=9)))
    assert complete.data.encode is None
    assert complete.comps.vae is None or complete.comps.vae.device.type == "cpu"


def test_a_datasets_ondemand_beside_the_configs_vae_cache_disable_is_refused(tmp_path, dataset) -> None:
    text = problems(write_config(tmp_path, dataset, vae_cache_disable=True, dataset={"vae_cache_ondemand": True}))
    assert "dataset 'train': vae_cache_ondemand, but the config's vae_cache_disable encodes every dataset" in text


def test_the_plan_counts_the_encoding_beside_training(real_cfg) -> None:
    from difftune.memory_plan.predict import predict

    plain = predict(real_cfg, None)
    ondemand = predict(real_cfg.model_copy(update={"vae_cache_ondemand": True}), None)
    assert "training: encoding latents" not in [p.name for p in plain.phases]
    phase = ondemand.phase("training: encoding latents")
    assert [line.label.split(" (")[0] for line in phase.lines] == ["weights, adapter, optimizer state and EMA",
                                                                    "VAE", "VAE encode"]
    assert ondemand.phase("training").total > plain.phase("training").total  # the VAE stays
