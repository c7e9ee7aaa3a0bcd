"""`difftune server`: the web UI. One page (static/index.html) over a small JSON API.

Security: listens on 127.0.0.1 unless told otherwise; any other address needs an access token,
checked on every request with a constant-time compare: header `X-Difftune-Token` or `Authorization:
Bearer`, or the HttpOnly, SameSite=Strict cookie the page gets from `/?token=...` (the query is taken
on that first page only: a token in a URL ends up in histories and logs). Without a token only loopback
Host names are answered (no DNS rebinding), and requests that change something must be JSON from the
page's own origin (no cross-site forms). Bodies are limited in size and shape (ui/limits.py). Every
path stays inside the roots, including each path a config makes the trainer use (ui/confine.py), and
a path outside them is refused in the same words whether it exists or not. Routes that touch the
filesystem are plain functions, which FastAPI runs in worker threads, and read only regular files of a
bounded size: a FIFO or a device named in a config cannot stall the server. Errors are JSON
`{"error": message}`; a bad request gets a 4xx, never a traceback.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import json
import logging
import mimetypes
import os
import secrets
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from difftune.config.load import ConfigError
from difftune.files import as_created
from difftune.ui import form_schema
from difftune.ui.checking import check, datasets_location
from difftune.ui.limits import BadJson, BodyLimit, parse_json
from difftune.ui.paths import NotReadable, PathRefused, Roots, read_regular
from difftune.ui.runs import Registry

STATIC = Path(__file__).parent / "static"
COOKIE = "difftune_token"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
INLINE_TEXT = ("text/plain", "text/markdown", "text/csv")  # run files the page may show as text
log = logging.getLogger("difftune.ui")


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


class ConfigBody(BaseModel):
    path: str = Field(..., max_length=4096)
    config: dict[str, Any]
    datasets: list[Any] = []


class CheckBody(ConfigBody):
    scan: bool = False  # scan the datasets' files too (the Check button; not the check while typing)


class SaveBody(ConfigBody):
    # path -> version (`_version`) of each file as the page opened it: a file that exists is replaced only
    # when it is the one the page opened, unchanged since, or when the user confirmed (`overwrite`)
    opened: dict[str, str] = Field(default_factory=dict, max_length=16)
    overwrite: bool = False


class PlanBody(ConfigBody):
    gpu_memory: float | None = Field(None, gt=0, le=100_000)  # GiB to fit; none: the prediction alone
    processes: int = Field(1, ge=1, le=4096)


class PathBody(BaseModel):
    path: str = Field(..., max_length=4096)


class CommandBody(BaseModel):
    command: str


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


MIN_TOKEN_CHARS = 16


def access_token(host: str, token: str | None) -> str | None:
    """The token to enforce: the one given, or a new one when listening beyond loopback. Beyond loopback the
    token is all that guards a server that starts processes: a short one given there is refused."""
    if token:
        if len(token) < MIN_TOKEN_CHARS and not is_loopback(host):
            raise ConfigError([f"--token: {len(token)} character(s) is too short for a server listening on {host} "
                               f"(reachable from other machines); give at least {MIN_TOKEN_CHARS}, or leave --token "
                               "out and a strong one is generated; nothing was started"])
        return token
    return None if is_loopback(host) else secrets.token_urlsafe(24)


def _token_ok(supplied: str | None, token: str) -> bool:
    return supplied is not None and hmac.compare_digest(supplied.encode(), token.encode())


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    as_created(fd)  # the user's config: the mode their editor would give it
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)  # a prompt in Chinese or Hindi stays readable
        f.write("\n")
    os.replace(tmp, path)


def _read_json(path: Path, what: str, duplicates: list[str] | None = None) -> Any:
    """A JSON file inside the roots: a regular file of bounded size, read without blocking. A key written twice in
    one object is appended to `duplicates` as `difftune check` says it (the file is still returned)."""
    try:
        return parse_json(read_regular(path), path, what, duplicates)
    except FileNotFoundError as e:
        raise ApiError(404, f"{path}: {what} not found") from e
    except (NotReadable, BadJson) as e:
        raise ApiError(422, f"{path}: cannot use it as the {what}: {e}") from e
    except OSError as e:
        raise ApiError(400, f"{path}: cannot read the {what}: {e.strerror or e}") from e


def _version(path: Path) -> str | None:
    """A digest of the file's bytes, to tell whether it is still the one the page opened (None: not readable)."""
    try:
        return hashlib.sha256(read_regular(path)).hexdigest()
    except (OSError, NotReadable):
        return None


