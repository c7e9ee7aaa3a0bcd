"""Regularisation datasets (`is_regularisation_data`, train/regularisation.py): the config's checks, the target of
a regularisation batch (the base model's prediction, the adapter switched off) against one computed by hand, the
data report, resume, and the features the teacher pass must not disturb."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import config_problems as problems
from conftest import step_draws, write_config
from difftune.config import load_config
from difftune.demo import make_dataset
from difftune.train import loop, objective, regularisation
from difftune.train.loop import train
from difftune.train.setup import build_run
from families import Case, case_data, make_clips
from test_train import crash_then_resume, losses


def reg_entry(folder, root, **extra):
    return {"id": "reg", "type": "local", "instance_data_dir": str(folder), "caption_strategy": "instanceprompt",
            "instance_prompt": "a photo of a shape", "resolution": 64, "resolution_type": "pixel_area",
            "cache_dir_vae": str(root / "cache" / "vae-reg"), "is_regularisation_data": True} | extra


def with_reg(root, subject, entry, **config):
    """write_config's subject dataset plus the regularisation entry `entry`."""
    return write_config(root, subject, extra_datasets=[entry], **config)


@pytest.fixture
def reg_images(tmp_path):
    folder = tmp_path / "reg-images"
    make_dataset(folder, count=2, seed=5)
    return folder



# --- config -------------------------------------------------------------------------------------------------


def test_both_spellings_and_null(tmp_path, dataset, reg_images):
    for key in ("is_regularisation_data", "is_regularization_data"):
        entry = reg_entry(reg_images, tmp_path)
        entry[key] = entry.pop("is_regularisation_data")
        plan = load_config(with_reg(tmp_path, dataset, entry)).datasets
        assert [ds.is_regularisation_data for ds in plan.images] == [False, True]
    plan = load_config(with_reg(tmp_path, dataset, reg_entry(reg_images, tmp_path, is_regularisation_data=None))).datasets
    assert not plan.images[1].is_regularisation_data  # SimpleTuner's null: not set
    both = reg_entry(reg_images, tmp_path, is_regularization_data=False)
    text = problems(with_reg(tmp_path, dataset, both))
    assert "dataset 'reg'" in text and "is_regularization_data" in text and "disagrees" in text


def test_misuse_is_refused_with_the_fix(tmp_path, dataset, reg_images):
    entry = reg_entry(reg_images, tmp_path)
    text = problems(with_reg(tmp_path, dataset, entry, model_type="full"))
    assert "dataset 'reg': is_regularisation_data: a full fine-tune" in text and "remove is_regularisation_data" in text
    # every dataset marked: nothing to learn
    text = problems(write_config(tmp_path, dataset, dataset={"is_regularisation_data": True}))
    assert "is_regularisation_data: every dataset is regularisation data ('train')" in text
    # entries that are not trained on: false is accepted (SimpleTuner reads it on every entry), true is refused
    backend = tmp_path / "config" / "multidatabackend.json"
    for index, value in ((1, True), (1, False)):
        path = write_config(tmp_path, dataset)
        entries = json.loads(backend.read_text())
        entries[index]["is_regularisation_data"] = value
        backend.write_text(json.dumps(entries))
        if value:
            text = problems(path)
            assert "dataset 'text-embeds'" in text and "only image and video datasets are trained on" in text
        else:
            load_config(path)
    path = write_config(tmp_path, dataset, conditioning_dir=reg_images)
    entries = json.loads(backend.read_text())
    entries[-1]["is_regularization_data"] = True
    backend.write_text(json.dumps(entries))
    assert "dataset 'inputs'" in problems(path) and "mark that one" in problems(path)


# --- the target ---------------------------------------------------------------------------------------------


