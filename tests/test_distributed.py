"""Two processes on CPU (torchrun, gloo): the same training as one process with the same global
batch, caching split without duplicate work, checkpoints and resume, commands reach every process."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_config
from difftune.demo import make_dataset
from test_train import losses


def launch(config, port, processes=2, **popen):
    # pytest-xdist workers run test files side by side: each gets its own range of rendezvous ports
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    port = port + 200 * worker if port else port
    if processes == 1:
        command = [sys.executable, "-m", "difftune.cli", "train", "--config", str(config)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_port", str(port), "-m", "difftune.cli", "train", "--config", str(config)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def kill_all(proc):
    """SIGKILL the launcher and every process under it at once. torch.distributed.run starts each trainer in a
    session of its own, so a kill of the launcher's process group would leave the trainers running."""
    import psutil

    launcher = psutil.Process(proc.pid)
    for p in [launcher, *launcher.children(recursive=True)]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.communicate()


def finish(proc, timeout=300):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / "images"
    make_dataset(folder, count=8)
    return folder


@pytest.mark.parametrize("offload", [{}, {"optimizer_cpu_offload_method": "cpu"}], ids=["plain", "optimizer-offload"])
def test_two_processes_equal_one_with_the_global_batch(tmp_path, images, offload):
    """With optimizer offload, each process steps its CPU copies with the gradients DDP averaged (the copy is made
    after the backward pass, not in a hook before the all-reduce): still the one-process run."""
    two = write_config(tmp_path / "two", images, max_train_steps=4, train_batch_size=1, lr_scheduler="linear",
                       **offload)
    one = write_config(tmp_path / "one", images, max_train_steps=4, train_batch_size=2, lr_scheduler="linear")
    finish(launch(two, 29601))
    finish(launch(one, 0, processes=1))
    a, b = losses(tmp_path / "one" / "output"), losses(tmp_path / "two" / "output")
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-5) for k in a)
    wa = load_file(tmp_path / "one" / "output" / "pytorch_lora_weights.safetensors")
    wb = load_file(tmp_path / "two" / "output" / "pytorch_lora_weights.safetensors")
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=1e-6, rtol=1e-5)
    log = (tmp_path / "two" / "output" / "events.jsonl").read_text()
    infos = [e["message"] for e in map(json.loads, log.splitlines()) if e["event"] == "info"]
    assert any("optimizer steps in CPU memory" in m for m in infos) == bool(offload)
    text = next(m for m in infos if m.startswith("text cache"))
    latent = next(m for m in infos if m.startswith("latent cache"))
    shares = json.loads(latent.split("per process: ")[1].rstrip(")"))
    assert sum(shares) == 8 and min(shares) > 0  # each image encoded once, by one of the two
    assert min(json.loads(text.split("per process: ")[1].rstrip(")"))) > 0


def test_lycoris_and_tread_two_processes_equal_one(tmp_path, images):
    """LyCORIS's network wraps the layers from outside the transformer, which DDP then refused to wrap (a crash at
    startup): its gradients are averaged by the loop. TREAD's routes were drawn per process for its own samples,
    alike on both (the same generator), so two processes routed otherwise than one: now drawn for the global batch."""
    (tmp_path / "lokr.json").write_text(json.dumps({"algo": "lokr", "linear_dim": 4, "linear_alpha": 1, "factor": 4}))
    common = dict(max_train_steps=3, lr_scheduler="linear", lora_type="lycoris",
                  lycoris_config=str(tmp_path / "lokr.json"),
                  tread_config={"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -1}]})
    two = write_config(tmp_path / "two", images, train_batch_size=1, **common)
    one = write_config(tmp_path / "one", images, train_batch_size=2, **common)
    finish(launch(two, 29607))
    finish(launch(one, 0, processes=1))
    a, b = losses(tmp_path / "one" / "output"), losses(tmp_path / "two" / "output")
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-5) for k in a), (a, b)
    wa = load_file(tmp_path / "one" / "output" / "pytorch_lora_weights.safetensors")
    wb = load_file(tmp_path / "two" / "output" / "pytorch_lora_weights.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=1e-6, rtol=1e-5)


@pytest.mark.slow  # 48 s; the one-process SIGKILL test and test_fsdp's resume tests stay beside it
def test_two_processes_killed_then_resumed(tmp_path, images):
    common = dict(max_train_steps=6, train_batch_size=1, checkpoint_step_interval=2, resume_from_checkpoint="latest")
    reference = write_config(tmp_path / "ref", images, **common)
    finish(launch(reference, 29611))
    cut = write_config(tmp_path / "cut", images, **common)
    proc = launch(cut, 29612, start_new_session=True)
    checkpoints = tmp_path / "cut" / "output" / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and not (checkpoints / "checkpoint-0000004" / "training_state.json").exists():
        time.sleep(0.01)
    kill_all(proc)  # the launcher and both trainers at once
    assert (checkpoints / "checkpoint-0000004").exists()
    finish(launch(cut, 29613))
    resumed = [e for e in map(json.loads, (tmp_path / "cut" / "output" / "events.jsonl").read_text().splitlines())
               if e["event"] == "info" and "resumed" in e["message"]]
    assert resumed and resumed[-1]["message"].endswith("at step 4")  # killed between checkpoints 4 and 6
    a, b = losses(tmp_path / "ref" / "output"), losses(tmp_path / "cut" / "output")
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-6) for k in a)


