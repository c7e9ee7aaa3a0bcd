"""End-to-end training on the tiny Lumina2: learning, validation == stock pipeline, exact resume."""

import json

import pytest
import torch

from conftest import write_config
from difftune.config import load_config
from difftune.demo import make_dataset
from difftune.train import loop
from difftune.train.loop import train
from difftune.train.setup import build_run


def losses(output_dir):
    lines = (output_dir / "events.jsonl").read_text().splitlines()
    return {e["step"]: e["loss"] for e in map(json.loads, lines) if e["event"] == "step"}


class Crash(Exception):
    pass


def crash_then_resume(monkeypatch, config, at_step: int, error: type[BaseException] = Crash) -> None:
    """Run `config` until `at_step` steps are done, fail there, then run it again (it resumes)."""
    real_step = loop.optimizer_step

    def dying_step(run, batches):
        if run.state.step == at_step:
            raise error()
        return real_step(run, batches)

    monkeypatch.setattr(loop, "optimizer_step", dying_step)
    with pytest.raises(error):
        train(build_run(load_config(config)))
    monkeypatch.setattr(loop, "optimizer_step", real_step)
    train(build_run(load_config(config)))


@pytest.mark.parametrize("stop", ["crash", "interrupt"])
def test_resume_gives_same_losses(tmp_path, monkeypatch, stop):
    images = tmp_path / "images"
    make_dataset(images, count=6)
    common = dict(max_train_steps=7, checkpoint_step_interval=3, lr_scheduler="linear", lr_warmup_steps=2,
                  train_batch_size=2, gradient_accumulation_steps=2, resume_from_checkpoint="latest")
    full = write_config(tmp_path / "a", images, **common)
    train(build_run(load_config(full)))
    expected = losses(tmp_path / "a" / "output")

    # Second run: dies after step 5 (crash: no save; resumes from step 3) or is interrupted (saves step 5).
    cut = write_config(tmp_path / "b", images, **common)
    real_step = loop.optimizer_step
    calls = {"n": 0}

    def dying_step(run, batches):
        if run.state.step == 5:
            raise Crash() if stop == "crash" else KeyboardInterrupt()
        return real_step(run, batches)

    monkeypatch.setattr(loop, "optimizer_step", dying_step)
    with pytest.raises(Crash if stop == "crash" else KeyboardInterrupt):
        train(build_run(load_config(cut)))
    monkeypatch.setattr(loop, "optimizer_step", real_step)
    ckpts = sorted(p.name for p in (tmp_path / "b" / "output" / "checkpoints").iterdir())
    assert ckpts[-1] == ("checkpoint-0000003" if stop == "crash" else "checkpoint-0000005")
    train(build_run(load_config(cut)))
    resumed = losses(tmp_path / "b" / "output")  # the log holds both runs; later lines win
    assert sorted(resumed) == sorted(expected)
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    del calls


def test_a_step_cut_in_the_middle_saves_the_position_of_the_step_before(tmp_path, monkeypatch):
    """An interrupt inside a step's micro-batches (a second Ctrl-C) saved the step before with the position after
    the batches the cut step had drawn: the resume skipped them."""
    images = tmp_path / "images"
    make_dataset(images, count=6)
    common = dict(max_train_steps=6, train_batch_size=1, gradient_accumulation_steps=2)
    train(build_run(load_config(write_config(tmp_path / "a", images, checkpoint_step_interval=4, **common))))
    real = loop.micro_step

    def cut(run, batch):
        if run.state.step == 4 and run.state.micro == 1:
            raise KeyboardInterrupt()
        return real(run, batch)

    monkeypatch.setattr(loop, "micro_step", cut)
    with pytest.raises(KeyboardInterrupt):
        train(build_run(load_config(write_config(tmp_path / "b", images, **common))))
    a, b = (json.loads((tmp_path / x / "output" / "checkpoints" / "checkpoint-0000004" / "training_state.json")
                       .read_text())["sampler"] for x in "ab")
    assert a == b


def test_unreadable_image_is_skipped_with_warning(tmp_path, dataset, capsys):
    (dataset / "broken.png").write_bytes(open(next(dataset.glob("*.png")), "rb").read()[:60])
    (dataset / "broken.txt").write_text("broken")
    (dataset / "empty.png").write_bytes(b"")
    (dataset / "empty.txt").write_text("empty")
    path = write_config(tmp_path, dataset, max_train_steps=2)
    run = build_run(load_config(path))
    train(run)
    err = capsys.readouterr().err
    assert "broken.png" in err and "empty.png" in err
    assert len(run.data.items) == 4
    warnings = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "warning" and "broken.png" in e["message"] for e in warnings)


