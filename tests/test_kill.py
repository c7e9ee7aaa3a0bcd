"""SIGKILL at any moment: real kills of a `difftune train` subprocess, then relaunches with
`resume_from_checkpoint latest` until it finishes.

The kill moments are found by polling the output folder every millisecond: during startup (model load
and caching), in the middle of an optimizer step, while a checkpoint's temporary folder is being
written, and while validation samples. After every kill each `checkpoint-*` folder must be complete
(state file, loadable tensors), the next launch must resume from the newest of them and must have
removed the leftovers of the killed save before it starts. At the end every step's loss and learning
rate (every "step" line of the log, not only the last one per step), the final LoRA and the final
validation image equal those of a run that was never stopped.

`test_sigkill_anywhere_resumes_exactly` kills one run at all four kinds of moment in a row (about 40 s
on 2 CPU cores: every launch spends ~7 s importing torch and diffusers). The slow set
(`test_single_sigkill_resumes_exactly`, `make test-slow`) gives each kill point a fresh output folder
and adds a kill after the last checkpoint and a kill between the state file and the rename.

Each kill point records where it landed; one that misses its moment (the process got further than
intended, or had already exited) is retried with a fresh launch, a few times at most.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import write_config
from difftune.demo import make_dataset

STEPS, CKPT_EVERY, VAL_EVERY = 12, 2, 3
COMMON = dict(
    max_train_steps=STEPS, checkpoint_step_interval=CKPT_EVERY, validation_step_interval=VAL_EVERY,
    validation_prompt="a red circle", validation_resolution="32x32", validation_num_inference_steps=4,
    resume_from_checkpoint="latest", train_batch_size=2, lr_scheduler="linear", lr_warmup_steps=3,
)
POLL_S = 0.001
SLICE_S = 0.0002  # how long a stopped process runs between two looks (approach mode)
LAUNCH_TIMEOUT_S = 240.0  # one launch (imports dominate: ~8 s on 2 CPU cores)
ATTEMPTS = 3  # launches per kill point before giving up on hitting its moment
CHECKPOINT_FILES = ("training_state.json", "trainable.safetensors", "pytorch_lora_weights.safetensors",
                    "optimizer.pt", "lr_scheduler.pt", "rng.pt")


# ---------------------------------------------------------------------------------------------- log


class EventLog:
    """The complete lines of output_dir/events.jsonl, read incrementally. A line still being written
    (no newline yet) is left for the next read."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.events: list[dict] = []

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.events
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            self.events.append(json.loads(line))  # a torn line would fail here: the log must stay valid
        self.offset += end
        return self.events


def step_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "step"]


def final_losses(events: list[dict]) -> dict[int, float]:
    """Loss per step; later lines of the log win (a resumed run repeats the steps after its checkpoint)."""
    return {e["step"]: e["loss"] for e in step_events(events)}


# ------------------------------------------------------------------------------------ kill points


@dataclass
class Probe:
    """What a kill point sees of one launch: its events so far and the checkpoint folder."""

    pid: int
    events: list[dict]
    ckpt_root: Path

    def has(self, kind: str, step: int | None = None) -> bool:
        return any(e["event"] == kind and (step is None or e.get("step") == step) for e in self.events)

    def last_step(self) -> int | None:
        steps = step_events(self.events)
        return steps[-1]["step"] if steps else None

    def own_tmp(self) -> list[str]:
        try:
            names = os.listdir(self.ckpt_root)
        except FileNotFoundError:
            return []
        return [n for n in names if n.startswith(".tmp-checkpoint-") and n.endswith(f"-{self.pid}")]


@dataclass
class KillPoint:
    """`trigger` returns a target (what the kill aims at) once the moment has come; the kill follows
    after a random delay in `delay_s`; `landed` says, after the kill, whether it hit that target.

    A moment too short to catch by polling has an `approach`: once it holds, the process is stopped
    (SIGSTOP) and let run in slices of a fraction of a millisecond, checked while stopped, until the
    trigger holds (killed there, stopped: it cannot get further) or the approach ends (missed: it
    runs on and the next approach is tried)."""

    name: str
    trigger: Callable[[Probe], object | None]
    landed: Callable[[Probe, object], bool]
    delay_s: tuple[float, float] = (0.0, 0.0)
    approach: Callable[[Probe], bool] | None = None


