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
"""

from __future__ import annotations

import queue
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
            self.jobs.put((f"result at step {record.get('step')}",
                           dict(folder_path=str(out), allow_patterns=result_patterns(out, samples)), record.get("step")))

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
                return
            except Exception as e:  # noqa: BLE001 - the network's failures are many; each is retried, then reported
                error = f"{type(e).__name__}: {e}"
                if attempt < ATTEMPTS:
                    time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        action = (("removal", "from", "Delete them yourself with HfApi.delete_folder") if "pruned" in kwargs else
                  ("upload", "to", "Upload it yourself with `huggingface-cli upload` or HfApi.upload_folder"))
        emit("warning", message=f"hub {action[0]} of {what} {action[1]} {self.repo} failed after {ATTEMPTS} attempts "
                                f"({error}); training went on. {action[2]}")

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


def attach(run_cfg: RunConfig, run: Any) -> None:
    """Subscribe the uploader to the run's events (process 0, push_to_hub on)."""
    if run.cfg.push_to_hub and run.ranks.main:
        run.events.subscribers.append(HubUploader(run_cfg, run))
