"""push_to_hub / push_checkpoints_to_hub with the hub client mocked at the network edge (HfApi's
create_repo and upload_folder): what is uploaded, the model card, retries, and a permanent failure that
leaves training whole."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from conftest import write_config
from difftune.config import load_config
from difftune.train import hub
from difftune.train.loop import train
from difftune.train.setup import build_run


class FakeHub:
    """Records calls; upload_folder fails on the call numbers in `failures` (1-based), or always."""

    def __init__(self, monkeypatch, failures=(), always=False, me=None):
        self.repos, self.uploads, self.calls = [], [], 0
        # whoami's answer (an exception is raised): a user with a write token by default
        self.me = me if me is not None else {"name": "me", "orgs": [{"name": "team"}],
                                             "auth": {"accessToken": {"role": "write"}}}
        self.failures, self.always = set(failures), always
        self.threads = set()
        self.files: set[str] = set()  # what the repository holds
        self.deleted: list[list[str]] = []  # the paths of each deleting commit
        monkeypatch.setattr(HfApi, "whoami", self.whoami)
        monkeypatch.setattr(HfApi, "create_repo", self.create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", self.upload_folder)
        monkeypatch.setattr(HfApi, "list_repo_files", self.list_repo_files)
        monkeypatch.setattr(HfApi, "create_commit", self.create_commit)
        monkeypatch.setattr(hub, "BACKOFF_S", 0.01)

    def whoami(self, *_, **__):
        if isinstance(self.me, Exception):
            raise self.me
        return self.me

    def list_repo_files(self, repo_id, **_):
        return sorted(self.files)

    def create_commit(self, repo_id, operations, commit_message=None, **_):
        from huggingface_hub import CommitOperationDelete

        assert all(isinstance(op, CommitOperationDelete) and op.is_folder for op in operations)
        self.deleted.append([op.path_in_repo for op in operations])
        self.files = {f for f in self.files if not any(f.startswith(op.path_in_repo) for op in operations)}

    def create_repo(self, repo_id, private=False, exist_ok=False, **_):
        self.repos.append((repo_id, private, exist_ok))

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, allow_patterns=None, **kwargs):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.always or self.calls in self.failures:
            raise ConnectionError("hub unreachable")
        folder = Path(folder_path)
        if allow_patterns is None:
            files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        else:
            from huggingface_hub.utils import filter_repo_objects

            every = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
            files = sorted(filter_repo_objects(every, allow_patterns=allow_patterns))
        self.uploads.append({"repo": repo_id, "path_in_repo": path_in_repo, "files": files,
                             "message": kwargs.get("commit_message")})
        self.files |= {f"{path_in_repo}/{f}" if path_in_repo else f for f in files}


def events(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "events.jsonl").read_text().splitlines()]


HUB = dict(max_train_steps=2, checkpoint_step_interval=1, push_to_hub=True, push_checkpoints_to_hub=True,
           hub_model_id="me/tiny-lora", hub_private=True, validation_prompt="a red circle",
           validation_resolution="32x32", validation_num_inference_steps=1, validation_disable_unconditional=True,
           dataset={"instance_prompt": "sks circle"})


def test_uploads_checkpoints_and_result_with_a_model_card(tmp_path, dataset, monkeypatch):
    fake = FakeHub(monkeypatch, failures={1})  # the first checkpoint's first attempt fails, its retry succeeds
    run = build_run(load_config(write_config(tmp_path, dataset, **HUB)))
    train(run)
    out = run.output_dir
    # created (private) when the run starts, before any model loads; the uploader's own call finds it there
    assert fake.repos == [("me/tiny-lora", True, True)] * 2
    assert fake.threads == {"difftune-hub-upload"}  # never the training thread
    assert [u["path_in_repo"] for u in fake.uploads] == ["checkpoints/checkpoint-0000001", "checkpoints/checkpoint-0000002",
                                                         None]
    assert "training_state.json" in fake.uploads[0]["files"]
    final = fake.uploads[-1]["files"]
    (sample,) = [e["path"] for e in events(out) if e["event"] == "sample"]
    sample = Path(sample).relative_to(out).as_posix()
    assert {"README.md", "pytorch_lora_weights.safetensors", sample} <= set(final)
    assert not [f for f in final if f.startswith("checkpoints/") or f.endswith(".jsonl")], final
    card = (out / "README.md").read_text()
    for text in ("me/tiny-lora", "lumina2", "load_lora_weights(\"me/tiny-lora\", weight_name=\"pytorch_lora_weights.safetensors\")", "Lumina2Pipeline", "sks circle",
                 f"]({sample})", "ComfyUI", "| rank | 4 |", "| steps | 2 |"):
        assert text in card, text
    caption = next(dataset.glob("*.txt")).read_text().strip()
    assert caption in card
    log = events(out)
    assert [e["attempts"] for e in log if e["event"] == "hub_upload"] == [2, 1, 1]
    assert not [e for e in log if e["event"] == "warning"]
    assert fake.deleted == []  # no checkpoints_total_limit: every checkpoint stays, on the hub as locally


def test_the_hub_mirrors_the_pruning_of_both_checkpoint_series(tmp_path, dataset, monkeypatch):
    """checkpoints_total_limit and checkpoints_rolling_total_limit: what each series prunes locally is deleted from
    the repository after the next upload, so the hub ends with the local checkpoints (before, every rolling one
    stayed there)."""
    fake = FakeHub(monkeypatch)
    config = {**HUB, "max_train_steps": 5, "checkpoint_step_interval": 2, "checkpoints_total_limit": 1,
              "checkpointing_rolling_steps": 1, "checkpoints_rolling_total_limit": 1, "validation_prompt": None}
    run = build_run(load_config(write_config(tmp_path, dataset, **config)))
    train(run)
    local = sorted(p.name for p in (run.output_dir / "checkpoints").iterdir())
    assert local == ["checkpoint-0000003-rolling", "checkpoint-0000005"]
    held = sorted({f.split("/")[1] for f in fake.files if f.startswith("checkpoints/")})
    assert held == local
    # 1R, 2, 3R, 4, then the final 5 (regular: a step due for both writes the regular one); each series' older
    # checkpoint removed after the next one's upload
    assert [u["path_in_repo"] for u in fake.uploads][:-1] == [f"checkpoints/{name}" for name in (
        "checkpoint-0000001-rolling", "checkpoint-0000002", "checkpoint-0000003-rolling", "checkpoint-0000004",
        "checkpoint-0000005")]
    assert fake.deleted == [["checkpoints/checkpoint-0000001-rolling/"], ["checkpoints/checkpoint-0000002/"],
                            ["checkpoints/checkpoint-0000004/"]]
    assert not [e for e in events(run.output_dir) if e["event"] == "warning"]


def test_a_checkpoint_pruned_before_its_upload_is_skipped(tmp_path, dataset, monkeypatch):
    """Uploads lag behind frequent rolling checkpoints: one already pruned when its turn comes is not uploaded (no
    retries, no warning), and removing it from the hub, which never held it, commits nothing."""
    fake = FakeHub(monkeypatch)
    from difftune.train.events import Events

    run_cfg = load_config(write_config(tmp_path, dataset, **HUB))
    run = type("FakeRun", (), {"cfg": run_cfg.train, "output_dir": tmp_path,
                               "events": Events(tmp_path / "events.jsonl", console=False)})()
    kept = tmp_path / "checkpoints" / "checkpoint-0000002-rolling"
    kept.mkdir(parents=True)
    (kept / "training_state.json").write_text("{}")
    uploader = hub.HubUploader(run_cfg, run)
    uploader("checkpoint", {"path": str(tmp_path / "checkpoints" / "checkpoint-0000001-rolling"), "step": 1,
                            "pruned": []})
    uploader("checkpoint", {"path": str(kept), "step": 2, "pruned": ["checkpoint-0000001-rolling"]})
    uploader.close()
    run.events.close()
    assert [u["path_in_repo"] for u in fake.uploads] == ["checkpoints/checkpoint-0000002-rolling"]
    assert fake.calls == 1 and fake.deleted == []
    log = events(tmp_path)
    assert any("checkpoint-0000001-rolling was pruned" in e.get("message", "") for e in log)
    assert not [e for e in log if e["event"] == "warning"]


def test_a_failing_hub_never_stops_training(tmp_path, dataset, monkeypatch):
    fake = FakeHub(monkeypatch, always=True)
    config = {**HUB, "push_checkpoints_to_hub": False, "checkpoint_step_interval": 0}
    run = build_run(load_config(write_config(tmp_path, dataset, **config)))
    adapter = train(run)
    assert adapter.exists()
    log = events(run.output_dir)
    assert log[-1]["event"] == "warning" and "done" in [e["event"] for e in log]
    assert fake.calls == hub.ATTEMPTS
    (warning,) = [e["message"] for e in log if e["event"] == "warning"]
    assert f"failed after {hub.ATTEMPTS} attempts" in warning and "ConnectionError: hub unreachable" in warning


def test_final_wait_is_bounded(tmp_path, dataset, monkeypatch):
    """An upload that hangs is left behind after FINAL_WAIT_S, with a warning."""
    release = threading.Event()
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: None)
    monkeypatch.setattr(HfApi, "upload_folder", lambda *a, **k: release.wait(30))
    monkeypatch.setattr(hub, "FINAL_WAIT_S", 0.2)
    from difftune.train.events import Events

    class FakeRun:
        cfg = load_config(write_config(tmp_path, dataset, **HUB)).train
        output_dir = tmp_path
        events = Events(tmp_path / "events.jsonl", console=False)

    uploader = hub.HubUploader(load_config(write_config(tmp_path, dataset, **HUB)), FakeRun())
    uploader("checkpoint", {"path": str(tmp_path)})
    uploader.close()
    release.set()
    FakeRun.events.close()
    (warning,) = [e for e in events(tmp_path) if e["event"] == "warning"]
    assert "still running after 0.2 s" in warning["message"]


@pytest.mark.parametrize("name", ["events.jsonl", ".hidden"])
def test_result_patterns_skip_logs_and_hidden_files(tmp_path, name):
    (tmp_path / name).write_text("x")
    (tmp_path / "pytorch_lora_weights.safetensors").write_text("x")
    (tmp_path / "checkpoints").mkdir()
    assert hub.result_patterns(tmp_path, []) == ["pytorch_lora_weights.safetensors"]


# --- push_to_hub's access, checked before any model loads; a result that never reached the hub


@pytest.mark.parametrize("me,repo,expected", [
    (OSError("Token is required (`token=True`), but no token found"), "me/tiny-lora", "no usable Hugging Face login"),
    ({"name": "me", "orgs": [], "auth": {"accessToken": {"role": "read"}}}, "me/tiny-lora", "is read-only"),
    ({"name": "me", "orgs": [{"name": "team"}]}, "someone/nope", "cannot create repositories under 'someone'"),
])
def test_push_to_hub_without_write_access_fails_before_any_model_loads(tmp_path, dataset, monkeypatch, capsys,
                                                                        no_model_loads, me, repo, expected):
    from difftune.cli import main

    fake = FakeHub(monkeypatch, me=me)
    path = write_config(tmp_path, dataset, **{**HUB, "hub_model_id": repo})
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"hub_model_id {repo!r}" in err and expected in err and "hf auth login" in err and "HF_TOKEN" in err
    assert "Traceback" not in err and fake.uploads == [] and fake.repos == []


def test_push_to_hub_repository_that_cannot_be_created_fails_at_start(tmp_path, dataset, monkeypatch, capsys,
                                                                      no_model_loads):
    from difftune.cli import main

    FakeHub(monkeypatch)

    def refused(self, repo_id, **_):
        raise PermissionError("403 Forbidden: You don't have the rights to create a model under this namespace")

    monkeypatch.setattr(HfApi, "create_repo", refused)
    assert main(["train", "--config", str(write_config(tmp_path, dataset, **HUB))]) == 2
    err = capsys.readouterr().err
    assert "hub_model_id 'me/tiny-lora': the repository cannot be created" in err and "403 Forbidden" in err


def test_a_failed_final_upload_exits_4_with_the_command_to_retry(tmp_path, dataset, monkeypatch, capsys):
    from difftune.cli import main

    FakeHub(monkeypatch, always=True)
    config = {**HUB, "push_checkpoints_to_hub": False, "checkpoint_step_interval": 0, "validation_prompt": None}
    path = write_config(tmp_path, dataset, **config)
    assert main(["train", "--config", str(path)]) == hub.HUB_UPLOAD_FAILED
    captured = capsys.readouterr()
    out = tmp_path / "output"
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("error: the upload of the result to the hub repository me/tiny-lora failed (ConnectionError")
    assert f"hf upload me/tiny-lora {out} . --include README.md" in last
    assert "--include pytorch_lora_weights.safetensors" in last
    assert (out / "pytorch_lora_weights.safetensors").exists()  # trained and saved all the same
    (warning,) = [e["message"] for e in events(out) if e["event"] == "warning"]  # what the web UI shows
    assert f"hf upload me/tiny-lora {out} . --include" in warning
    FakeHub(monkeypatch)  # the hub answers again: the same run uploads and exits 0
    assert main(["train", "--config", str(path), "--output_dir", str(tmp_path / "again")]) == 0



def test_check_says_when_push_to_hub_has_no_login(tmp_path, dataset, monkeypatch, capsys):
    """`difftune check` said OK to push_to_hub without any login, which `train` then refused. Offline: it looks for
    a token where huggingface_hub keeps one (HF_TOKEN, the token file under HF_HOME), and asks the hub nothing."""
    from difftune.cli import main

    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)  # the process edge: no token on this machine
    path = write_config(tmp_path, dataset, **HUB)
    assert main(["check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "push_to_hub" in err and "no Hugging Face login" in err and "hf auth login" in err
    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_not_checked_offline")
    assert main(["check", "--config", str(path)]) == 0


def test_push_to_hub_without_a_network_says_so_not_log_in(tmp_path, dataset, monkeypatch):
    """A token and no network: the message said "no usable Hugging Face login ... log in", the wrong fix. The error
    as the pinned huggingface_hub raises it: its HTTP client's (httpx2) ConnectError from a failed name resolution."""
    import socket

    import httpx2

    error = httpx2.ConnectError("[Errno -2] Name or service not known")
    error.__cause__ = socket.gaierror(-2, "Name or service not known")
    FakeHub(monkeypatch, me=error)
    cfg = load_config(write_config(tmp_path, dataset, **HUB)).train
    problem = hub.access_problem(cfg)
    assert "the Hugging Face hub cannot be reached" in problem and "check the network" in problem
    assert "log in" not in problem
    wrapped = RuntimeError("connect failed")
    wrapped.__cause__ = socket.gaierror(-2, "Name or service not known")
    assert hub.unreachable(wrapped) and not hub.unreachable(PermissionError("403"))


