"""Non-finite losses from the data are blamed on the data; checkpoints with non-finite weights are not
resumed from; results outside checkpoints are written atomically."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file, save_file

from conftest import write_config
from difftune.config import load_config
from difftune.train.checkpoint import clean_partial, resolve_resume, save_adapter
from difftune.train.loop import NonFiniteError, train
from difftune.train.setup import build_run


def events_of(output_dir):
    return [json.loads(x) for x in (output_dir / "events.jsonl").read_text().splitlines()]


def test_nonfinite_data_is_blamed_on_the_data(tmp_path, dataset):
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=6, max_nonfinite_steps=2)))
    real = run.data._latents

    def poisoned(chosen, epoch=0):  # a damaged entry that got past every check: the loop must still name it
        kept, latents, *rest = real(chosen, epoch)  # the input images' latents and loss masks, as they are
        return kept, latents * float("nan"), *rest

    run.data._latents = poisoned
    with pytest.raises(NonFiniteError) as err:
        train(run)
    message = str(err.value)
    assert "data is bad" in message and "latents hold NaN" in message and str(dataset) in message
    assert "learning_rate" not in message
    warnings = [e["message"] for e in events_of(run.output_dir) if e["event"] == "warning"]
    assert len(warnings) == 2 and all("not finite" in w and "because the batch's data is bad" in w for w in warnings)


def poison(checkpoint: Path) -> None:
    weights = load_file(checkpoint / "trainable.safetensors")
    first = sorted(weights)[0]
    weights[first] = weights[first].clone()
    weights[first].view(-1)[0] = float("inf")
    save_file(weights, checkpoint / "trainable.safetensors")


def test_nonfinite_checkpoint_is_not_resumed_and_results_are_atomic(tmp_path, dataset, monkeypatch):
    config = write_config(tmp_path, dataset, max_train_steps=4, checkpoint_step_interval=2,
                          resume_from_checkpoint="latest")
    train(build_run(load_config(config)))
    output = tmp_path / "output"
    ckpts = output / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["checkpoint-0000002", "checkpoint-0000004"]
    assert not [p for p in output.iterdir() if p.name.startswith(".")]  # no leftovers of the atomic save
    poison(ckpts / "checkpoint-0000004")

    warned = []
    assert resolve_resume(output, "latest", warned.append) == ckpts / "checkpoint-0000002"
    assert "checkpoint-0000004" in warned[0] and "not finite" in warned[0]
    with pytest.raises(ValueError, match="not intact: its weights are not finite"):
        resolve_resume(output, str(ckpts / "checkpoint-0000004"))
    (ckpts / "checkpoint-0000002" / "trainable.safetensors").write_bytes(b"\0" * 100)
    assert resolve_resume(output, "latest") is None  # nothing intact: a fresh start, never a crash
    with pytest.raises(ValueError, match="cannot be read"):
        resolve_resume(output, str(ckpts / "checkpoint-0000002"))

    # A kill while the final LoRA is written leaves the previous one whole under its name.
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=4)))
    final = output / "pytorch_lora_weights.safetensors"
    before = final.read_bytes()
    real_save = run.adapter.save

    def dies_midway(folder):
        real_save(folder)
        path = folder / "pytorch_lora_weights.safetensors"
        path.write_bytes(path.read_bytes()[:50])  # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(run.adapter, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        save_adapter(run, output)
    assert final.read_bytes() == before
    assert not [p for p in output.iterdir() if p.name.startswith(".tmp-result")]


def test_full_model_folder_is_replaced_atomically(tmp_path):
    """A `transformer/` folder (full fine-tune) is swapped whole; a kill between the swap's renames is
    repaired at the next start."""
    out = tmp_path / "out"

    class Full:
        def __init__(self, version):
            self.version = version

        def save(self, folder):
            (folder / "transformer").mkdir(parents=True)
            for name in ("config.json", "diffusion_pytorch_model.safetensors"):
                (folder / "transformer" / name).write_text(self.version)
            return folder / "transformer"

    assert save_adapter(SimpleNamespace(adapter=Full("v1")), out) == out / "transformer"
    assert save_adapter(SimpleNamespace(adapter=Full("v2")), out) == out / "transformer"
    assert {p.read_text() for p in (out / "transformer").iterdir()} == {"v2"}
    assert sorted(p.name for p in out.iterdir()) == ["transformer"]
    # Killed after the old folder was set aside, before the new one arrived: the old one comes back.
    (out / "transformer").rename(out / ".old-result-transformer-123")
    (out / ".tmp-result-123").mkdir()
    # and a validation sample killed mid-write: an MP4's temporary name holds its writer's pid, so no resumed run
    # ever wrote over it
    (out / "validation").mkdir()
    for name in (".step-000050-32x32@9.mp4.4242.tmp", ".step-000050-32x32.png.tmp", "step-000025-32x32.png"):
        (out / "validation" / name).write_bytes(b"x")
    clean_partial(out)
    assert sorted(p.name for p in out.iterdir()) == ["transformer", "validation"]
    assert [p.name for p in (out / "validation").iterdir()] == ["step-000025-32x32.png"]
