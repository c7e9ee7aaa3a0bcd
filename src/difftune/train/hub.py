"""Uploads to the Hugging Face hub (`push_to_hub`, `push_checkpoints_to_hub`), driven by the event stream.

A `HubUploader` subscribes to the run's events on process 0: a "checkpoint" event queues that checkpoint
folder (under `checkpoints/<name>` in the repository), and the final "done" (or "stopped") event writes
the model card (README.md, train/model_card.py) and queues the result.

The repository's checkpoints mirror the local folder's: the checkpoints that `checkpoints_total_limit` and
`checkpoints_rolling_total_limit` prune locally (each series apart; the event's `pruned`) are deleted from the
repository in one commit after the new checkpoint's upload (the hub's history keeps them), and a checkpoint
already pruned when its upload's turn comes (frequent rolling checkpoints, a slow network) is not uploaded. So
`checkpointing_rolling_steps` with `push_checkpoints_to_hub` keeps the newest rolling checkpoints on the hub, not
every one. (SimpleTuner uploads each checkpoint's files over the repository's top level instead, so there only
the latest is visible.) One background thread uploads,
in order, so training never waits on the network; each upload is tried `ATTEMPTS` times with growing
pauses, and a failure is a "warning" event, never an exception in the loop. When the run ends
(`Events.close`), the uploads still queued are waited for, at most `FINAL_WAIT_S` seconds.

Before any model loads, `check_access` logs in (`HfApi.whoami`) and creates the repository (`create_repo`,
`exist_ok`), so a missing login or a repository the token cannot write is an error at start-up, not after hours
of training. A result upload that still fails at the end (`result_failure`) makes `difftune train` say so last and
exit with status 4 (HUB_UPLOAD_FAILED), with the command that uploads it by hand.
"""

from __future__ import annotations

import importlib
import queue
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import Any

from difftune.config import RunConfig
from difftune.train.model_card import model_card

ATTEMPTS = 4
BACKOFF_S = 5.0  # pause before retry n: BACKOFF_S * 2**(n-1)
FINAL_WAIT_S = 1800.0
RESULT_FOLDERS = ("transformer", "ema")  # a full fine-tune's folder; the EMA weights
SKIPPED_SUFFIXES = (".jsonl", ".log")
HUB_UPLOAD_FAILED = 4  # difftune train's exit status: trained and saved, but the result is not on the hub
LOGIN_FIX = "log in with `hf auth login` (or set HF_TOKEN to a token with write access), or set push_to_hub to false"


class HubAccessError(RuntimeError):
    """push_to_hub cannot write to hub_model_id: the command line prints it as `error: ...` (exit status 2)."""


def login_missing(cfg: Any) -> str | None:
    """`difftune check`'s side of check_access, offline: with push_to_hub, no Hugging Face token at all (the run
    would stop before any model loads); None otherwise. Whether the token may write is only asked by train."""
    from huggingface_hub import get_token

    if not cfg.push_to_hub or get_token() is not None:
        return None
    return f"push_to_hub: hub_model_id {cfg.hub_model_id!r}: no Hugging Face login; {LOGIN_FIX}"


def unreachable(error: BaseException) -> bool:
    """Whether an error of a hub call is the network's (no connection, no name resolution, a timeout), not the
    hub's answer (which is an HTTP error with a status)."""
    from huggingface_hub.errors import HfHubHTTPError

    network: list[type] = [ConnectionError, TimeoutError, socket.gaierror]  # gaierror: no name resolution
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"),
                         ("requests.exceptions", "ConnectionError"), ("requests.exceptions", "Timeout")):
        try:  # huggingface_hub 2 talks through httpx2, 1.x through httpx, older releases through requests
            network.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:  # the transport error may be wrapped
        seen.add(id(current))
        if isinstance(current, HfHubHTTPError):
            return False
        if isinstance(current, tuple(network)):
            return True
        current = current.__cause__ or current.__context__
    return False