def _startup_trigger(p: Probe):
    loading = any(e["event"] == "info" and e["message"].startswith("loading ") for e in p.events)
    return "startup" if loading and not p.has("start") else None


STARTUP = KillPoint(  # model load, text cache, latent cache: the first step has not started
    "startup", _startup_trigger, lambda p, _: not p.has("start"), delay_s=(0.0, 0.5))


def _mid_step_trigger(min_step: int):
    def trigger(p: Probe):
        s = p.last_step()
        plain = s is not None and s % CKPT_EVERY and s % VAL_EVERY and min_step <= s < STEPS
        return s if plain and p.events[-1]["event"] == "step" else None
    return trigger


def mid_step(min_step: int) -> KillPoint:
    """Killed while step s+1 computes: after the event of a step s that has no checkpoint or validation."""
    return KillPoint(f"mid-step (after step >= {min_step})", _mid_step_trigger(min_step),
                     lambda p, s: p.last_step() == s and not p.has("checkpoint", s + 1), delay_s=(0.0, 0.015))


def tmp_step(name: str) -> int:
    return int(name.split("-")[2])  # .tmp-checkpoint-NNNNNNN-PID


def mid_save(min_step: int = 0) -> KillPoint:
    """Killed while a checkpoint is being written, a few milliseconds after the event of a step that
    saves (or after its validation sample, which comes first when both are due). It landed when that
    checkpoint was never announced and its temporary folder was left behind."""

    def approach(p: Probe) -> bool:  # the save is about to start: from here run in small slices
        s = p.last_step()
        due = s is not None and s % CKPT_EVERY == 0 and min_step <= s < STEPS
        sampled = s is not None and (s % VAL_EVERY != 0 or p.has("sample", s))
        return due and sampled and not p.has("checkpoint", s)

    def trigger(p: Probe):  # its temporary folder exists: the save is under way
        s = p.last_step()
        return s if approach(p) and any(tmp_step(n) == s for n in p.own_tmp()) else None

    # Stopped and sliced (see KillPoint): a polling kill alone missed this window under load.
    return KillPoint(f"mid-save (checkpoint >= {min_step})", trigger, _save_landed, approach=approach)


def _save_landed(p: Probe, step: int) -> bool:
    return not p.has("checkpoint", step) and any(tmp_step(n) == step for n in p.own_tmp())


def before_rename(min_step: int) -> KillPoint:
    """Killed after the temporary folder got its complete training_state.json (the file that makes a
    checkpoint count), before the rename: a folder that looks whole, under the temporary name."""

    def saving(p: Probe) -> bool:
        return any(min_step <= tmp_step(n) < STEPS for n in p.own_tmp())

    def trigger(p: Probe):
        for name in p.own_tmp():
            try:
                state = json.loads((p.ckpt_root / name / "training_state.json").read_text())
            except (OSError, ValueError):
                continue  # not there yet, or still being written
            if state.get("step") == tmp_step(name) >= min_step:
                return tmp_step(name)
        return None

    return KillPoint(f"before-rename (checkpoint >= {min_step}, state file written)", trigger, _save_landed,
                     approach=saving)


def mid_validation(min_step: int = 0) -> KillPoint:
    """Killed while validation samples after step s (before that step's checkpoint, if one is due)."""

    def trigger(p: Probe):
        s = p.last_step()
        if s is None or s < min_step or s % VAL_EVERY or s >= STEPS or p.has("sample", s):
            return None
        return s

    return KillPoint(f"mid-validation (step >= {min_step})", trigger,
                     lambda p, s: p.last_step() == s and not p.has("sample", s), delay_s=(0.0, 0.03))


def _final_trigger(p: Probe):
    return STEPS if p.has("checkpoint", STEPS) and not p.has("done") else None


FINAL = KillPoint(  # after the last checkpoint, during the adapter save or the final validation
    "final (after the last checkpoint)", _final_trigger, lambda p, _: not p.has("done"), delay_s=(0.0, 0.05))


# ----------------------------------------------------------------------------------------- checks


def checkpoint_step(name: str) -> int:
    return int(name[len("checkpoint-"):])