def test_prompt_library_samples_every_prompt(tmp_path, dataset):
    library = tmp_path / "library.json"
    library.write_text('{"portrait": "a face", "landscape": "hills"}')
    path = write_config(tmp_path, dataset, max_train_steps=2, validation_prompt="a red circle",
                        user_prompt_library=str(library), validation_resolution="32x32,64x48",
                        validation_num_inference_steps=2, validation_step_interval=1)
    run = build_run(load_config(path))
    train(run)
    names = sorted(p.name for p in (run.output_dir / "validation").glob("final-*.png"))
    assert names == sorted(f"final-step-000002{n}-{s}.png" for n in ("", "-portrait", "-landscape", "-unconditional")
                           for s in ("32x32", "64x48"))
    assert len(list((run.output_dir / "validation").glob("step-000001*.png"))) == 8


def test_commands_save_sample_stop(tmp_path, dataset):
    from difftune.train.commands import send_command

    path = write_config(tmp_path, dataset, max_train_steps=50, validation_prompt="a red circle",
                        validation_resolution="32x32", validation_num_inference_steps=2, checkpoint_step_interval=1)
    run = build_run(load_config(path))
    for command in ("save", "sample", "stop"):  # queued before the run: picked up after step 1
        send_command(run.output_dir, command)
    with pytest.raises(ValueError):
        send_command(run.output_dir, "explode")
    train(run)
    events = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.count("command") == 3 and "stopped" in kinds and "done" not in kinds
    # step 1's interval checkpoint, then the save and the stop find it written: one checkpoint, listed once by the UI
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [1]
    assert "stopped by a stop command at step 1 of 50; resume_from_checkpoint 'latest' goes on from here" in [
        e.get("message") for e in events]  # on the console too: "LoRA saved" alone read as a finished run
    assert run.state.step == 1
    assert (run.output_dir / "validation" / "manual-step-000001-32x32.png").exists()
    assert (run.output_dir / "pytorch_lora_weights.safetensors").exists()
    assert not list((run.output_dir / "commands").glob("*.json"))


def test_a_step_without_a_regular_checkpoint_still_gets_one(tmp_path, dataset):
    """The checkpoint-once rule skips only a step whose regular checkpoint is written: a save command writes one, and
    a stop right after a rolling checkpoint (its own series) still writes the regular one."""
    from difftune.train.commands import send_command

    def checkpoints(root, **keys):
        run = build_run(load_config(write_config(root, dataset, **keys)))
        for command in commands:
            send_command(run.output_dir, command)
        train(run)
        events = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
        return [(e["step"], bool(e.get("rolling"))) for e in events if e["event"] == "checkpoint"]

    commands = ["save"]  # after step 1; the run goes on to its end
    assert checkpoints(tmp_path / "save", max_train_steps=2) == [(1, False), (2, False)]
    commands = ["stop"]
    assert checkpoints(tmp_path / "rolling", max_train_steps=5, checkpointing_rolling_steps=1) == [(1, True),
                                                                                                    (1, False)]


def test_fp16_on_the_cpu_is_said_to_compute_in_the_weights_dtype(tmp_path, dataset):
    """accelerate has no fp16 autocast on the CPU: the losses were bit for bit those of 'no', without a word."""
    run = build_run(load_config(write_config(tmp_path, dataset, mixed_precision="fp16", max_train_steps=1)))
    events = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "warning" and "mixed_precision 'fp16' has no autocast on the CPU" in e["message"]
               for e in events)


def test_a_stop_sent_to_a_run_that_died_does_not_stop_the_next(tmp_path, dataset):
    """A stop the web UI sent to a run that was killed before reading it ended the resume after one step."""
    path = write_config(tmp_path, dataset, max_train_steps=2)
    folder = tmp_path / "output" / "commands"
    folder.mkdir(parents=True)
    (folder / "1700000000000000000-stop.json").write_text(json.dumps({"command": "stop", "time": 1700000000}))
    run = build_run(load_config(path))
    train(run)
    events = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "done" and run.state.step == 2
    (warning,) = [e["message"] for e in events if e["event"] == "warning" and "stop" in e["message"]]
    assert "ignored a 'stop' command sent at" in warning and "before this run started" in warning
    assert not list(folder.glob("*.json"))