def access_problem(cfg: Any, api: Any = None) -> str | None:
    """Why push_to_hub could not upload to hub_model_id, or None: the login (whoami), its write access (a read token,
    a namespace that is neither the user's nor one of their organisations'), then the repository, created when it
    does not exist yet (as the first upload would)."""
    from huggingface_hub import HfApi

    api = api or HfApi()
    repo = cfg.hub_model_id
    where = f"push_to_hub: hub_model_id {repo!r}"
    try:
        me = api.whoami()
    except Exception as e:  # noqa: BLE001 - no token, a revoked one, no network: each is said as it is
        from huggingface_hub.errors import OfflineModeIsEnabled

        if isinstance(e, OfflineModeIsEnabled):
            return (f"{where}: HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it, or set push_to_hub to "
                    "false to train without uploading")
        if unreachable(e):
            return (f"{where}: the Hugging Face hub cannot be reached ({type(e).__name__}: {e}); check the network "
                    "(or HF_ENDPOINT), or set push_to_hub to false to train without uploading")
        return f"{where}: no usable Hugging Face login ({type(e).__name__}: {e}); {LOGIN_FIX}"
    name = me.get("name")
    role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        return f"{where}: the hub token of {name!r} is read-only; {LOGIN_FIX}"
    namespace = repo.split("/")[0] if "/" in repo else name
    writable = {name} | {org.get("name") for org in me.get("orgs") or [] if isinstance(org, dict)}
    if name and namespace not in writable:
        return (f"{where}: {name!r} cannot create repositories under {namespace!r} (not their account nor one of "
                f"their organisations: {', '.join(sorted(n for n in writable if n))}); use a hub_model_id under one "
                f"of them, or {LOGIN_FIX.removeprefix('log in with ')}")
    try:
        api.create_repo(repo, private=cfg.hub_private, exist_ok=True)
    except Exception as e:  # noqa: BLE001
        return f"{where}: the repository cannot be created or reached as {name!r} ({type(e).__name__}: {e}); {LOGIN_FIX}"
    return None


def check_access(cfg: Any, ranks: Any = None, api: Any = None) -> None:
    """With push_to_hub, before any model loads: raise HubAccessError when the hub would refuse the uploads. Process 0
    asks the hub and every process gets its answer, so all stop together."""
    if not cfg.push_to_hub:
        return
    problem = access_problem(cfg, api) if ranks is None or ranks.main else None
    if ranks is not None:
        problem = ranks.broadcast(problem)
    if problem:
        raise HubAccessError(problem)


def result_patterns(output_dir: Path, samples: list[Path]) -> list[str]:
    """What the final upload takes from output_dir: the result files at its top (not the event log, not
    checkpoints, caches or tracker folders), the result folders, and the final validation samples."""
    patterns = [p.name for p in sorted(output_dir.iterdir())
                if p.is_file() and not p.name.startswith(".") and p.suffix not in SKIPPED_SUFFIXES]
    patterns += [f"{name}/**" for name in RESULT_FOLDERS if (output_dir / name).is_dir()]
    return patterns + [p.as_posix() for p in samples]


def remote_url(repo: str, path_in_repo: str | None) -> str:
    """The hub page of an uploaded folder: the repository, or its folder under it."""
    from huggingface_hub import constants

    return f"{constants.ENDPOINT}/{repo}" + (f"/tree/main/{path_in_repo}" if path_in_repo else "")