def test_push_to_hub_offline_mode_is_named(tmp_path, dataset, monkeypatch):
    from huggingface_hub.errors import OfflineModeIsEnabled

    FakeHub(monkeypatch, me=OfflineModeIsEnabled("offline"))
    cfg = load_config(write_config(tmp_path, dataset, **HUB)).train
    assert "HF_HUB_OFFLINE is set" in hub.access_problem(cfg)


def test_a_hub_model_id_the_hub_refuses_is_a_config_error(tmp_path, dataset):
    from conftest import config_problems

    text = config_problems(write_config(tmp_path, dataset, **{**HUB, "hub_model_id": "bad id/x y"}))
    assert "hub_model_id 'bad id/x y' is not a hub repository name" in text and "'user/name'" in text


def test_the_card_passes_an_empty_negative_prompt(tmp_path, dataset):
    """validation_negative_prompt "": Kandinsky 5 Video's pipelines put their own negative prompt in place of none,
    so the card's code (which left it out) sampled something else than the validation samples shown."""
    from types import SimpleNamespace

    from difftune.train.model_card import model_card
    from families import make_clips

    clips = make_clips(tmp_path / "clips", count=1, frames=9)
    cfg = load_config(write_config(tmp_path, clips, model_family="kandinsky5-video", model_flavour="tiny-random",
                                   validation_prompt="a square", validation_negative_prompt="",
                                   dataset={"dataset_type": "video", "video": {"num_frames": 9}}))
    card = model_card(cfg, SimpleNamespace(data=SimpleNamespace(items=[]), state=SimpleNamespace(step=2)), [])
    assert "negative_prompt=''" in card


def test_the_card_says_which_samples_and_weights_are_the_ema(tmp_path, dataset):
    """ema_validation ema_only: the card showed EMA samples over code that loads the live LoRA, and never named
    ema/."""
    from types import SimpleNamespace

    from difftune.train.model_card import model_card

    cfg = load_config(write_config(tmp_path, dataset, validation_prompt="a red circle", use_ema=True,
                                   ema_validation="ema_only"))
    samples = [Path("validation/final-step-000002-64x64-ema.png")]
    card = model_card(cfg, SimpleNamespace(data=SimpleNamespace(items=[]), state=SimpleNamespace(step=2)), samples)
    assert "those ending in -ema are the EMA weights', in ema/" in card
    assert 'load_lora_weights("your-name/your-model", subfolder="ema", weight_name="pytorch_lora_weights' in card
