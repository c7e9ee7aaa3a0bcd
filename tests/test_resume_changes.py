"""Settings changed between a run and its resume (train/resume_settings.py): each takes effect or is refused, and
says so; none is silently ignored. An unchanged resume stays exact (tests/test_train.py, tests/test_kill.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import config_problems, write_config
from difftune.config import load_config
from difftune.data.sampler import BucketSampler
from difftune.demo import make_dataset
from difftune.train.loop import train
from difftune.train.setup import build_run


def events_of(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "events.jsonl").read_text().splitlines()]


def run_with(tmp_path, dataset, **overrides):
    """Train the config in tmp_path with `overrides` (the same folder each time: a later call resumes)."""
    run = build_run(load_config(write_config(tmp_path, dataset, resume_from_checkpoint="latest", **overrides)))
    train(run)
    return run


def messages(output_dir, kind: str) -> list[str]:
    return [e["message"] for e in events_of(output_dir) if e["event"] == kind]


def test_raised_max_train_steps_trains_the_next_step_at_the_new_schedules_rate(tmp_path, dataset):
    """4 steps of a linear schedule end at rate 0; resumed with max_train_steps 8, step 5 trains at the new 8-step
    schedule's rate (half the peak), and its weights change."""
    run_with(tmp_path, dataset, max_train_steps=4, lr_scheduler="linear")
    out = tmp_path / "output"
    run_with(tmp_path, dataset, max_train_steps=8, lr_scheduler="linear", checkpoint_step_interval=1)
    rates = {e["step"]: e["lr"] for e in events_of(out) if e["event"] == "step"}
    assert rates[5] == pytest.approx(5e-4) and rates[6] == pytest.approx(3.75e-4)
    w4 = load_file(out / "checkpoints" / "checkpoint-0000004" / "trainable.safetensors")
    w5 = load_file(out / "checkpoints" / "checkpoint-0000005" / "trainable.safetensors")
    assert max(float((w5[k] - w4[k]).abs().max()) for k in w4) > 0
    (info,) = [m for m in messages(out, "info") if "changed since it was saved" in m]
    assert "step 5 trains at the new curve's 0.0005, where the checkpoint's would have 0" in info


def test_changed_learning_rate_and_adam_settings_take_effect_and_are_named(tmp_path, dataset):
    run_with(tmp_path, dataset, max_train_steps=2)
    out = tmp_path / "output"
    run_with(tmp_path, dataset, max_train_steps=3, learning_rate=1e-2, adam_beta2=0.95, adam_weight_decay=0.5)
    assert [e["lr"] for e in events_of(out) if e["event"] == "step"][-1] == pytest.approx(1e-2)
    (group,) = torch.load(out / "checkpoints" / "checkpoint-0000003" / "optimizer.pt")["param_groups"]
    assert tuple(group["betas"]) == (0.9, 0.95) and group["weight_decay"] == 0.5 and group["lr"] == 1e-2
    (info,) = [m for m in messages(out, "info") if "changed since it was saved" in m]
    for part in ("adam_beta2 0.999 -> 0.95", "adam_weight_decay 0.01 -> 0.5", "learning rate", "0.001 -> 0.01",
                 "step 3 trains at 0.01"):
        assert part in info, info
    assert "adam_beta1" not in info and "adam_epsilon" not in info
    assert not [m for m in messages(out, "warning") if "does not set" in m]  # set in the config: an info line
    # not set, and this difftune's default is not what the checkpoint trained with (its default changed across an
    # upgrade, or the key was removed): a warning that says how to keep it
    run_with(tmp_path, dataset, max_train_steps=4, learning_rate=1e-2, adam_beta2=0.95)
    (warning,) = [m for m in messages(out, "warning") if "does not set" in m]
    assert "adam_weight_decay 0.5 -> 0.01 although the config does not set it" in warning
    assert warning.endswith("to keep training as before, set adam_weight_decay 0.5")