def check_checkpoints(ckpt_root: Path) -> int:
    """Every folder named checkpoint-* is complete and loadable; returns the newest step (0: none)."""
    if not ckpt_root.is_dir():
        return 0
    names = sorted(n for n in os.listdir(ckpt_root) if n.startswith("checkpoint-"))
    for name in names:
        folder = ckpt_root / name
        missing = [f for f in CHECKPOINT_FILES if not (folder / f).is_file()]
        assert not missing, f"{folder} is named as complete but lacks {missing}"
        state = json.loads((folder / "training_state.json").read_text())
        assert state["step"] == checkpoint_step(name), (folder, state)
        for f in ("trainable.safetensors", "pytorch_lora_weights.safetensors"):
            assert load_file(folder / f), folder / f
        for f in ("optimizer.pt", "lr_scheduler.pt", "rng.pt"):
            torch.load(folder / f, weights_only=True)
    return max((checkpoint_step(n) for n in names), default=0)


def tmp_folder(ckpt_root: Path, step: int, pid: int) -> Path:
    return ckpt_root / f".tmp-checkpoint-{step:07d}-{pid}"


def leftovers(ckpt_root: Path, but_pid: int | None = None) -> list[str]:
    if not ckpt_root.is_dir():
        return []
    return [n for n in os.listdir(ckpt_root)
            if n.startswith((".tmp-", ".old-")) and (but_pid is None or not n.endswith(f"-{but_pid}"))]


# ----------------------------------------------------------------------------------------- driver


def launch(config: Path, log_file: Path) -> subprocess.Popen:
    # One thread each: the reference runs beside the first launch, and the polling loop shares the
    # cores too; torch's spinning worker threads slow down badly on a busy machine. The reference and
    # every launch use the same setting, so their losses stay comparable bit for bit.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log_file, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "difftune.cli", "train", "--config", str(config)],
                                cwd=config.parent, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_stopped(pid: int) -> bool:
    """Wait until a SIGSTOP took effect (state T; an fsync in progress finishes first). False: it exited."""
    for _ in range(50_000):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return False
        if state in "tT":
            return True
        if state in "ZX":
            return False
        time.sleep(0.0001)
    raise AssertionError(f"process {pid} did not stop")


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@dataclass
class Launch:
    pid: int
    point: str  # the kill point it aimed at, or "to the end"
    resumed_at: int  # the step it was expected to resume from
    seconds: float = 0.0
    rc: int | None = None
    target: object = None  # what the kill aimed at (a step, or "startup"); None: the trigger never fired
    landed: bool = False
    where: str = ""