def test_error_is_reported_in_the_event_log(tmp_path, dataset, monkeypatch):
    path = write_config(tmp_path, dataset, max_train_steps=3)
    run = build_run(load_config(path))

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(loop, "optimizer_step", broken)
    with pytest.raises(RuntimeError):
        train(run)
    last = json.loads((run.output_dir / "events.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "error" and "out of memory" in last["message"] and "Traceback" in last["traceback"]


@pytest.mark.parametrize("optimizer", ["lion", "prodigy", "adamw8bit"])
def test_optimizers_train_and_resume_exactly(tmp_path, dataset, monkeypatch, optimizer):
    common = dict(max_train_steps=5, checkpoint_step_interval=2, optimizer=optimizer, resume_from_checkpoint="latest",
                  learning_rate=1.0 if optimizer == "prodigy" else 1e-3)
    train(build_run(load_config(write_config(tmp_path / "a", dataset, **common))))
    expected = losses(tmp_path / "a" / "output")
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", dataset, **common), at_step=3)
    resumed = losses(tmp_path / "b" / "output")
    assert all(resumed[s] == pytest.approx(expected[s], rel=1e-6, abs=1e-7) for s in expected)


def test_ema_saved_validated_and_resumed(tmp_path, dataset, monkeypatch):
    from safetensors.torch import load_file

    common = dict(max_train_steps=5, checkpoint_step_interval=2, use_ema=True, ema_decay=0.5,
                  resume_from_checkpoint="latest", validation_prompt="a red circle",
                  validation_resolution="32x32", validation_num_inference_steps=2,
                  validation_disable_unconditional=True)
    run = build_run(load_config(write_config(tmp_path / "a", dataset, **common)))
    train(run)
    out = tmp_path / "a" / "output"
    assert (out / "ema" / "pytorch_lora_weights.safetensors").exists()
    assert (out / "checkpoints" / "checkpoint-0000002" / "ema.pt").exists()
    assert {p.name for p in (out / "validation").glob("final-*")} == {
        "final-step-000005-32x32.png", "final-step-000005-32x32-ema.png"}
    live, ema = load_file(out / "pytorch_lora_weights.safetensors"), load_file(out / "ema" / "pytorch_lora_weights.safetensors")
    assert any(not torch.equal(live[k], ema[k]) for k in live)
    crash_then_resume(monkeypatch, write_config(tmp_path / "b", dataset, **common), at_step=3)
    resumed = load_file(tmp_path / "b" / "output" / "ema" / "pytorch_lora_weights.safetensors")
    for key in ema:
        torch.testing.assert_close(resumed[key], ema[key], rtol=1e-6, atol=1e-7)


def test_resaved_checkpoint_survives_a_kill_between_renames(tmp_path):
    from difftune.train.checkpoint import STATE_FILE, clean_partial, find_latest

    root = tmp_path / "checkpoints"
    for step in (10, 12):
        folder = root / f"checkpoint-{step:07d}"
        folder.mkdir(parents=True)
        (folder / STATE_FILE).write_text("{}")
    # Killed mid re-save of step 12: the old copy set aside, the new one still a temp folder.
    (root / "checkpoint-0000012").rename(root / ".replaced-checkpoint-0000012-123")
    (root / ".tmp-checkpoint-0000012-123").mkdir()
    clean_partial(tmp_path)
    assert find_latest(tmp_path).name == "checkpoint-0000012"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-0000010", "checkpoint-0000012"]


# --- SIGTERM on the command line (train/run_lock.py), the logged rate, a fresh run over old checkpoints


def events_of(output_dir) -> list[dict]:
    return [json.loads(x) for x in (output_dir / "events.jsonl").read_text().splitlines()]


def test_sigterm_mid_step_finishes_the_step_then_saves_and_resumes_exactly(tmp_path, monkeypatch):
    """Under the command line's handler, a SIGTERM that arrives during step 4's first micro-batch lets step 4
    end and be logged, then saves an interrupted checkpoint of step 4 (the rolling one of step 3 is older) and
    logs a stopped event that says so; resumed, the run has the uninterrupted run's losses. The handler that was
    there before is put back."""
    import os
    import signal

    from difftune.train.run_lock import Terminated, sigterm_stops

    images = tmp_path / "images"
    make_dataset(images, count=6)
    common = dict(max_train_steps=6, checkpoint_step_interval=3, lr_scheduler="linear", lr_warmup_steps=2,
                  train_batch_size=2, gradient_accumulation_steps=2, resume_from_checkpoint="latest")
    train(build_run(load_config(write_config(tmp_path / "a", images, **common))))
    expected = losses(tmp_path / "a" / "output")

    cut = write_config(tmp_path / "b", images, **common)
    real_micro = loop.micro_step

    def signalled(run, batch):
        if run.state.step == 3 and run.state.micro == 0:  # step 4, its first of two micro-batches
            os.kill(os.getpid(), signal.SIGTERM)
        return real_micro(run, batch)

    monkeypatch.setattr(loop, "micro_step", signalled)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_stops():
        train(build_run(load_config(cut)))
    assert signal.getsignal(signal.SIGTERM) is before
    monkeypatch.setattr(loop, "micro_step", real_micro)
    out = tmp_path / "b" / "output"
    log = events_of(out)
    assert [e["step"] for e in log if e["event"] == "step"] == [1, 2, 3, 4]
    saved = [e for e in log if e["event"] == "checkpoint"]
    assert [(e["step"], e.get("reason")) for e in saved] == [(3, None), (4, "terminated by SIGTERM")]
    assert {k: log[-1][k] for k in ("event", "step", "reason")} == {"event": "stopped", "step": 4,
                                                                     "reason": "terminated by SIGTERM"}
    train(build_run(load_config(cut)))
    resumed = losses(out)
    assert [e["message"] for e in events_of(out) if e["event"] == "info" and "resumed" in e["message"]][-1] \
        .endswith("at step 4")
    assert sorted(resumed) == sorted(expected)
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step


def test_step_one_logs_the_warm_up_rate_it_trained_with(tmp_path, dataset, monkeypatch):
    """A one-step warm-up: step 1 trains at the warm-up's first rate, 0, and is logged so; the LoRA it saves is
    still the untrained one (lora_B zero). A library run (no command line) leaves SIGTERM's handler alone."""
    import signal

    from safetensors.torch import load_file

    handlers = []
    real_micro = loop.micro_step

    def watched(run, batch):
        handlers.append(signal.getsignal(signal.SIGTERM))
        return real_micro(run, batch)

    monkeypatch.setattr(loop, "micro_step", watched)
    before = signal.getsignal(signal.SIGTERM)
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=2, lr_warmup_steps=2,
                                             lr_scheduler="constant", learning_rate=1e-3)))
    train(run)
    assert [e["lr"] for e in events_of(run.output_dir) if e["event"] == "step"] == [0.0, pytest.approx(5e-4)]
    assert handlers and all(h is before for h in handlers)
    one = build_run(load_config(write_config(tmp_path / "one", dataset, max_train_steps=1, lr_warmup_steps=1,
                                             lr_scheduler="constant")))
    train(one)
    assert [e["lr"] for e in events_of(one.output_dir) if e["event"] == "step"] == [0.0]
    weights = load_file(one.output_dir / "pytorch_lora_weights.safetensors")
    ups = [t for k, t in weights.items() if "lora_B" in k]
    assert ups and all(not t.any() for t in ups)