def test_changed_betas_take_effect_for_torch_optimi_optimizers(tmp_path, dataset):
    """optimi's groups hold beta1 and beta2, not betas: changed betas were said nothing of and never applied."""
    run_with(tmp_path, dataset, max_train_steps=2, optimizer="adamw_bf16")
    out = tmp_path / "output"
    run_with(tmp_path, dataset, max_train_steps=3, optimizer="adamw_bf16", adam_beta1=0.8, adam_beta2=0.95)
    (group,) = torch.load(out / "checkpoints" / "checkpoint-0000003" / "optimizer.pt")["param_groups"]
    assert (group["beta1"], group["beta2"]) == (0.8, 0.95)
    (info,) = [m for m in messages(out, "info") if "changed since it was saved" in m]
    assert "adam_beta1 0.9 -> 0.8" in info and "adam_beta2 0.999 -> 0.95" in info


def test_another_optimizer_resumes_with_a_fresh_state_and_a_warning(tmp_path, dataset):
    run_with(tmp_path, dataset, max_train_steps=2, checkpoint_step_interval=1)
    out = tmp_path / "output"
    run_with(tmp_path, dataset, max_train_steps=4, optimizer="prodigy", learning_rate=1.0)
    (warning,) = [m for m in messages(out, "warning") if "optimizer" in m]
    assert "'adamw'" in warning and "'prodigy'" in warning and "afresh" in warning
    assert [e["step"] for e in events_of(out) if e["event"] == "step"][-2:] == [3, 4]
    state = json.loads((out / "checkpoints" / "checkpoint-0000004" / "training_state.json").read_text())
    assert state["settings"]["optimizer"] == "prodigy"
    # a checkpoint of an earlier difftune (no settings recorded) loads as before
    old = out / "checkpoints" / "checkpoint-0000004" / "training_state.json"
    old.write_text(json.dumps({k: v for k, v in state.items() if k != "settings"}))
    seen = len(messages(out, "warning"))
    run_with(tmp_path, dataset, max_train_steps=5, optimizer="prodigy", learning_rate=1.0)
    assert [e["step"] for e in events_of(out) if e["event"] == "step"][-1] == 5
    assert not [m for m in messages(out, "warning")[seen:] if "optimizer" in m]  # the same optimizer: its state
    # ... and resumed with another optimizer, its state is not loaded into that one (a raw KeyError: 'step' into
    # AdamW; AdamW's moments taken silently by Lion the other way)
    for folder in (out / "checkpoints").glob("checkpoint-*"):
        state = json.loads((folder / "training_state.json").read_text())
        (folder / "training_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "settings"}))
    run_with(tmp_path, dataset, max_train_steps=6, optimizer="adamw")
    (warning,) = [m for m in messages(out, "warning")[seen:] if "optimizer" in m]
    assert "trained with another optimizer or optimizer_config than this run's 'adamw'" in warning
    assert "starts afresh" in warning
    # optimizer_config set over such a checkpoint: its groups' amsgrad False would have replaced it, for good
    seen = len(messages(out, "warning"))
    for folder in (out / "checkpoints").glob("checkpoint-*"):
        state = json.loads((folder / "training_state.json").read_text())
        (folder / "training_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "settings"}))
    run_with(tmp_path, dataset, max_train_steps=7, optimizer="adamw", optimizer_config="amsgrad=true")
    (warning,) = [m for m in messages(out, "warning")[seen:] if "optimizer" in m]
    (group,) = torch.load(out / "checkpoints" / "checkpoint-0000007" / "optimizer.pt")["param_groups"]
    assert "starts afresh" in warning and group["amsgrad"] is True


def test_changed_optimizer_config_resumes_with_a_fresh_state(tmp_path, dataset):
    """amsgrad switched on needs a state AdamW without it never made: a fresh optimizer, not a raw KeyError."""
    run_with(tmp_path, dataset, max_train_steps=2)
    run_with(tmp_path, dataset, max_train_steps=3, optimizer_config="amsgrad=true")
    (warning,) = [m for m in messages(tmp_path / "output", "warning") if "optimizer" in m]
    assert "optimizer_config unset, this run has {'amsgrad': True}" in warning and "afresh" in warning
    (group,) = torch.load(tmp_path / "output" / "checkpoints" / "checkpoint-0000003" / "optimizer.pt")["param_groups"]
    assert group["amsgrad"] is True


def test_sampler_streams_are_kept_by_dataset_id():
    parts = [([0, 1], [(64, 64)] * 2, 1.0), ([2, 3, 4], [(64, 64)] * 3, 1.0)]
    before = BucketSampler(parts, 1, seed=0, keep_partial=False, ids=["a", "b"])
    it = iter(before)
    for _ in range(3):
        next(it)
    saved = before.state_dict()
    assert set(saved["streams"]) == {"a", "b"}
    grown = BucketSampler([parts[1], ([5], [(64, 64)], 0.5), parts[0]], 1, seed=0, keep_partial=False,
                          ids=["b", "new", "a"])
    note = grown.load_state_dict(saved)
    assert "added: new" in note
    assert grown.state_dict()["streams"] == saved["streams"] | {"new": [0, 0]}
    # the older list format (by position) still loads, and a dataset beyond it starts at the beginning
    listed = BucketSampler(parts + [([5], [(64, 64)], 0.5)], 1, seed=0, keep_partial=False, ids=["a", "b", "c"])
    assert "added: c" in listed.load_state_dict(saved | {"streams": [saved["streams"]["a"], saved["streams"]["b"]]})
    assert listed.state_dict()["streams"] == saved["streams"] | {"c": [0, 0]}
    assert before.load_state_dict(saved) is None


def test_resume_after_adding_a_dataset_with_probability_trains_on(tmp_path, dataset):
    run_with(tmp_path, dataset, max_train_steps=2)
    more = tmp_path / "more"
    make_dataset(more, count=2)
    extra = [{"id": "more", "type": "local", "dataset_type": "image", "instance_data_dir": str(more),
              "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel_area",
              "cache_dir_vae": str(tmp_path / "cache" / "vae-more"), "probability": 0.5}]
    run_with(tmp_path, dataset, max_train_steps=10, extra_datasets=extra)
    out = tmp_path / "output"
    assert [e["step"] for e in events_of(out) if e["event"] == "step"][-1] == 10
    assert any("dataset list changed" in m and "added: more" in m for m in messages(out, "info"))


def test_epoch_run_with_another_batch_size_is_refused_and_a_step_run_warned(tmp_path, monkeypatch):
    """Refused before any model loads (`difftune check` too), and when the run starts (where the process count,
    unknown to the config, is compared too)."""
    from difftune.config import load as config_load

    images = tmp_path / "images"
    make_dataset(images, count=4)
    run_with(tmp_path, images, max_train_steps=0, num_train_epochs=1, train_batch_size=2)
    config = write_config(tmp_path, images, max_train_steps=0, num_train_epochs=2, train_batch_size=1,
                          resume_from_checkpoint="latest")
    problems = config_problems(config)
    assert "train_batch_size 2 then, 1 now" in problems and "num_train_epochs 2" in problems
    assert "Resume with train_batch_size 2" in problems and "set max_train_steps" in problems
    monkeypatch.setattr(config_load, "batches_problem", lambda *a: None)
    with pytest.raises(ValueError, match="train_batch_size 2 then, 1 now") as info:
        train(build_run(load_config(config)))
    assert "num_train_epochs 2" in str(info.value) and "max_train_steps" in str(info.value)
    monkeypatch.undo()
    run_with(tmp_path, images, max_train_steps=3, train_batch_size=1)
    (warning,) = [m for m in messages(tmp_path / "output", "warning") if "other batches" in m]
    assert "train_batch_size 2 then, 1 now" in warning


def test_changed_lora_rank_is_refused_before_the_model_loads(tmp_path, dataset):
    """From the checkpoint's header, at config time (`difftune check` too), for 'latest' and for a named one."""
    run_with(tmp_path, dataset, max_train_steps=1)
    for resume in ("latest", "checkpoint-0000001"):
        problems = config_problems(write_config(tmp_path, dataset, lora_rank=8, resume_from_checkpoint=resume))
        assert "trained with lora_rank 4" in problems and "this run has lora_rank 8" in problems, problems
        assert "Set lora_rank 4" in problems
    load_config(write_config(tmp_path, dataset, lora_rank=4, resume_from_checkpoint="latest"))  # unchanged: fine
    # a full fine-tune does not take a LoRA's checkpoint at all (refused for that, not for the rank)
    problems = config_problems(write_config(tmp_path, dataset, lora_rank=8, model_type="full",
                                            resume_from_checkpoint="latest"))
    assert "this run is a full fine-tune" in problems and "lora_rank" not in problems.split("holds")[1], problems


def test_changed_use_dora_or_lycoris_network_is_refused_before_the_model_loads(tmp_path, dataset):
    """They were refused after the model loaded and the caches were checked, naming lora_rank (unused by LyCORIS)
    or no key at all."""
    run_with(tmp_path / "dora", dataset, max_train_steps=1)
    problems = config_problems(write_config(tmp_path / "dora", dataset, use_dora=True, resume_from_checkpoint="latest"))
    assert "trained with use_dora false, this run has use_dora true" in problems, problems
    loha = tmp_path / "loha.json"
    loha.write_text(json.dumps({"algo": "loha", "linear_dim": 4, "linear_alpha": 2}))
    run_with(tmp_path / "ly", dataset, max_train_steps=1, lora_type="lycoris", lycoris_config=str(loha))
    for change, said in (({"linear_dim": 8}, "linear_dim 4 then, 8 now"), ({"algo": "lokr"}, "algo 'loha' then")):
        other = tmp_path / "other.json"
        other.write_text(json.dumps({"algo": "loha", "linear_dim": 4, "linear_alpha": 2} | change))
        problems = config_problems(write_config(tmp_path / "ly", dataset, lora_type="lycoris",
                                                lycoris_config=str(other), resume_from_checkpoint="latest"))
        assert "was trained with another LyCORIS network" in problems and said in problems, problems
    load_config(write_config(tmp_path / "ly", dataset, lora_type="lycoris", lycoris_config=str(loha),
                             resume_from_checkpoint="latest"))  # unchanged: fine


def test_adapter_tensor_of_another_shape_is_a_clear_error():
    """What the header check misses (another size setting) is named when the weights are copied in."""
    from difftune.adapters.kinds import _copy_into

    module = torch.nn.Linear(3, 8)
    with pytest.raises(ValueError, match=r"weight is \[4, 3\] in the checkpoint and \[8, 3\] here: lora_rank"):
        _copy_into(module, {"weight": torch.zeros(4, 3), "bias": torch.zeros(8)})


def test_changed_lora_alpha_and_seed_are_warned_about(tmp_path, dataset):
    run_with(tmp_path, dataset, max_train_steps=1)
    run_with(tmp_path, dataset, max_train_steps=2, lora_alpha=16, seed=9)
    warnings = messages(tmp_path / "output", "warning")
    assert any("lora_alpha 4 then, 16 now" in m and "scaled" in m for m in warnings), warnings
    assert any("seed 7 then, 9 now" in m and "data order" in m and "noise" in m for m in warnings), warnings


def test_changed_base_precision_is_warned_about(tmp_path, dataset):
    """int8-quanto then, int4-quanto now: the run resumed and trained on other numbers without a word."""
    run_with(tmp_path, dataset, max_train_steps=1, base_model_precision="int8-quanto")
    run_with(tmp_path, dataset, max_train_steps=2, base_model_precision="int4-quanto")
    warnings = messages(tmp_path / "output", "warning")
    assert any("base_model_precision 'int8-quanto' then, 'int4-quanto' now" in m and "computes otherwise" in m
               for m in warnings), warnings
    run_with(tmp_path, dataset, max_train_steps=3, base_model_precision="int4-quanto")  # unchanged: no new word
    assert len([m for m in messages(tmp_path / "output", "warning") if "base_model_precision" in m]) == 1


def test_bare_resume_flag_asks_for_a_value(tmp_path, dataset):
    problems = config_problems(write_config(tmp_path, dataset, resume_from_checkpoint="true"))
    assert "resume_from_checkpoint needs a value: latest, a checkpoint folder or its name" in problems


def test_the_same_global_batches_on_another_process_count_resume(tmp_path, monkeypatch):
    """2 processes of train_batch_size 1 and 1 process of 2 draw the same batches (the losses repeat exactly): an
    epoch run was refused, and the advice (train_batch_size 1 on 1 process) failed after loading."""
    import json

    from difftune.config.resume_check import batch_changes

    then = {"train_batch_size": 1, "gradient_accumulation_steps": 1, "processes": 2}
    assert batch_changes(then, {**then, "train_batch_size": 2, "processes": 1}) == {}
    assert batch_changes(then, {**then, "processes": 1}) == {"processes": (2, 1)}
    assert batch_changes(then, {**then, "train_batch_size": 2, "processes": 1, "gradient_accumulation_steps": 2}) \
        == {"train_batch_size": (1, 2), "gradient_accumulation_steps": (1, 2), "processes": (2, 1)}
    images = tmp_path / "images"
    make_dataset(images, count=4)
    run_with(tmp_path, images, max_train_steps=0, num_train_epochs=1, train_batch_size=2)
    state = next((tmp_path / "output" / "checkpoints").glob("checkpoint-*")) / "training_state.json"
    saved = json.loads(state.read_text())
    saved["settings"] |= {"train_batch_size": 1, "processes": 2}  # as a 2-process run of train_batch_size 1 saves it
    state.write_text(json.dumps(saved))
    settings = dict(max_train_steps=0, num_train_epochs=2, resume_from_checkpoint="latest")
    assert load_config(write_config(tmp_path, images, train_batch_size=2, **settings))  # 1 process x 2: the same
    problems = config_problems(write_config(tmp_path, images, train_batch_size=1, **settings))
    assert "processes 2 then, 1 now" in problems and "train_batch_size x processes" in problems
    monkeypatch.setenv("WORLD_SIZE", "2")  # launched by torchrun on 2 processes: the same again
    assert load_config(write_config(tmp_path, images, train_batch_size=1, **settings))


def test_an_fsdp_checkpoint_resumed_without_fsdp_is_refused_before_loading(tmp_path, dataset, monkeypatch):
    """Its optimizer state loads into an FSDP run only; the refusal came after the model loaded, and said 'sharded'
    of a FULL_STATE_DICT checkpoint."""
    import json

    from difftune.config.resume_check import fsdp_problem

    folder = tmp_path / "output" / "checkpoints" / "checkpoint-0000002"
    folder.mkdir(parents=True)
    (folder / "optimizer_fsdp.pt").write_bytes(b"")
    (folder / "training_state.json").write_text(json.dumps({"step": 2, "settings": {"optimizer": "adamw"}}))
    train_cfg = load_config(write_config(tmp_path, dataset)).train
    assert "loads into an FSDP run only" in fsdp_problem(train_cfg, folder)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "loads into an FSDP run only" in fsdp_problem(train_cfg, folder)  # two processes, but not sharded
    assert fsdp_problem(train_cfg.model_copy(update={"fsdp_enable": True}), folder) is None
    assert fsdp_problem(train_cfg.model_copy(update={"optimizer": "lion"}), folder) is None  # starts afresh
    # the other direction: a plain run's optimizer.pt into a sharded run failed only after the caches
    (folder / "optimizer_fsdp.pt").unlink()
    (folder / "optimizer.pt").write_bytes(b"")
    sharded = train_cfg.model_copy(update={"fsdp_enable": True})
    assert "written by a run without FSDP (its optimizer.pt)" in fsdp_problem(sharded, folder)
    assert fsdp_problem(train_cfg, folder) is None
    monkeypatch.setenv("WORLD_SIZE", "1")  # fsdp_enable on one process trains unsharded: its optimizer.pt fits
    assert fsdp_problem(sharded, folder) is None


def test_files_removed_before_a_resume_are_said(tmp_path):
    """A killed run, some bad images deleted, resumed: nothing was said, and an epoch-based run counted its epochs in
    the new batches without a word."""
    images = tmp_path / "images"
    make_dataset(images, count=8)
    run_with(tmp_path, images, num_train_epochs=1, max_train_steps=0, train_batch_size=2)
    for path in sorted(images.glob("*.png"))[:4]:
        path.unlink()
        path.with_suffix(".txt").unlink(missing_ok=True)
    run_with(tmp_path, images, num_train_epochs=3, max_train_steps=0, train_batch_size=2)
    (warning,) = [m for m in messages(tmp_path / "output", "warning") if "datasets changed" in m]
    assert "4 batches per epoch then, 2 now" in warning and "the run ends at step 6" in warning


def test_renamed_files_are_warned_about_on_resume(tmp_path, dataset):
    """Files added, removed or renamed with the same number of batches per epoch resumed without a word."""
    run_with(tmp_path, dataset, max_train_steps=1)
    image = sorted(p for p in dataset.iterdir() if p.suffix == ".png")[0]
    image.rename(image.with_name("renamed.png"))
    image.with_suffix(".txt").rename(image.with_name("renamed.txt"))
    run_with(tmp_path, dataset, max_train_steps=2)
    warnings = messages(tmp_path / "output", "warning")
    assert any("the datasets' files changed since" in m and "the batches per epoch are the same" in m
               for m in warnings), warnings
    run_with(tmp_path, dataset, max_train_steps=3)  # unchanged since: no new word
    assert len([m for m in messages(tmp_path / "output", "warning") if "files changed" in m]) == 1


def test_a_lora_checkpoint_resumed_as_a_full_fine_tune_or_without_ema_is_refused_by_check(tmp_path, dataset):
    """`difftune check` said OK to both; training refused them after loading the model."""
    from safetensors.torch import save_file

    from difftune.config.resume_check import lora_problem

    folder = tmp_path / "output" / "checkpoints" / "checkpoint-0000002"
    folder.mkdir(parents=True)
    (folder / "training_state.json").write_text(json.dumps({"step": 2}))
    save_file({"layers.0.attention.to_q.lora_A.weight": torch.zeros(4, 8)}, str(folder / "trainable.safetensors"))
    train_cfg = load_config(write_config(tmp_path, dataset)).train
    full = train_cfg.model_copy(update={"model_type": "full"})
    assert "holds an adapter's weights (a LoRA or LyCORIS run), this run is a full fine-tune" in lora_problem(full, folder)
    assert "has no EMA state but use_ema is on" in lora_problem(train_cfg.model_copy(update={"use_ema": True}), folder)
    (folder / "ema.pt").write_bytes(b"")
    assert lora_problem(train_cfg.model_copy(update={"use_ema": True, "lora_rank": 4}), folder) is None
    save_file({"layers.0.attention.to_q.weight": torch.zeros(8, 8)}, str(folder / "trainable.safetensors"))
    assert lora_problem(full, folder) is None  # a full fine-tune's own checkpoint


def test_resuming_an_ema_run_without_ema_says_the_ema_result_is_an_earlier_one(tmp_path, dataset):
    """ema/ stayed the earlier step's EMA beside this run's result, without a word."""
    config = write_config(tmp_path, dataset, max_train_steps=1, use_ema=True, checkpoint_step_interval=1)
    train(build_run(load_config(config)))
    run = build_run(load_config(config, {"max_train_steps": 2, "use_ema": False, "resume_from_checkpoint": "latest"}))
    train(run)
    events = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "warning" and "its EMA state is not used (use_ema is off)" in e["message"] for e in events)