def _wake(run) -> None:
    """Random adapter weights: at its initialisation an adapter changes nothing, and the target would be trivial."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in run.params:
            p.add_(torch.randn(p.shape, generator=gen).to(p.device, p.dtype) * 0.05)


def _by_hand(run, batch):
    """(prediction with the adapter, the base model's prediction, flow velocity) as micro_step draws them."""
    x0, noise, sigmas, x = step_draws(run, batch)
    cond = batch.conditioning
    model = run.comps.transformer
    with torch.no_grad():
        pred = run.family.predict(model, x, sigmas, batch.text, cond)
        if run.cfg.lora_type == "lycoris":
            run.adapter.network.set_multiplier(0.0)
            base = run.family.predict(model, x, sigmas, batch.text, cond)
            run.adapter.network.set_multiplier(1.0)
        else:
            model.disable_adapters()
            base = run.family.predict(model, x, sigmas, batch.text, cond)
            model.enable_adapters()
    return pred, base, objective.velocity_target(x0, noise)


def _batches(run):
    """A regularisation batch and an ordinary one."""
    reg = plain = None
    for batch in run.data:
        if batch.regularisation is not None:
            assert bool(batch.regularisation.all())  # a batch holds one dataset
            reg = reg or batch
        else:
            plain = plain or batch
        if reg is not None and plain is not None:
            return reg, plain
    raise AssertionError("unreachable")


LYCORIS = {"algo": "lokr", "multiplier": 1.0, "linear_dim": 4, "linear_alpha": 2, "factor": 4}


@pytest.mark.parametrize("case,kind", [(Case("lumina2", "tiny-random"), "lora"),
                                       (Case("lumina2", "tiny-random"), "lycoris"),
                                       (Case("kandinsky5-video", "tiny-random-i2v"), "lora")],
                         ids=["lumina2-lora", "lumina2-lycoris", "kandinsky5-video-i2v-lora"])
def test_regularisation_loss_is_the_distance_to_the_base_model(tmp_path, dataset, reg_images, case, kind):
    data, keys = case_data(case, tmp_path, dataset)
    entry = reg_entry(reg_images, tmp_path)
    if case.video:
        entry |= {"dataset_type": "video", "resolution": 32, "video": {"num_frames": 9},
                  "instance_data_dir": str(make_clips(tmp_path / "reg-clips", count=2))}
    if kind == "lycoris":
        (tmp_path / "lycoris.json").write_text(json.dumps(LYCORIS))
        keys |= {"lora_type": "lycoris", "lycoris_config": str(tmp_path / "lycoris.json")}
    run = build_run(load_config(with_reg(tmp_path, data, entry, model_family=case.family,
                                         model_flavour=case.flavour, **keys)))
    assert "regularisation data: reg" in (tmp_path / "output" / "events.jsonl").read_text()  # the data report
    reg, plain = _batches(run)
    first = 1 if case.i2v else 0
    # at initialisation the adapter is the base model: a regularisation batch's loss is exactly 0
    assert loop.micro_step(run, reg).item() == 0.0
    _wake(run)
    for batch, regularised in ((reg, True), (plain, False)):
        state = run.generator.get_state()
        pred, base, velocity = _by_hand(run, batch)
        run.generator.set_state(state)
        loss = loop.micro_step(run, batch)
        expected = ((pred - (base if regularised else velocity))[:, :, first:].float() ** 2).mean()
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=0)
        assert loss.item() > 1e-6
        loss.backward()
        # the teacher pass left the adapter trainable (peft's disable_adapters freezes it) and its grads flow
        assert all(p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0 for p in run.params)
        run.optimizer.zero_grad(set_to_none=True)
    run.events.close()


def test_without_regularisation_data_the_target_is_the_velocity(tmp_path, dataset, reg_images):
    """Off changes nothing: the same dataset unmarked gives batches without the flag, and the target is the
    velocity, bit for bit."""
    run = build_run(load_config(with_reg(tmp_path, dataset, reg_entry(reg_images, tmp_path,
                                                                      is_regularisation_data=False))))
    assert not run.data.regularisation and "regularisation data" not in (tmp_path / "output" / "events.jsonl").read_text()
    for batch, _ in zip(run.data, range(6), strict=False):  # an epoch: both datasets
        assert batch.regularisation is None
    x0, noise = batch.latents, torch.randn(batch.latents.shape)
    rolled = type("R", (), {"x": x0, "noise": noise})
    assert torch.equal(regularisation.target(run, batch, x0, rolled, torch.full((x0.shape[0],), 0.5)), noise - x0)
    run.events.close()


def test_teacher_runs_unrouted_and_draws_nothing(tmp_path, dataset, reg_images):
    """With TREAD and gradient checkpointing on, the teacher is the base model's plain forward pass, and the run's
    generator (TREAD routes, rollouts) is left where it was."""
    tread = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": -1}]}
    run = build_run(load_config(with_reg(tmp_path, dataset, reg_entry(reg_images, tmp_path), tread_config=tread,
                                         gradient_checkpointing=True)))
    reg, _ = _batches(run)
    _wake(run)
    run.transformer.train()  # as the loop does: TREAD routes training passes only
    x0 = reg.latents
    noise, sigmas = torch.randn(x0.shape), torch.full((x0.shape[0],), 0.6)
    rolled = type("R", (), {"x": objective.noisy_input(x0, noise, sigmas), "noise": noise})
    state = run.generator.get_state()
    got = regularisation.target(run, reg, x0, rolled, sigmas)
    assert torch.equal(run.generator.get_state(), state)
    model = run.comps.transformer
    model.disable_adapters()
    with torch.no_grad():
        base = run.family.predict(model, rolled.x, sigmas, reg.text, None)
    routed = run.family.predict(model, rolled.x, sigmas, reg.text, None)  # a training pass: TREAD routes it
    model.enable_adapters()
    assert torch.equal(got, base.float()) and not torch.allclose(routed, base)
    run.events.close()


