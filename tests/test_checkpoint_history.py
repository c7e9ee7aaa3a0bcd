"""The checkpoint folder over several runs: a branch or a restart sets later checkpoints aside (never deletes them,
never resumes them by 'latest'), pruning never takes the one just written, an incomplete checkpoint is passed over,
another trainer's checkpoint is refused before any model loads, and checkpoint errors end as `error:` lines."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from conftest import config_problems, write_config
from difftune.cli import main
from difftune.config import load_config
from difftune.train.checkpoint import (
    STATE_FILE,
    CheckpointError,
    complete,
    prune_checkpoints,
    resolve_resume,
)
from difftune.train.loop import train
from difftune.train.setup import build_run


def events_of(output_dir):
    return [json.loads(x) for x in (output_dir / "events.jsonl").read_text().splitlines()]


def warnings_after(output_dir, start: int) -> list[str]:
    return [e["message"] for e in events_of(output_dir)[start:] if e["event"] == "warning"]


def test_a_branch_keeps_its_checkpoints_and_latest_resumes_it(tmp_path, dataset):
    """8 steps (checkpoints 2, 4, 6, 8), then back to checkpoint 2 for 5 steps with a limit of 2: the branch's 4 and 5
    stay (pruning deleted them at once before), the old 4, 6 and 8 are set aside with a warning, and 'latest' then
    continues the branch, not the abandoned run."""
    out = tmp_path / "output"
    ckpts = out / "checkpoints"
    train(build_run(load_config(write_config(tmp_path, dataset, max_train_steps=8, checkpoint_step_interval=2))))
    seen = len(events_of(out))
    train(build_run(load_config(write_config(tmp_path, dataset, max_train_steps=5, checkpoint_step_interval=2,
                                             checkpoints_total_limit=2,
                                             resume_from_checkpoint=str(ckpts / "checkpoint-0000002")))))
    assert [p.name for p in complete(out)] == ["checkpoint-0000004", "checkpoint-0000005"]
    (aside,) = [p for p in ckpts.iterdir() if p.name.startswith("superseded-")]
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-0000004", "checkpoint-0000006", "checkpoint-0000008"]
    (warning,) = warnings_after(out, seen)
    assert "(checkpoint-0000004, checkpoint-0000006, checkpoint-0000008)" in warning and str(aside) in warning
    assert "continues from checkpoint-0000002" in warning and "Nothing was deleted" in warning
    pruned = [e["pruned"] for e in events_of(out)[seen:] if e["event"] == "checkpoint"]
    assert pruned == [[], ["checkpoint-0000002"]]

    seen = len(events_of(out))
    train(build_run(load_config(write_config(tmp_path, dataset, max_train_steps=6, resume_from_checkpoint="latest"))))
    resumed = [e["message"] for e in events_of(out)[seen:] if e["event"] == "info" and "resumed" in e["message"]]
    assert resumed == [f"resumed from {ckpts / 'checkpoint-0000005'} at step 5"]
    assert not warnings_after(out, seen)  # nothing after step 5 to set aside; the superseded folder is not looked at


def test_a_run_from_step_0_sets_the_earlier_result_aside(tmp_path, dataset):
    """A second run from scratch in the same output_dir overwrote the first one's LoRA and samples file by file (a
    SimpleTuner LoRA left there too); they are moved into output_dir/superseded-<time>/, with a warning."""
    out = tmp_path / "output"
    keys = dict(max_train_steps=1, validation_prompt="a red circle", validation_step_interval=1,
                validation_num_inference_steps=1, validation_resolution=32)
    train(build_run(load_config(write_config(tmp_path, dataset, **keys))))
    first = (out / "pytorch_lora_weights.safetensors").read_bytes()
    samples = sorted(p.name for p in (out / "validation").rglob("*") if p.is_file())
    assert samples
    (out / "README.md").write_text("| steps | 1 |")  # a pushed run's model card: it describes that result
    seen = len(events_of(out))
    train(build_run(load_config(write_config(tmp_path, dataset, **keys))))
    (aside,) = [p for p in out.iterdir() if p.name.startswith("superseded-")]
    assert (aside / "pytorch_lora_weights.safetensors").read_bytes() == first
    assert (aside / "README.md").is_file() and not (out / "README.md").exists()
    assert sorted(p.name for p in (aside / "validation").rglob("*") if p.is_file()) == samples
    assert (out / "pytorch_lora_weights.safetensors").is_file()  # this run's
    (warning,) = [w for w in warnings_after(out, seen) if "result" in w]  # the other: its checkpoint, set aside
    assert "earlier run's result (pytorch_lora_weights.safetensors, validation, README.md)" in warning and str(aside) in warning
    seen = len(events_of(out))  # a resume continues this run's result: nothing is set aside
    train(build_run(load_config(write_config(tmp_path, dataset, **{**keys, "max_train_steps": 2},
                                             resume_from_checkpoint="latest"))))
    assert not warnings_after(out, seen) and len([p for p in out.iterdir() if p.name.startswith("superseded-")]) == 1


def fake_checkpoint(folder, step: int, optimizer: str = "optimizer.pt"):
    """The files of a checkpoint (contents only as far as resolve_resume reads them)."""
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, folder / "trainable.safetensors")
    for name in (optimizer, "lr_scheduler.pt", "rng.pt"):
        torch.save({"step": step}, folder / name)
    (folder / STATE_FILE).write_text(json.dumps({"step": step, "sampler": {}}))
    return folder


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    """A later checkpoint left behind (set_aside_later moves them, this is the last line of defence): the one just
    written stays, and only older ones are pruned."""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        fake_checkpoint(root / f"checkpoint-{step:07d}", step)
    assert prune_checkpoints(tmp_path, 1, written=root / "checkpoint-0000004") == ["checkpoint-0000002"]
    assert [p.name for p in complete(tmp_path)] == ["checkpoint-0000004", "checkpoint-0000006", "checkpoint-0000008"]


@pytest.mark.parametrize("removed", ["optimizer.pt", "lr_scheduler.pt", "rng.pt", "trainable.safetensors",
                                     STATE_FILE])
def test_a_checkpoint_missing_a_file_is_passed_over_or_refused(tmp_path, removed):
    root = tmp_path / "checkpoints"
    fake_checkpoint(root / "checkpoint-0000002", 2)
    newest = fake_checkpoint(root / "checkpoint-0000004", 4)
    (newest / removed).unlink()
    warned = []
    assert resolve_resume(tmp_path, "latest", warned.append) == root / "checkpoint-0000002"
    (warning,) = warned
    assert f"passing over checkpoint-0000004: its {removed} is missing; trying the one before" in warning
    assert "FSDP" not in warning
    with pytest.raises(CheckpointError, match=f"is not intact: its {removed} is missing") as err:
        resolve_resume(tmp_path, str(newest))
    assert "FSDP" not in str(err.value)


@pytest.mark.parametrize("damaged", ["optimizer.pt", "lr_scheduler.pt", "rng.pt", STATE_FILE])
@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_a_checkpoint_with_a_damaged_file_is_passed_over_or_refused(tmp_path, damaged, damage):
    """A partial copy or a disk error: 'latest' takes the one before (it died in torch.load); a named one is an
    error line (it was a traceback advising weights_only=False)."""
    root = tmp_path / "checkpoints"
    fake_checkpoint(root / "checkpoint-0000002", 2)
    newest = fake_checkpoint(root / "checkpoint-0000004", 4)
    size = (newest / damaged).stat().st_size
    (newest / damaged).write_bytes((newest / damaged).read_bytes()[: size // 2] if damage == "truncated"
                                   else bytes(size))
    warned = []
    assert resolve_resume(tmp_path, "latest", warned.append) == root / "checkpoint-0000002"
    assert f"passing over checkpoint-0000004: its {damaged} " in warned[0]
    with pytest.raises(CheckpointError, match=f"is not intact: its {damaged} "):
        resolve_resume(tmp_path, str(newest))


def test_a_checkpoint_of_the_first_difftune_versions_is_passed_over(tmp_path):
    """Their state had no data position: the resume died in a raw KeyError: 'sampler'."""
    root = tmp_path / "checkpoints"
    fake_checkpoint(root / "checkpoint-0000002", 2)
    newest = fake_checkpoint(root / "checkpoint-0000004", 4)
    (newest / STATE_FILE).write_text(json.dumps({"step": 4, "epoch": 0, "batch_index": 4}))
    warned = []
    assert resolve_resume(tmp_path, "latest", warned.append) == root / "checkpoint-0000002"
    assert "has no data position (written by an early difftune" in warned[0]


def sharded_state(folder) -> None:
    """An optimizer state as FSDP's SHARDED_STATE_DICT writes it (torch.distributed.checkpoint: .metadata and one
    file per process; one process here)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saving without a process group
        dcp.save({"state": {"exp_avg": torch.ones(3)}}, checkpoint_id=str(folder))