@dataclass
class Chain:
    """Launches of one output folder: each one runs until its kill point (or to the end)."""

    root: Path
    config: Path
    seed: int = field(default_factory=lambda: random.randrange(2**32))  # of the random kill delays
    launches: list[Launch] = field(default_factory=list)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.out = self.root / "output"
        self.ckpt_root = self.out / "checkpoints"
        self.log = EventLog(self.out / "events.jsonl")
        self.stdout = self.root / "stdout.txt"
        self.resume_step = 0  # the newest complete checkpoint: where the next launch must start

    def run(self, point: KillPoint | None) -> Launch:
        """One launch. With a kill point: SIGKILL at its moment. Without: it must finish (exit 0)."""
        first = len(self.log.read())
        started = time.monotonic()
        proc = launch(self.config, self.stdout)
        rec = Launch(proc.pid, point.name if point else "to the end", self.resume_step)
        probe = Probe(proc.pid, [], self.ckpt_root)
        saw_start = False
        try:
            while True:
                probe.events = self.log.read()[first:]
                if not saw_start and probe.has("start"):
                    saw_start = True  # clean_partial ran just before "start": older leftovers are gone
                    stale = leftovers(self.ckpt_root, but_pid=proc.pid)
                    assert not stale, f"launch {proc.pid} started with leftovers of killed saves: {stale}"
                if point is not None and point.approach is not None and point.approach(probe):
                    if (target := self.step_to(proc, point, first)) is not None:
                        rec.target = target
                        break
                elif point is not None and (target := point.trigger(probe)) is not None:
                    time.sleep(self.rng.uniform(*point.delay_s))
                    os.kill(proc.pid, signal.SIGKILL)
                    rec.target = target
                    break
                if proc.poll() is not None:
                    break
                assert time.monotonic() - started < LAUNCH_TIMEOUT_S, f"launch {proc.pid} timed out:\n{tail(self.stdout)}"
                time.sleep(POLL_S)
            rec.rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        rec.seconds = time.monotonic() - started
        probe.events = self.log.read()[first:]
        self.check_start(probe, rec)
        if point is None:
            assert rec.rc == 0, f"the final launch failed (rc {rec.rc}):\n{tail(self.stdout)}"
            assert probe.has("done"), probe.events[-3:]
        else:
            assert rec.rc in (0, -signal.SIGKILL), f"launch {proc.pid} failed (rc {rec.rc}):\n{tail(self.stdout)}"
            rec.landed = rec.rc == -signal.SIGKILL and rec.target is not None and point.landed(probe, rec.target)
            last = probe.events[-1] if probe.events else {}
            rec.where = f"target {rec.target!r}; last event {last.get('event')} {last.get('step', last.get('message', ''))!s:.60}"
            if rec.landed and point.name.startswith(("mid-save", "before-rename")):
                tmp = tmp_folder(self.ckpt_root, rec.target, proc.pid)
                rec.where += f"; left {sorted(os.listdir(tmp))} in {tmp.name}"
        self.resume_step = check_checkpoints(self.ckpt_root)
        self.launches.append(rec)
        return rec

    def step_to(self, proc: subprocess.Popen, point: KillPoint, first: int) -> object | None:
        """Approach mode (see KillPoint): returns the target when killed, None when the moment passed."""
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            while time.monotonic() - started < LAUNCH_TIMEOUT_S:
                if not wait_stopped(proc.pid):
                    return None  # it exited
                probe = Probe(proc.pid, self.log.read()[first:], self.ckpt_root)
                if (target := point.trigger(probe)) is not None:
                    os.kill(proc.pid, signal.SIGKILL)
                    return target
                if not point.approach(probe):
                    return None
                os.kill(proc.pid, signal.SIGCONT)
                time.sleep(SLICE_S)
                os.kill(proc.pid, signal.SIGSTOP)
            raise AssertionError(f"{point.name}: approach of launch {proc.pid} did not end")
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a no-op after the SIGKILL

    def check_start(self, probe: Probe, rec: Launch) -> None:
        """The launch resumed from the newest complete checkpoint (never a temporary folder)."""
        starts = [e for e in probe.events if e["event"] == "start"]
        if not starts:
            return  # killed before the start
        assert starts[0]["step"] == rec.resumed_at, (rec, starts[0])
        resumed = [e["message"] for e in probe.events if e["event"] == "info" and e["message"].startswith("resumed from ")]
        if rec.resumed_at == 0:
            assert not resumed, resumed
            return
        path = self.ckpt_root / f"checkpoint-{rec.resumed_at:07d}"
        assert resumed == [f"resumed from {path} at step {rec.resumed_at}"], resumed

    def kill_at(self, point: KillPoint) -> Launch:
        """Launch until the kill lands on its moment (retrying a kill that came too late)."""
        for _ in range(ATTEMPTS):
            rec = self.run(point)
            if rec.landed:
                return rec
            assert rec.rc != 0, f"the run finished before {point.name} could be hit: {self.report()}"
        pytest.fail(f"{point.name}: no kill landed in {ATTEMPTS} launches: {self.report()}")

    def report(self) -> str:
        def outcome(r: Launch) -> str:
            if r.point == "to the end":
                return "finished" if r.rc == 0 else "failed"
            return f"{'landed' if r.landed else 'missed'} ({r.where})"

        return f"  kill delays seeded with {self.seed}\n" + "\n".join(f"  pid {r.pid} {r.point}: resumed at {r.resumed_at}, rc {r.rc}, {outcome(r)}, "
                         f"{r.seconds:.1f}s" for r in self.launches)


# --------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kill-images")
    make_dataset(folder, count=6)  # 3 batches an epoch: checkpoints fall mid-epoch too
    return folder