@pytest.mark.slow  # 36 s on 2 cores (three two-process runs)
def test_a_resume_gives_each_process_its_own_rng(tmp_path, images):
    """lora_dropout draws from each process's torch RNG; a checkpoint kept process 0's alone and a resume gave it
    to every process, so the resumed losses differed from the uninterrupted run's (a 1-process run was exact)."""
    common = dict(train_batch_size=1, checkpoint_step_interval=2, resume_from_checkpoint="latest", lora_dropout=0.5)
    finish(launch(write_config(tmp_path / "ref", images, max_train_steps=4, **common), 29615))
    finish(launch(write_config(tmp_path / "cut", images, max_train_steps=2, **common), 29616))
    finish(launch(write_config(tmp_path / "cut", images, max_train_steps=4, **common), 29617))
    a, b = losses(tmp_path / "ref" / "output"), losses(tmp_path / "cut" / "output")
    assert a.keys() == b.keys() == {1, 2, 3, 4} and all(a[k] == pytest.approx(b[k], rel=1e-6) for k in a), (a, b)


@pytest.mark.slow  # about 20-40 s on 2 cores: in make test-slow; make test keeps the two-process
# equality and kill/resume tests
def test_stop_command_stops_every_process(tmp_path, images):
    from difftune.train.commands import send_command

    config = write_config(tmp_path, images, max_train_steps=10_000, train_batch_size=1)
    proc = launch(config, 29621)
    log = tmp_path / "output" / "events.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (log.exists() and '"event": "step"' in log.read_text()):
        time.sleep(0.05)
    send_command(tmp_path / "output", "stop")
    finish(proc, timeout=120)
    events = [json.loads(x) for x in log.read_text().splitlines()]
    assert events[-1]["event"] == "stopped" and events[-1]["step"] < 10_000


@pytest.mark.slow  # about 20-40 s on 2 cores: in make test-slow; make test keeps the two-process
# equality and kill/resume tests
def test_two_processes_image_to_video(tmp_path):
    """Kandinsky 5 Video i2v under DDP: the first-frame conditioning and the network's config reached through
    the DDP wrapper; the same losses as one process with the same global batch."""
    from families import make_clips

    clips = make_clips(tmp_path / "clips", count=4, frames=9)
    settings = dict(model_family="kandinsky5-video", model_flavour="tiny-random-i2v", max_train_steps=3,
                    dataset={"dataset_type": "video", "resolution": 32, "video": {"num_frames": 9}})
    two = write_config(tmp_path / "two", clips, train_batch_size=1, **settings)
    one = write_config(tmp_path / "one", clips, train_batch_size=2, **settings)
    finish(launch(two, 29604))
    finish(launch(one, 0, processes=1))
    a, b = losses(tmp_path / "one" / "output"), losses(tmp_path / "two" / "output")
    assert len(a) == 3 and a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-5) for k in a)


def test_a_refused_generated_folder_stops_every_process_with_the_one_message(tmp_path, images):
    """Process 0 makes the generated input images while the others wait: its refusal reached them as gloo's
    "Connection closed by peer" tracebacks, after which torchrun printed its failure table."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "000-x.png").write_bytes(b"the user's own")
    config = write_config(tmp_path, images, model_family="kandinsky5-image", model_flavour="tiny-random-i2i",
                          dataset={"conditioning": [{"type": "canny", "instance_data_dir": str(mine)}]})
    out, _ = launch(config, 29697).communicate(timeout=300)
    assert out.count("already holds files that difftune did not generate") == 1, out[-3000:]  # said by process 0
    assert "Connection closed by peer" not in out and (mine / "000-x.png").read_bytes() == b"the user's own"