@pytest.mark.parametrize("optimizer", ["optimizer_fsdp.pt", "optimizer_fsdp"])
def test_an_fsdp_checkpoint_is_complete(tmp_path, optimizer):
    folder = fake_checkpoint(tmp_path / "checkpoints" / "checkpoint-0000002", 2, optimizer="rng.pt")
    sharded_state(folder / optimizer) if "." not in optimizer else torch.save({}, folder / optimizer)
    assert resolve_resume(tmp_path, "latest") == folder


@pytest.mark.parametrize("damage", ["missing", "cut short"])
def test_an_fsdp_checkpoint_missing_a_shard_is_passed_over(tmp_path, damage):
    """'latest' took it, and every process failed in torch.distributed.checkpoint's reader (a traceback); a
    truncated shard too."""
    root = tmp_path / "checkpoints"
    older = fake_checkpoint(root / "checkpoint-0000002", 2, optimizer="rng.pt")
    newest = fake_checkpoint(root / "checkpoint-0000004", 4, optimizer="rng.pt")
    for folder in (older, newest):
        sharded_state(folder / "optimizer_fsdp")
    shard = next((newest / "optimizer_fsdp").glob("*.distcp"))
    if damage == "missing":
        shard.unlink()
    else:
        os.truncate(shard, shard.stat().st_size - 1)
    warned = []
    assert resolve_resume(tmp_path, "latest", warned.append) == older
    assert f"its optimizer_fsdp/{shard.name} is {damage}" in warned[0]