def test_a_fresh_run_over_old_checkpoints_warns(tmp_path, dataset):
    """resume_from_checkpoint unset in an output_dir that holds checkpoints: the run starts from step 0 (as asked),
    moves them into checkpoints/superseded-*/ (never overwritten, never resumed by 'latest') and warns."""
    path = write_config(tmp_path, dataset, max_train_steps=2, checkpoint_step_interval=1)
    train(build_run(load_config(path)))
    assert not [e for e in events_of(tmp_path / "output") if e["event"] == "warning"]
    train(build_run(load_config(path)))
    log = events_of(tmp_path / "output")
    second = log[next(i for i, e in enumerate(log) if e["event"] == "done"):]  # the second run's events
    warning, result = [e["message"] for e in second if e["event"] == "warning"]
    assert "earlier run's result (pytorch_lora_weights.safetensors)" in result  # moved aside too, not overwritten
    assert "2 checkpoint(s) after step 0 (checkpoint-0000001, checkpoint-0000002)" in warning
    assert "starts from step 0 (resume_from_checkpoint is not set" in warning and "superseded-" in warning
    (aside,) = (tmp_path / "output" / "checkpoints").glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-0000001", "checkpoint-0000002"]
    assert [e["step"] for e in log if e["event"] == "start"] == [0, 0]