def _writable(target: Path) -> None:
    """ApiError unless `target` can be written as a file: no folder or special file of that name, and
    the nearest existing folder above it is a folder (a file in the way would fail halfway)."""
    if target.exists() and not target.is_file():
        raise ApiError(400, f"{target}: something other than a file is in the way; choose another file name")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ApiError(400, f"{parent} is a file, so {target} cannot be written; choose another place")


def create_app(roots: list[str | Path], token: str | None = None, state_dir: str | Path | None = None,
               allowed_hosts: tuple[str, ...] | None = None) -> FastAPI:
    """The app. `token` None: no token (loopback only; Host names limited to `allowed_hosts`)."""
    confined = Roots(roots)
    if state_dir is None:
        from difftune.models.tiny import difftune_home

        state_dir = difftune_home() / "ui"
    try:
        registry = Registry(Path(state_dir), confined.base)
    except OSError as e:  # a file of that name, no permission
        raise ValueError(f"--state-dir {state_dir}: cannot keep the runs there ({e.strerror or e}); choose a folder "
                         "this user can write") from e
    saving, starting = threading.Lock(), threading.Lock()  # the routes run in worker threads
    hosts = allowed_hosts if allowed_hosts is not None else (() if token else LOOPBACK_NAMES)
    app = FastAPI(title="difftune", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.roots, app.state.registry, app.state.token = confined, registry, token

    # inner to the guard below (middleware added later runs first): bodies are read only once allowed
    app.add_middleware(BodyLimit)

    # --- guard: host, token, same-origin JSON for changes; security headers on every answer
    @app.middleware("http")
    async def guard(request: Request, call_next):
        try:
            host = urlsplit("//" + request.headers.get("host", "")).hostname or ""
        except ValueError:  # "[bad" and the like: not a name this server answers to
            host = "?"
        if hosts and host not in hosts:
            return _error(403, f"host {host!r} is not served without an access token; open http://127.0.0.1 "
                          "or start the server with --token")
        from_query = False
        if token:
            supplied = request.headers.get("x-difftune-token")
            auth = request.headers.get("authorization", "")
            if supplied is None and auth.lower().startswith("bearer "):
                supplied = auth[7:].strip()
            if supplied is None:
                supplied = request.cookies.get(COOKIE)
            if not _token_ok(supplied, token):
                # the query is taken on the first page only: it becomes the cookie, and a redirect drops it
                first_page = request.url.path == "/" and request.method == "GET"
                supplied, from_query = (request.query_params.get("token") if first_page else None), True
                if not _token_ok(supplied, token):
                    return _error(401, "an access token is needed: open the URL printed when the server "
                                  "started (it ends with ?token=...), or send the X-Difftune-Token header")
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            origin = request.headers.get("origin")
            if origin and urlsplit(origin).netloc != request.headers.get("host"):
                return _error(403, "cross-origin requests are refused")
            if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
                return _error(415, "send JSON (Content-Type: application/json)")
        if from_query and request.url.path == "/" and request.method == "GET":
            response: Response = RedirectResponse("/", status_code=303)
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/")
        else:
            response = await call_next(request)
        response.headers.update({
            "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"})
        # a run's file keeps its own, sandboxed policy (run_file)
        response.headers.setdefault("Content-Security-Policy",
                                    "default-src 'self'; img-src 'self' data: blob:; media-src 'self'; "
                                    "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'")
        return response

    # --- errors: always JSON with a message, never a traceback
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError):
        return _error(e.status, e.message, **e.extra)

    @app.exception_handler(PathRefused)
    async def path_refused(_request: Request, e: PathRefused):
        return _error(403, str(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, e: RequestValidationError):
        parts = []
        if any(err.get("type") == "json_invalid" for err in e.errors()):
            return _error(422, "bad request: the body is not valid JSON")
        for err in e.errors()[:5]:
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{loc + ': ' if loc else ''}{err.get('msg', 'invalid')}")
        return _error(422, "bad request: " + "; ".join(parts))

    @app.exception_handler(OSError)
    async def os_error(_request: Request, e: OSError):
        return _error(400, f"{e.strerror or 'cannot use the path'}: {e.filename or ''}".rstrip(": "))

    @app.exception_handler(ValueError)
    async def value_error(_request: Request, e: ValueError):
        return _error(400, str(e) or "bad value")

    @app.exception_handler(Exception)
    async def internal(_request: Request, e: Exception):
        log.exception("internal error")
        return _error(500, f"internal error ({type(e).__name__}); the server log has the details")

    # --- pages
    @app.get("/")
    async def index():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/favicon.ico")
    async def favicon():  # browsers ask on every page load; no icon, and no 404 in their console
        return Response(status_code=204)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # --- schema, roots, folders
    @app.get("/api/schema")
    async def schema():
        return form_schema()

    @app.get("/api/roots")
    async def get_roots():
        return {"roots": [str(r) for r in confined], "base": str(confined.base)}

    @app.get("/api/browse")
    def browse(path: str | None = None, files: bool = False):
        if not path:
            return {"path": None, "parent": None, "entries": [
                {"name": str(r), "path": str(r), "kind": "folder"} for r in confined]}
        folder = confined.confine(path)
        if not folder.is_dir():
            raise ApiError(400, f"{path!r} is not a folder")
        # the types discovery reads (the data layer, which imports torch: not at server start); this folder only,
        # a picker answer must not walk a whole tree
        from difftune.data.discovery import CLIP_SUFFIXES
        from difftune.data.images import IMAGE_EXTENSIONS

        listed = list(folder.iterdir())  # one read of the folder for the entries and both counts
        images = sum(1 for e in listed if e.suffix.lower() in IMAGE_EXTENSIONS)
        clips = sum(1 for e in listed if e.suffix.lower() in CLIP_SUFFIXES)  # a GIF counts as either
        entries = []
        for entry in sorted(listed, key=lambda p: (not p.is_dir(), p.name.lower()))[:2000]:
            if entry.name.startswith(".") or not confined.inside(entry):
                continue  # hidden files, and symlinks that lead out of the roots
            if entry.is_dir():
                entries.append({"name": entry.name, "path": str(entry), "kind": "folder"})
            elif files:
                entries.append({"name": entry.name, "path": str(entry), "kind": "file"})
        parent = folder.parent if folder.parent != folder and confined.inside(folder.parent) else None
        return {"path": str(folder), "parent": str(parent) if parent else None, "entries": entries,
                "images": images, "clips": clips}

    # --- configurations (plain functions: FastAPI runs them in a worker thread, off the event loop)
    def read_config(config_path: Path, duplicates: list[str] | None = None) -> dict[str, Any]:
        config = _read_json(config_path, "config file", duplicates)
        if not isinstance(config, dict):
            raise ApiError(422, f"{config_path}: the config must be a JSON object of keys and values")
        return config

    @app.get("/api/config")
    def open_config(path: str):
        config_path = confined.confine(path)
        twice: list[str] = []  # keys written twice: shown, and saving from the page keeps one
        config = read_config(config_path, twice)
        loaded: Any = []
        try:
            data_path = datasets_location(confined, config_path, config)
        except PathRefused:
            data_path = None  # the check below shows the problem at data_backend_config
        unreadable = None  # a dataset list with a JSON mistake: the config opens, to fix it from the page
        if data_path is not None and data_path.is_file():
            try:
                loaded = _read_json(data_path, "dataset list", twice)
            except ApiError as e:
                if e.status != 422:
                    raise
                loaded, unreadable = [], e.message
        result, _ = check(confined, config_path, config, loaded, scan=True, found=twice + [unreadable] * bool(unreadable))
        # a dataset list that is not a list (or not JSON) is shown with the problem and no entries; it is left out
        # of the opened versions, so that a save asks before replacing it
        opened = [config_path] + ([data_path] if data_path is not None and isinstance(loaded, list)
                                  and unreadable is None else [])
        versions = {str(p): v for p in opened if (v := _version(p)) is not None}
        return {"path": str(config_path), "config": config, "datasets": loaded if isinstance(loaded, list) else [],
                "versions": versions, **result}

    @app.post("/api/config/check")
    def check_config(body: CheckBody):
        return check(confined, confined.confine(body.path), body.config, body.datasets, scan=body.scan)[0]

    @app.post("/api/config/plan")
    def plan_config(body: PlanBody):
        """`difftune plan` on the config being edited: the predicted peak per phase and, with gpu_memory, the
        cheapest settings that fit (`plan.choice.settings`: keys the form sets). Only a config that passes the
        check is planned; its datasets are scanned as `check` scans them (without writing metadata)."""
        answer, run_cfg = check(confined, confined.confine(body.path), body.config, body.datasets, scan=True)
        if run_cfg is None:
            return {**answer, "plan": None}
        from difftune.memory_plan.levers import choose, reserve_for
        from difftune.memory_plan.predict import predict
        from difftune.memory_plan.render import as_json
        from difftune.train.plan import DataError, discover_all

        try:
            found = discover_all(run_cfg, write_metadata=False, fetch=False)
        except DataError as e:
            raise ApiError(422, str(e)) from e
        prediction = predict(run_cfg.train, found, body.processes)
        choice = choose(run_cfg.train, found, body.gpu_memory, body.processes, prediction,
                        reserve_for(body.gpu_memory)) if body.gpu_memory else None
        return {**answer, "plan": as_json(prediction, choice)}

    @app.put("/api/config")
    def save_config(body: SaveBody):
        """Everything is checked before the first byte is written: both targets, their folders, that an existing
        file is the one the page opened (409 with `conflicts` otherwise, unless `overwrite`), the check."""
        config_path = confined.confine(body.path)
        if config_path.suffix != ".json":
            raise ApiError(400, f"{body.path!r}: a config file name ends with .json")
        data_path = datasets_location(confined, config_path, body.config)
        if data_path.suffix != ".json":
            raise ApiError(400, f"data_backend_config {str(data_path)!r}: a dataset list file name ends with .json")
        if data_path == config_path:
            raise ApiError(400, "data_backend_config names the config file itself; give the dataset list its own file")
        for target in (config_path, data_path):
            _writable(target)
        result, _ = check(confined, config_path, body.config, body.datasets, scan=True)
        # the versions compared and the files written under one lock: two pages saving the same file at once got
        # 200 both, and the later write replaced the earlier without a word
        with saving:
            conflicts = [str(t) for t in (config_path, data_path)
                         if t.exists() and not body.overwrite and body.opened.get(str(t)) != _version(t)]
            if conflicts:
                raise ApiError(409, "; ".join(f"{c} already exists, and this page did not open it (or it changed "
                                              "since)" for c in conflicts)
                               + ": save under another name, or confirm to replace it", conflicts=conflicts)
            _write_json(data_path, body.datasets)
            _write_json(config_path, body.config)
            versions = {str(p): v for p in (config_path, data_path) if (v := _version(p)) is not None}
        return {"saved": [str(config_path), str(data_path)], "versions": versions, **result}

    # --- runs
    @app.get("/api/runs")
    def list_runs():
        return {"runs": [run.summary() for run in registry.list() if confined.inside(run.output_dir)]}

    def find(run_id: str):
        run = registry.get(run_id) if run_id.replace("-", "").isalnum() else None
        if run is None or not confined.inside(run.output_dir):
            raise ApiError(404, f"no run {run_id!r}")
        return run

    @app.post("/api/runs")
    def start_run(body: PathBody):
        config_path = confined.confine(body.path)
        twice: list[str] = []  # a key written twice is refused, as `difftune train` refuses it
        config = read_config(config_path, twice)
        datasets: Any = []
        try:
            data_path = datasets_location(confined, config_path, config)
        except PathRefused:
            data_path = None  # the check shows the problem at data_backend_config
        if data_path is not None and not data_path.exists():
            raise ApiError(422, f"{config_path}: data_backend_config: the dataset list {data_path} is not there; "
                           "save the config from the page to write it")
        if data_path is not None and data_path.is_file():
            datasets = _read_json(data_path, "dataset list", twice)
        result, run_cfg = check(confined, config_path, config, datasets, scan=True, found=twice)
        if run_cfg is None:
            raise ApiError(422, "the configuration cannot be used; fix the problems shown", **result)
        output_dir = confined.confine_config(run_cfg.train.output_dir)
        from difftune.train.run_lock import in_use

        with starting:  # two Starts at once both passed the check below, and one run then failed on the lock
            if (active := registry.active_on(output_dir)) is not None:
                raise ApiError(409, f"run {active.id} is still writing to {output_dir}; stop it first")
            if (holder := in_use(output_dir)) is not None:  # `difftune train` from a terminal, say
                raise ApiError(409, f"output_dir {output_dir} is in use by another training run ({holder}); wait for "
                               "it to end or stop it, or choose another output_dir")
            output_dir.mkdir(parents=True, exist_ok=True)
            # what was checked, not the files again
            run = registry.spawn(config_path, output_dir, config, datasets, datasets_path=data_path)
        return run.summary(detail=True)

    @app.get("/api/runs/{run_id}")
    def get_run(run_id: str):
        return find(run_id).summary(detail=True)

    @app.post("/api/runs/{run_id}/command")
    def command(run_id: str, body: CommandBody):
        run = find(run_id)
        if body.command not in ("stop", "sample", "save", "kill"):
            raise ApiError(400, f"unknown command {body.command!r}; use stop, sample, save or kill")
        status, _ = run.status()
        if status not in ("starting", "running", "stopping"):
            raise ApiError(409, f"run {run.id} is {status}; commands go to runs that are going")
        registry.command(run, body.command)
        return run.summary(detail=True)

    @app.get("/api/runs/{run_id}/file")
    def run_file(run_id: str, path: str):
        run = find(run_id)
        if Path(path).is_absolute():
            raise ApiError(400, "give the path relative to the run's output folder")
        target = confined.confine(run.output_dir / path)
        if not target.is_relative_to(run.output_dir.resolve()):
            raise PathRefused(f"{path!r} is outside the run's output folder")
        if not target.is_file():
            raise ApiError(404, f"{path!r}: no such file in the run's output folder")
        media = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        # shown in the page: samples and plain text. An HTML, script or SVG file put in an output folder would run
        # in this origin (with the API's rights), so everything else is a download, and sandboxed either way
        inline = (media.startswith(("image/", "video/")) and media != "image/svg+xml") or media in INLINE_TEXT
        response = FileResponse(target, media_type=media if inline else "application/octet-stream",
                                content_disposition_type="inline" if inline else "attachment", filename=target.name)
        response.headers["Content-Security-Policy"] = ("sandbox; default-src 'none'; img-src 'self'; media-src 'self'; "
                                                       "frame-ancestors 'none'")
        return response

    @app.get("/api/runs/{run_id}/log")
    def run_log(run_id: str, lines: int = 200):
        return {"lines": find(run_id).log_tail(max(1, min(lines, 2000)))}

    return app


def _listen(host: str, port: int) -> socket.socket:
    """The bound socket (as uvicorn binds it), so that a port in use is known before the URL is printed."""
    sock = socket.socket(family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = "; another server (difftune's?) is using it: stop it or choose another --port" \
            if e.errno == errno.EADDRINUSE else ""
        raise ConfigError([f"--host {host} --port {port}: cannot listen there ({e.strerror or e}){hint}; "
                           "nothing was started"]) from None
    sock.set_inheritable(True)
    return sock


def serve(host: str = "127.0.0.1", port: int = 8001, roots: list[str] | None = None, token: str | None = None,
          state_dir: str | None = None) -> None:
    """Start the server; a bad root, port or host is a ConfigError (`error: ...`, exit 2) before anything listens."""
    import uvicorn

    if not 1 <= port <= 65535:
        raise ConfigError([f"--port {port}: a port is a number from 1 to 65535"])
    token = access_token(host, token)
    try:
        app = create_app(roots or [os.getcwd()], token=token, state_dir=state_dir)
    except ValueError as e:  # a root that is missing or not a folder, a state folder that cannot be used
        raise ConfigError([str(e) if str(e).startswith("--state-dir") else f"--root: {e}"]) from None
    sock = _listen(host, port)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{'[' + shown + ']' if ':' in shown else shown}:{port}/"
    print(f"difftune server: roots {', '.join(str(r) for r in app.state.roots)}", flush=True)
    print(f"open {url}{'?token=' + token if token else ''}", flush=True)
    if token and not is_loopback(host):
        print("this server listens beyond this machine: every request must carry the access token", flush=True)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run(sockets=[sock])