def test_another_trainers_checkpoint_is_refused_by_check(tmp_path, dataset):
    """SimpleTuner's layout (its LoRA and a training_state.json, none of difftune's files): refused before any model
    loads, pointing to init_lora only when that LoRA file is there."""
    theirs = tmp_path / "output" / "checkpoint-500"
    theirs.mkdir(parents=True)
    (theirs / STATE_FILE).write_text("{}")
    path = write_config(tmp_path, dataset, resume_from_checkpoint=str(theirs))
    problems = config_problems(path)
    assert "is not a difftune checkpoint (no trainable.safetensors; SimpleTuner's checkpoints cannot be resumed)" \
        in problems and "init_lora" not in problems
    (theirs / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    assert f"init_lora: '{theirs / 'pytorch_lora_weights.safetensors'}'" in config_problems(path)
    # named as SimpleTuner users name it (its checkpoints lie directly in output_dir): the same answer, not "does
    # not exist"
    by_name = config_problems(write_config(tmp_path, dataset, resume_from_checkpoint="checkpoint-500"))
    assert f"init_lora: '{theirs / 'pytorch_lora_weights.safetensors'}'" in by_name


def test_resume_past_the_end_and_simpletuner_folders_warn_and_bad_checkpoints_exit_2(tmp_path, dataset, capsys):
    out = tmp_path / "output"
    train(build_run(load_config(write_config(tmp_path, dataset, max_train_steps=2, checkpoint_step_interval=1))))
    (out / "checkpoint-500").mkdir()  # SimpleTuner's layout: its checkpoints directly in output_dir
    seen = len(events_of(out))
    train(build_run(load_config(write_config(tmp_path, dataset, max_train_steps=1, resume_from_checkpoint="latest"))))
    theirs, past = warnings_after(out, seen)
    assert "holds checkpoint-500 directly (SimpleTuner's layout)" in theirs and "init_lora" in theirs
    assert "checkpoint-0000002 is at step 2, already at or past this run's 1 steps: nothing is trained" in past
    assert "resume_from_checkpoint to an earlier checkpoint (checkpoint-NNNNNNN" in past
    assert [e["step"] for e in events_of(out)[seen:] if e["event"] == "done"] == [2]

    # A named checkpoint that lost a file: `error: ...` and exit status 2, no traceback
    (out / "checkpoints" / "checkpoint-0000001" / "optimizer.pt").unlink()
    path = write_config(tmp_path, dataset, resume_from_checkpoint=str(out / "checkpoints" / "checkpoint-0000001"))
    capsys.readouterr()
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "error: resume_from_checkpoint:" in err and "its optimizer.pt is missing" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("failing", ["checkpoint", "result"])
def test_a_failed_write_is_one_line_and_the_run_resumes(tmp_path, dataset, capsys, monkeypatch, failing):
    """Disk full while a checkpoint (torch.save's error) or the final LoRA (the OS's) is written: `error: ...`
    naming the folder and the checkpoint a resume takes, exit status 2, the partial checkpoint removed, the earlier
    ones whole; run again, it resumes with the uninterrupted run's losses."""
    import errno

    from difftune.train import checkpoint as ckpt
    from test_train import losses

    common = dict(max_train_steps=4, checkpoint_step_interval=2, resume_from_checkpoint="latest")
    train(build_run(load_config(write_config(tmp_path / "a", dataset, **common))))
    real_save, real_write = torch.save, ckpt._write_adapter

    def full_disk_save(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt") and "checkpoint-0000004" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                               "data/0: file write failed")
        return real_save(obj, f, *args, **kwargs)

    def full_disk_result(run, folder):
        if folder == run.output_dir:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(run, folder)

    if failing == "checkpoint":
        monkeypatch.setattr(ckpt.torch, "save", full_disk_save)
    else:
        monkeypatch.setattr(ckpt, "_write_adapter", full_disk_result)
    path = write_config(tmp_path / "b", dataset, **common)
    capsys.readouterr()
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    out = tmp_path / "b" / "output"
    what = "checkpoint checkpoint-0000004 in " + str(out / "checkpoints") if failing == "checkpoint" else \
        f"the trained weights in {out}"
    last = "checkpoint-0000002" if failing == "checkpoint" else "checkpoint-0000004"
    assert f"error: cannot write {what} (" in err and f"it resumes from {last}" in err and "Traceback" not in err
    assert err.count(f"cannot write {what}") == 1  # the error event stays off the console: said once
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert [p.name for p in complete(out)][-1] == last
    monkeypatch.undo()
    assert main(["train", "--config", str(path)]) == 0
    assert losses(out) == losses(tmp_path / "a" / "output")  # the last loss of each step
    assert (out / "pytorch_lora_weights.safetensors").is_file()


def test_a_sample_that_cannot_be_written_is_a_warning(tmp_path, dataset, monkeypatch):
    """A full disk at a validation sample killed the run with a traceback, before the checkpoint due at that step."""
    import errno

    from difftune.train import validation

    def full_disk(image, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(validation, "_save_png", full_disk)
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=2, checkpoint_step_interval=2,
                                             validation_step_interval=2, validation_prompt="a red circle")))
    train(run)
    out = tmp_path / "output"
    warned = [m for m in warnings_after(out, 0) if m.startswith("sample not saved")]
    assert warned and "(No space left on device); training goes on" in warned[0]
    assert [p.name for p in complete(out)] == ["checkpoint-0000002"]
    assert [e for e in events_of(out) if e["event"] == "done"]