class Reference:
    """The uninterrupted run, started as a subprocess at once; `.events` waits for it."""

    def __init__(self, root: Path, images: Path, **extra):
        self.root = root
        self.config = write_config(root, images, **COMMON, **extra)
        self.stdout = root / "stdout.txt"
        self.started = time.time()
        self.proc = launch(self.config, self.stdout)
        self._events: list[dict] | None = None
        self.seconds = 0.0

    @property
    def events(self) -> list[dict]:
        if self._events is None:
            rc = self.proc.wait(timeout=LAUNCH_TIMEOUT_S)
            assert rc == 0, f"reference run failed (rc {rc}):\n{tail(self.stdout)}"
            self._events = EventLog(self.root / "output" / "events.jsonl").read()
            self.seconds = self._events[-1]["time"] - self.started
            assert sorted(final_losses(self._events)) == list(range(1, STEPS + 1))
        return self._events

    def adapter(self) -> dict[str, torch.Tensor]:
        self.events  # noqa: B018 - waits for the run
        return load_file(self.root / "output" / "pytorch_lora_weights.safetensors")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, images):
    ref = Reference(tmp_path_factory.mktemp("kill-reference"), images)
    yield ref
    if ref.proc.poll() is None:
        ref.proc.kill()
        ref.proc.wait()


def assert_same_as_reference(chain: Chain, ref: Reference) -> None:
    by_step = {e["step"]: e for e in step_events(ref.events)}
    events = chain.log.read()
    for e in step_events(events):  # every step line of every launch, killed ones included
        want = by_step[e["step"]]
        assert e["loss"] == pytest.approx(want["loss"], rel=1e-6), (e, want, chain.report())
        assert e["lr"] == pytest.approx(want["lr"], rel=1e-6, abs=1e-12), (e, want, chain.report())
    resumed = final_losses(events)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    expected = final_losses(ref.events)
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6), step
    got, want = load_file(chain.out / "pytorch_lora_weights.safetensors"), ref.adapter()
    assert sorted(got) == sorted(want)
    for key in want:  # on the CPU with one thread a resumed run is bit-identical
        assert torch.equal(got[key], want[key]), (key, (got[key] - want[key]).abs().max())
    final = f"validation/final-step-{STEPS:06d}-32x32.png"
    with Image.open(chain.out / final) as a, Image.open(ref.root / "output" / final) as b:
        assert a.tobytes() == b.tobytes(), "the final validation sample differs from the reference's"
    assert not leftovers(chain.ckpt_root), leftovers(chain.ckpt_root)
    assert check_checkpoints(chain.ckpt_root) == STEPS


def missing_samples(chain: Chain, ref: Reference) -> list[str]:
    """Validation images the reference wrote and the killed-and-resumed run never did (not asserted:
    a kill during validation at a step that also checkpoints is resumed after that validation)."""
    names = {p.name for p in (chain.out / "validation").glob("*.png")}
    return sorted(p.name for p in (ref.root / "output" / "validation").glob("*.png") if p.name not in names)


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.slow  # 55 s: five kills in one run; make test keeps test_single_sigkill_resumes_exactly[mid-step]
def test_sigkill_anywhere_resumes_exactly(tmp_path, images, reference):
    """One output folder killed four times in a row, each time at a different kind of moment:
    startup -> (from scratch) mid-step after step 5 -> (from 4) mid-save of checkpoint 6 -> (from 4)
    mid-validation of step 6 -> (from 4: validation comes before that step's checkpoint) to the end."""
    chain = Chain(tmp_path, write_config(tmp_path, images, **COMMON))

    chain.kill_at(STARTUP)  # runs beside the reference run: their imports take most of the time
    assert check_checkpoints(chain.ckpt_root) == 0

    rec = chain.kill_at(mid_step(min_step=5))
    assert chain.resume_step == rec.target - 1  # the step in progress is lost, the one before was saved

    rec = chain.kill_at(mid_save())
    tmp = tmp_folder(chain.ckpt_root, rec.target, rec.pid)
    assert tmp.is_dir(), "the mid-save kill must leave its temporary folder behind"
    assert chain.resume_step == rec.target - CKPT_EVERY  # the half-written one does not count

    rec = chain.kill_at(mid_validation())
    assert not tmp.exists(), "the next launch must remove the killed save's temporary folder"
    # Validation runs before its step's checkpoint: killed there, the run resumes from the one before.
    assert chain.resume_step == rec.target - (rec.target % CKPT_EVERY or CKPT_EVERY)

    chain.run(None)
    assert_same_as_reference(chain, reference)
    assert missing_samples(chain, reference) == []  # no validation image is lost to a kill
    print(f"\nreference run {reference.seconds:.1f}s\n{chain.report()}\n"
          f"  validation images never written: {missing_samples(chain, reference)}")