class HubUploader:
    name = "hub upload"

    def __init__(self, run_cfg: RunConfig, run: Any, api: Any = None):
        from huggingface_hub import HfApi

        self.run_cfg, self.run = run_cfg, run
        self.cfg = run_cfg.train
        self.repo = self.cfg.hub_model_id
        self.api = api or HfApi()
        self.jobs: queue.Queue = queue.Queue()
        self.repo_ready = False
        self.result_failed: str | None = None  # why the final result's upload failed (`result_failure`)
        self.result_patterns: list[str] = []
        self.thread = threading.Thread(target=self._work, name="difftune-hub-upload", daemon=True)
        self.thread.start()

    def __call__(self, kind: str, record: dict[str, Any]) -> None:
        if kind == "checkpoint" and self.cfg.push_checkpoints_to_hub:
            folder = Path(record["path"])
            self.jobs.put((f"checkpoint {folder.name}", dict(folder_path=str(folder),
                                                             path_in_repo=f"checkpoints/{folder.name}"),
                           record.get("step")))
            if record.get("pruned"):  # removed locally by checkpoints_(rolling_)total_limit: from the hub too
                self.jobs.put((f"the pruned checkpoint(s) {', '.join(record['pruned'])}", {"pruned": record["pruned"]},
                               record.get("step")))
        elif kind in ("done", "stopped") and record.get("adapter"):
            out = self.run.output_dir
            samples = [Path(p).resolve().relative_to(out.resolve()) for p in record.get("samples", [])
                       if Path(p).suffix in (".png", ".mp4") and Path(p).resolve().is_relative_to(out.resolve())]
            card = model_card(self.run_cfg, self.run, [s for s in samples if s.suffix == ".png"])
            (out / "README.md").write_text(card, encoding="utf-8")
            self.result_patterns = result_patterns(out, samples)
            self.result_failed = "it was still running when the run ended"  # until it succeeds
            self.jobs.put((f"result at step {record.get('step')}",
                           dict(folder_path=str(out), allow_patterns=self.result_patterns), record.get("step")))

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            self._upload(*job)
            self.jobs.task_done()
        self.jobs.task_done()

    def _upload(self, what: str, kwargs: dict[str, Any], step: int | None = None) -> None:
        emit = self.run.events.emit
        for attempt in range(1, ATTEMPTS + 1):
            try:
                if "path_in_repo" in kwargs and not Path(kwargs["folder_path"]).is_dir():
                    emit("info", message=f"{what} was pruned (checkpoints_total_limit, "
                                         "checkpoints_rolling_total_limit) before its upload's turn; not uploaded")
                    return
                if not self.repo_ready:
                    self.api.create_repo(self.repo, private=self.cfg.hub_private, exist_ok=True)
                    self.repo_ready = True
                if "pruned" in kwargs:
                    self._remove(what, kwargs["pruned"])
                    return
                self.api.upload_folder(repo_id=self.repo, commit_message=f"difftune: {what}", **kwargs)
                # local/remote/step: what post_upload_script (train/scripts.py) is given
                emit("hub_upload", quiet=True, what=what, repo=self.repo, attempts=attempt, step=step,
                     local=kwargs["folder_path"], remote=remote_url(self.repo, kwargs.get("path_in_repo")))
                emit("info", message=f"uploaded {what} to the hub repository {self.repo}")
                if "allow_patterns" in kwargs:
                    self.result_failed = None
                return
            except Exception as e:  # noqa: BLE001 - the network's failures are many; each is retried, then reported
                error = f"{type(e).__name__}: {e}"
                if attempt < ATTEMPTS:
                    time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        if "allow_patterns" in kwargs:
            self.result_failed = error
        action = (("removal", "from", "Delete them yourself with HfApi.delete_folder") if "pruned" in kwargs else
                  ("upload", "to", f"Upload it yourself with: {self.retry_command()}" if "allow_patterns" in kwargs
                   else "Upload it yourself with `hf upload` or HfApi.upload_folder"))
        emit("warning", message=f"hub {action[0]} of {what} {action[1]} {self.repo} failed after {ATTEMPTS} attempts "
                                f"({error}); training went on. {action[2]}")

    def retry_command(self) -> str:
        """The `hf upload` command that uploads the final result as this uploader would."""
        include = " ".join(f"--include {shlex.quote(p)}" for p in self.result_patterns)
        return f"hf upload {self.repo} {shlex.quote(str(self.run.output_dir))} . {include}"

    def _remove(self, what: str, names: list[str]) -> None:
        """Delete the folders `checkpoints/<name>` of `names` that the repository holds, in one commit."""
        from huggingface_hub import CommitOperationDelete

        held = {path.split("/")[1] for path in self.api.list_repo_files(self.repo) if path.startswith("checkpoints/")}
        gone = [name for name in names if name in held]
        if not gone:  # never uploaded (pruned before its turn, or uploads failed)
            return
        self.api.create_commit(repo_id=self.repo, commit_message=f"difftune: remove {what}",
                               operations=[CommitOperationDelete(path_in_repo=f"checkpoints/{name}/") for name in gone])
        self.run.events.emit("info", message=f"removed the pruned checkpoint(s) {', '.join(gone)} from the hub "
                                             f"repository {self.repo} (as checkpoints/ locally)")

    def close(self) -> None:
        """Wait for the queued uploads (at most FINAL_WAIT_S), then stop the thread."""
        if self.jobs.unfinished_tasks:
            self.run.events.write(f"waiting for {self.jobs.unfinished_tasks} hub upload(s) to {self.repo} "
                                  f"(at most {FINAL_WAIT_S:g} s; Ctrl-C abandons them)")
        self.jobs.put(None)
        self.thread.join(FINAL_WAIT_S)
        if self.thread.is_alive():
            self.run.events.emit("warning", message=f"hub uploads to {self.repo} were still running after "
                                                    f"{FINAL_WAIT_S:g} s; the run ends without them")


def result_failure(run: Any) -> str | None:
    """After the run: why push_to_hub's result is not on the hub (its upload failed, or was still running when the
    run ended), with the command that uploads it; None when it was uploaded, or push_to_hub is off."""
    uploader = getattr(run, "hub", None)
    if uploader is not None and uploader.result_failed:
        return (f"the upload of the result to the hub repository {uploader.repo} failed ({uploader.result_failed}); "
                f"the trained result is saved in {uploader.run.output_dir}. Upload it with: "
                f"{uploader.retry_command()}")
    return None


def attach(run_cfg: RunConfig, run: Any) -> None:
    """Subscribe the uploader to the run's events (process 0, push_to_hub on)."""
    if run.cfg.push_to_hub and run.ranks.main:
        run.hub = HubUploader(run_cfg, run)
        run.events.subscribers.append(run.hub)