def test_damage_inside_an_optimizer_state_is_one_line(tmp_path, dataset, capsys):
    """Only the zip directory of optimizer.pt is checked before loading (it may be gigabytes): damage inside it
    failed in torch.load with a traceback advising weights_only=False. It names the file and the checkpoint before."""
    path = write_config(tmp_path, dataset, max_train_steps=4, checkpoint_step_interval=2,
                        resume_from_checkpoint="latest")
    assert main(["train", "--config", str(path)]) == 0
    state = tmp_path / "output" / "checkpoints" / "checkpoint-0000004" / "optimizer.pt"
    data = bytearray(state.read_bytes())
    data[:64] = bytes(64)  # its first entry's header; the directory at the end stays whole
    state.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["train", "--config", str(write_config(tmp_path, dataset, max_train_steps=6, checkpoint_step_interval=2,
                                                       resume_from_checkpoint="latest"))]) == 2
    err = capsys.readouterr().err
    assert "its optimizer.pt cannot be read" in err and "(resume_from_checkpoint checkpoint-0000002)" in err
    assert "Traceback" not in err


def test_a_damaged_model_source_record_is_a_warning(tmp_path, dataset):
    """model_source.json only feeds a warning: damaged, the checkpoint was unusable, with a bare JSON message."""
    train(build_run(load_config(write_config(tmp_path, dataset, max_train_steps=2, checkpoint_step_interval=2))))
    out = tmp_path / "output"
    (out / "checkpoints" / "checkpoint-0000002" / "model_source.json").write_text('{"transf')
    seen = len(events_of(out))
    train(build_run(load_config(write_config(tmp_path, dataset, max_train_steps=3, resume_from_checkpoint="latest"))))
    assert [e["step"] for e in events_of(out)[seen:] if e["event"] == "step"] == [3]
    assert any("model_source.json" in m and "is not compared" in m for m in warnings_after(out, seen))


def test_a_full_disk_under_torch_distributed_checkpoint_is_a_write_error(tmp_path):
    """FSDP's sharded optimizer state is written by torch.distributed.checkpoint, which wraps each process's OSError
    in a CheckpointException (a BaseException): a full disk was a traceback on every process, not the one-line
    error that says which checkpoint a resume takes."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from difftune.train.checkpoint import WriteError, written

    full = OSError(errno.ENOSPC, "No space left on device")
    partial = tmp_path / "checkpoints" / ".tmp-optimizer_fsdp-0000004"
    partial.mkdir(parents=True)
    with pytest.raises(WriteError, match=r"cannot write the sharded optimizer state .*\(No space left on device\); "
                                         "free disk space"):
        with written("the sharded optimizer state", partial, tmp_path, partial=partial):
            raise CheckpointException("save failed", {0: _wrap_exception(full)})
    assert not partial.exists()  # its space given back