@pytest.mark.parametrize("point", [
    pytest.param(STARTUP, marks=pytest.mark.slow),
    mid_step(min_step=7),  # in make test: a SIGKILL mid-training resumes exactly (the rest in make test-slow)
    pytest.param(before_rename(min_step=8), marks=pytest.mark.slow),  # checkpoint 8 in full, not yet renamed
    pytest.param(mid_validation(min_step=9), marks=pytest.mark.slow),  # step 9 has no checkpoint: resumes from 8
    # the next launch resumes from the last checkpoint and saves it again (the replace path)
    pytest.param(FINAL, marks=pytest.mark.slow),
], ids=lambda p: p.name.split(" ")[0])
def test_single_sigkill_resumes_exactly(tmp_path, images, reference, point):
    """A fresh output folder per kill point: one kill there, then relaunched until it finishes."""
    chain = Chain(tmp_path, write_config(tmp_path, images, **COMMON))
    rec = chain.kill_at(point)
    if point.name.startswith("before-rename"):
        tmp = tmp_folder(chain.ckpt_root, rec.target, rec.pid)
        assert (tmp / "training_state.json").is_file(), "killed after the state file, before the rename"
        assert chain.resume_step == rec.target - CKPT_EVERY  # the whole-looking temporary folder does not count
    chain.run(None)
    assert_same_as_reference(chain, reference)
    print(f"\n{chain.report()}\n  validation images never written: {missing_samples(chain, reference)}")