def test_resume_is_exact(tmp_path, dataset, reg_images, monkeypatch):
    common = dict(max_train_steps=3, checkpoint_step_interval=2, resume_from_checkpoint="latest", lr_scheduler="linear",
                  seed=_seed_with_regularisation_first(4, 2, 1))
    whole = with_reg(tmp_path / "a", dataset, reg_entry(reg_images, tmp_path / "a"), **common)
    train(build_run(load_config(whole)))
    resumed = with_reg(tmp_path / "b", dataset, reg_entry(reg_images, tmp_path / "b"), **common)
    crash_then_resume(monkeypatch, resumed, at_step=2)
    expected, got = losses(tmp_path / "a" / "output"), losses(tmp_path / "b" / "output")
    assert len(expected) == 3 and got == expected
    assert expected[1] == 0.0  # step 1 trains on regularisation data, and the adapter starts as the base model


def test_with_crepa_rollout_and_reflexflow(tmp_path, dataset, reg_images, dino):
    """CREPA captures the student's block output after the teacher's pass (which would clear it if it came
    later), so its term is added on regularisation batches too; ReflexFlow's loss takes the teacher's target."""
    keys = dict(crepa_enabled=True, crepa_encoder=dino, crepa_encoder_image_size=28,
                crepa_block_index=1, scheduled_sampling_max_step_offset=2, scheduled_sampling_probability=1.0,
                scheduled_sampling_reflexflow=True)
    run = build_run(load_config(with_reg(tmp_path, dataset, reg_entry(reg_images, tmp_path), **keys)))
    reg, _ = _batches(run)
    run.transformer.train()  # as the loop does: CREPA captures training passes only
    # at initialisation the flow part is 0 (student = teacher), so what is left is CREPA's term alone
    loss = loop.micro_step(run, reg)
    assert loss.item() != 0.0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in run.crepa.parameters())  # the projector learns on these batches too
    run.events.close()


# --- several processes (torchrun, gloo on CPU) ----------------------------------------------------------------


def _seed_with_regularisation_first(subject_count: int, reg_count: int, global_batch: int) -> int:
    """A seed whose first batch is regularisation data, so the teacher's is the run's very first forward pass
    (FSDP2 creates its unsharded parameters then, with the requires_grad it sees)."""
    from difftune.data.sampler import BucketSampler

    for seed in range(100):
        parts = [(list(range(subject_count)), [(64, 64)] * subject_count, None),
                 (list(range(subject_count, subject_count + reg_count)), [(64, 64)] * reg_count, None)]
        if next(iter(BucketSampler(parts, global_batch, seed, keep_partial=False)))[0] >= subject_count:
            return seed
    raise AssertionError("no such seed")


@pytest.mark.slow  # about 60-90 s on 2 cores: two launches of two processes and two of one
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_processes_equal_one(tmp_path, reg_images, sharding):
    from test_distributed import finish, launch

    subject = tmp_path / "subject"
    make_dataset(subject, count=2)
    seed = _seed_with_regularisation_first(2, 2, 2)
    common = dict(max_train_steps=3, lr_scheduler="linear", seed=seed)
    two = with_reg(tmp_path / "two", subject, reg_entry(reg_images, tmp_path / "two"), train_batch_size=1,
                   **common, **({"fsdp_enable": True} if sharding == "fsdp" else {}))
    one = with_reg(tmp_path / "one", subject, reg_entry(reg_images, tmp_path / "one"), train_batch_size=2, **common)
    finish(launch(two, 29641 if sharding == "ddp" else 29643))
    finish(launch(one, 0, processes=1))
    a, b = losses(tmp_path / "one" / "output"), losses(tmp_path / "two" / "output")
    assert a[1] == 0.0  # the first batch is regularisation data, and the adapter starts as the base model
    assert len(a) == 3 and a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-9) for k in a)
    assert a[2] != a[3]


def test_a_validation_only_dataset_cannot_be_regularisation_data(tmp_path, reg_images):
    clips = tmp_path / "clips"
    clips.mkdir()
    path = write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random-i2v",
                        dataset={"dataset_type": "video"}, validation_using_datasets=True, eval_dataset_id="reg")
    backend = tmp_path / "config" / "multidatabackend.json"
    backend.write_text(json.dumps(json.loads(backend.read_text()) + [reg_entry(reg_images, tmp_path)]))
    text = problems(path)
    assert "dataset 'reg': is_regularisation_data: this dataset is only the validation input" in text


def test_check_says_the_batches_per_epoch_and_the_regularisation_data_as_training_does(tmp_path, dataset, capsys):
    """The README says check prints training's data report; it left out these two lines."""
    from difftune.cli import main
    from difftune.demo import make_dataset

    make_dataset(tmp_path / "reg", count=4, seed=5)
    reg = {"id": "reg", "type": "local", "instance_data_dir": str(tmp_path / "reg"), "caption_strategy": "textfile",
           "resolution": 64, "resolution_type": "pixel_area", "is_regularisation_data": True}
    assert main(["check", "--config", str(write_config(tmp_path, dataset, extra_datasets=[reg]))]) == 0
    out = capsys.readouterr().out
    assert "  batches per epoch: 8" in out and "  regularisation data: reg (trained towards the base model's" in out
