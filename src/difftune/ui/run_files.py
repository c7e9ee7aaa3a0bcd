"""Where a past run's files are now. An output_dir is shared by every run into it: a run that starts from step 0
moves the earlier result (adapter, validation/, ...) into `superseded-<UTC time>/` and later checkpoints into
`checkpoints/superseded-<UTC time>/` (train/checkpoint.py), then writes files of the same names. The event log
records where each file was written, so a past run's page would link to a later run's adapter and samples, or to
nothing. `RunFiles.locate` finds the file as that run left it: at its recorded place, else in a superseded folder,
and in either place only when it was last written before the run ended (a later run's file of the same name is not
this run's); None when no such file is left.
"""

from __future__ import annotations

from pathlib import Path

SUPERSEDED = "superseded-"
SLACK_S = 1.0  # file times against the event log's clock (the same machine): a write just before the end event


class RunFiles:
    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self._resolved = output_dir.resolve()
        self._relative: dict[str, str | None] = {}
        self._found: dict[tuple[str, float], str | None] = {}  # checked again at each ask: a later run moves files
        self._folders: dict[str, tuple[int, list[str]]] = {}  # superseded folders by parent, with its mtime

    def relative(self, path: str | None) -> str | None:
        """A path from the event log as a path inside output_dir (None when it lies elsewhere); each path is
        resolved once (a poll of a long run asked for every sample's twice)."""
        if not path:
            return None
        if path not in self._relative:
            try:
                self._relative[path] = Path(path).resolve().relative_to(self._resolved).as_posix()
            except (ValueError, OSError):
                self._relative[path] = None
        return self._relative[path]

    def locate(self, path: str | None, ended: float | None, started: float | None = None) -> str | None:
        """`path` (from the event log) as the run that wrote it left it, relative to output_dir; `ended`: when that
        run ended (None while it runs: the recorded place). Of the copies last written before it ended, the latest:
        an earlier run's file of the same name, set aside in an older superseded folder, is not this run's.
        `started`: also not written before the run began (a file the run did not write at all)."""
        rel = self.relative(path)
        if rel is None or ended is None:
            return rel
        key = (rel, ended, started)
        known = self._found.get(key)
        if known is not None and self._written_by(known, ended):  # one stat per poll while the file stays put
            return known
        times = [(t, c) for c in self._candidates(rel) if (t := self._mtime(c)) is not None and t <= ended + SLACK_S
                 and (started is None or t >= started - SLACK_S)]
        self._found[key] = max(times)[1] if times else None
        return self._found[key]

    def _mtime(self, rel: str) -> float | None:
        try:
            return (self.output_dir / rel).stat().st_mtime
        except OSError:
            return None

    def _candidates(self, rel: str) -> list[str]:
        """The recorded place, and the superseded folders a later start moves it into."""
        parts = rel.split("/")
        root, inner = (("checkpoints", "/".join(parts[1:])) if parts[0] == "checkpoints" and len(parts) > 1
                       else ("", rel))
        return [rel] + [f"{root}/{name}/{inner}".lstrip("/") for name in self.superseded(root)]

    def superseded(self, root: str) -> list[str]:
        """The superseded-* folders in output_dir/root, listed again only when that folder changed."""
        parent = self.output_dir / root
        try:
            mtime = parent.stat().st_mtime_ns
            if (cached := self._folders.get(root)) is not None and cached[0] == mtime:
                return cached[1]
            names = sorted(p.name for p in parent.iterdir() if p.name.startswith(SUPERSEDED) and p.is_dir())
        except OSError:
            return []
        self._folders[root] = (mtime, names)
        return names

    def _written_by(self, rel: str, ended: float) -> bool:
        try:
            return (self.output_dir / rel).stat().st_mtime <= ended + SLACK_S
        except OSError:
            return False