# TREAD routes and rollouts draw from the run's generator: a resumed run must draw the same tokens and steps.
TREAD_AND_ROLLOUTS = dict(
    tread_config={"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -1}]},
    scheduled_sampling_max_step_offset=2, scheduled_sampling_probability=0.5, scheduled_sampling_reflexflow=True,
)


@pytest.mark.slow
def test_sigkill_resumes_exactly_with_tread_and_rollouts(tmp_path, tmp_path_factory, images, dino):
    # and REPA on block 0, outside the TREAD route, with its weight warming up across the kill
    extra = TREAD_AND_ROLLOUTS | dict(crepa_enabled=True, crepa_encoder=dino, crepa_encoder_image_size=28,
                                      crepa_block_index=0, crepa_warmup_steps=4)
    reference = Reference(tmp_path_factory.mktemp("kill-reference-tread"), images, **extra)
    try:
        chain = Chain(tmp_path, write_config(tmp_path, images, **COMMON, **extra))
        chain.kill_at(mid_step(min_step=5))
        chain.run(None)
        assert_same_as_reference(chain, reference)
    finally:
        if reference.proc.poll() is None:
            reference.proc.kill()
            reference.proc.wait()


# ------------------------------------------------------------------------------ SIGTERM and the lock


def test_sigterm_saves_and_resumes_exactly_and_a_second_run_is_refused(tmp_path, images, reference):
    """SIGTERM (kill, timeout, docker stop, preemption) stops a run as Ctrl-C does. Sent after a step that neither
    checkpoints nor validates (>= 5), the run ends the step in progress and its work (a checkpoint due then is the
    interrupted one; a validation due then is made, or abandoned with a warning), saves an interrupted checkpoint of it,
    logs a stopped event that names SIGTERM and exits with 143; relaunched, it resumes there and ends exactly as
    the uninterrupted run. Meanwhile a second `difftune train` into the same output_dir stops at once, before
    loading any model, naming the folder and the first run's pid."""
    chain = Chain(tmp_path, write_config(tmp_path, images, **COMMON))
    proc = launch(chain.config, chain.stdout)
    intruder, intruder_log = None, tmp_path / "intruder.txt"
    started = time.monotonic()
    try:
        while True:
            events = chain.log.read()
            loading = any(e["event"] == "info" and e["message"].startswith("loading ") for e in events)
            if intruder is None and loading:  # the first run holds the lock from before it loads its model
                intruder = launch(chain.config, intruder_log)
            s = step_events(events)[-1]["step"] if step_events(events) else None
            plain = s is not None and s >= 5 and s % CKPT_EVERY and s % VAL_EVERY and events[-1]["event"] == "step"
            if plain and intruder is not None:
                # paused (still alive, lock held) until the intruder has given up: a tiny run is over in a second
                proc.send_signal(signal.SIGSTOP)
                intruder.wait(timeout=LAUNCH_TIMEOUT_S)
                proc.send_signal(signal.SIGTERM)  # acted on where the run was paused: mostly inside step s + 1
                proc.send_signal(signal.SIGCONT)
                break
            assert proc.poll() is None, f"the run ended before it could be signalled:\n{tail(chain.stdout)}"
            assert time.monotonic() - started < LAUNCH_TIMEOUT_S, tail(chain.stdout)
            time.sleep(POLL_S)
        rc = proc.wait(timeout=120)
    finally:
        for p in (proc, intruder):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert intruder.returncode == 2, tail(intruder_log)
    said = tail(intruder_log)
    assert f"output_dir {chain.out.resolve()} is in use by another training run (pid {proc.pid})" in said, said
    assert "loading" not in said and "Traceback" not in said, said
    assert rc == 128 + signal.SIGTERM, tail(chain.stdout)
    assert "terminated by SIGTERM; the last checkpoint (checkpoint-" in tail(chain.stdout)
    events = chain.log.read()
    assert [e["pid"] for e in events if e["event"] == "start"] == [proc.pid]  # nothing from the intruder
    last_step = step_events(events)[-1]["step"]
    assert last_step >= s  # the step in progress (if any) was finished, not cut
    saved = [e for e in events if e["event"] == "checkpoint"][-1]
    # the signal is acted on after the step's work: a checkpoint due at that step is the interrupted one
    assert (saved["step"], saved.get("reason")) == (last_step, None if last_step % CKPT_EVERY == 0 else
                                                    "terminated by SIGTERM"), saved
    assert {k: events[-1].get(k) for k in ("event", "step", "reason")} == {
        "event": "stopped", "step": last_step, "reason": "terminated by SIGTERM"}
    chain.resume_step = check_checkpoints(chain.ckpt_root)
    assert chain.resume_step == last_step
    chain.run(None)  # checks that it resumed from that checkpoint
    assert_same_as_reference(chain, reference)


@pytest.mark.slow  # about 60 s on 2 cores: two torchrun launches and a reference
def test_sigterm_to_torchrun_stops_every_process_after_the_same_step(tmp_path, images):
    """torchrun passes a SIGTERM on to each trainer: both finish the step in progress, meet in the interrupted
    checkpoint's collectives, and the run resumes from it with the losses of the uninterrupted one."""
    from test_distributed import finish
    from test_distributed import launch as torchrun
    from test_train import losses

    common = dict(max_train_steps=8, train_batch_size=1, checkpoint_step_interval=4, resume_from_checkpoint="latest")
    finish(torchrun(write_config(tmp_path / "ref", images, **common), 29731))
    cut = write_config(tmp_path / "cut", images, **common)
    proc = torchrun(cut, 29732)
    log = EventLog(tmp_path / "cut" / "output" / "events.jsonl")
    started = time.monotonic()
    try:
        while not (step_events(log.read()) and step_events(log.events)[-1]["step"] >= 2):
            assert proc.poll() is None and time.monotonic() - started < LAUNCH_TIMEOUT_S, proc.stdout.read()[-3000:]
            time.sleep(POLL_S)
        proc.send_signal(signal.SIGTERM)
        said = proc.communicate(timeout=120)[0]  # torchrun itself exits 1, reporting the signal it got
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    events = log.read()
    last = step_events(events)[-1]["step"]
    assert [(e["event"], e["step"], e.get("reason")) for e in events[-2:]] == [
        ("checkpoint", last, "terminated by SIGTERM"), ("stopped", last, "terminated by SIGTERM")], said[-3000:]
    assert not [e for e in events if e["event"] == "error"]
    finish(torchrun(cut, 29733))
    a, b = losses(tmp_path / "ref" / "output"), losses(tmp_path / "cut" / "output")
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-6) for k in a)
