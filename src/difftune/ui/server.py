"""`difftune server`: the web UI. One page (static/index.html) over a small JSON API.

Security: listens on 127.0.0.1 unless told otherwise; any other address needs an access token,
checked on every request (header `X-Difftune-Token` or `Authorization: Bearer`, or the cookie the
page gets from `/?token=...`) with a constant-time compare. Without a token only loopback Host names
are answered (no DNS rebinding), and requests that change something must be JSON from the page's own
origin (no cross-site forms). Every path stays inside the roots (ui/paths.py). Errors are JSON
`{"error": message}`; a bad request gets a 4xx, never a traceback.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import mimetypes
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from difftune.config.load import ConfigError, load_config, load_datasets, split_problem
from difftune.ui import dataset_fields, form_schema, path_problems, train_fields
from difftune.ui.paths import PathRefused, Roots
from difftune.ui.runs import Registry

STATIC = Path(__file__).parent / "static"
COOKIE = "difftune_token"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "testserver")
DEFAULT_DATASETS = "config/multidatabackend.json"
log = logging.getLogger("difftune.ui")


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


class ConfigBody(BaseModel):
    path: str = Field(..., max_length=4096)
    config: dict[str, Any]
    datasets: list[Any] = []


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


def access_token(host: str, token: str | None) -> str | None:
    """The token to enforce: the one given, or a new one when listening beyond loopback."""
    if token:
        return token
    return None if is_loopback(host) else secrets.token_urlsafe(24)


def _token_ok(supplied: str | None, token: str) -> bool:
    return supplied is not None and hmac.compare_digest(supplied.encode(), token.encode())


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ApiError(404, f"{path}: {what} not found") from e
    except json.JSONDecodeError as e:
        raise ApiError(422, f"{path}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ApiError(400, f"{path}: cannot read {what}: {e}") from e


def create_app(roots: list[str | Path], token: str | None = None, state_dir: str | Path | None = None,
               allowed_hosts: tuple[str, ...] | None = None) -> FastAPI:
    """The app. `token` None: no token (loopback only; Host names limited to `allowed_hosts`)."""
    confined = Roots(roots)
    if state_dir is None:
        from difftune.models.tiny import difftune_home

        state_dir = difftune_home() / "ui"
    registry = Registry(Path(state_dir), confined.base)
    hosts = allowed_hosts if allowed_hosts is not None else (() if token else LOOPBACK_NAMES)
    app = FastAPI(title="difftune", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.roots, app.state.registry, app.state.token = confined, registry, token

    # --- guard: host, token, same-origin JSON for changes; security headers on every answer
    @app.middleware("http")
    async def guard(request: Request, call_next):
        host = urlsplit("//" + request.headers.get("host", "")).hostname or ""
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
                supplied, from_query = request.query_params.get("token"), True
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
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        else:
            response = await call_next(request)
        response.headers.update({
            "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; media-src 'self'; "
                                       "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
        })
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

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # --- schema, roots, folders
    @app.get("/api/schema")
    async def schema():
        return form_schema()

    @app.get("/api/roots")
    async def get_roots():
        return {"roots": [str(r) for r in confined], "base": str(confined.base)}

    @app.get("/api/browse")
    async def browse(path: str | None = None, files: bool = False):
        if not path:
            return {"path": None, "parent": None, "entries": [
                {"name": str(r), "path": str(r), "kind": "folder"} for r in confined]}
        folder = confined.confine(path)
        if not folder.is_dir():
            raise ApiError(400, f"{path!r} is not a folder")
        entries = []
        for entry in sorted(folder.iterdir(), key=lambda p: (not p.is_dir(), p.name.lower()))[:2000]:
            if entry.name.startswith(".") or not confined.inside(entry):
                continue  # hidden files, and symlinks that lead out of the roots
            if entry.is_dir():
                entries.append({"name": entry.name, "path": str(entry), "kind": "folder"})
            elif files:
                entries.append({"name": entry.name, "path": str(entry), "kind": "file"})
        images = sum(1 for e in folder.iterdir() if e.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
        parent = folder.parent if folder.parent != folder and confined.inside(folder.parent) else None
        return {"path": str(folder), "parent": str(parent) if parent else None, "entries": entries,
                "images": images}

    # --- configurations
    def datasets_location(config_path: Path, config: dict[str, Any]) -> Path:
        value = config.get("data_backend_config", DEFAULT_DATASETS)
        if not isinstance(value, str) or not value:
            value = str(config_path.parent / "multidatabackend.json")
        return confined.confine(value)

    def check(config_path: Path, config: dict[str, Any], datasets: list[Any]) -> dict[str, Any]:
        """Validate with `load_config` (the same messages as `difftune check`), files in a temp folder."""
        problems: list[str] = []
        try:
            data_path = datasets_location(config_path, config)
        except PathRefused as e:  # shown at the field; saving there is refused
            problems.append(f"{config_path}: data_backend_config: {e}")
            data_path = config_path.parent / "(outside the roots)"
        with tempfile.TemporaryDirectory(prefix="difftune-ui-") as tmp:
            tmp_cfg, tmp_data = Path(tmp) / "config.json", Path(tmp) / "datasets.json"
            tmp_data.write_text(json.dumps(datasets))
            cfg = dict(config)
            if isinstance(cfg.get("data_backend_config", ""), str):
                cfg["data_backend_config"] = str(tmp_data)
            tmp_cfg.write_text(json.dumps(cfg))
            try:
                load_config(tmp_cfg)
            except ConfigError as e:
                problems += e.problems
            if not any(p.startswith(f"{tmp_data}: ") for p in problems):
                try:  # check stops at a bad config.json; the form shows the dataset problems too
                    load_datasets(tmp_data, problems)
                except ConfigError as e:
                    problems += e.problems
            problems = [p.replace(str(tmp_cfg), str(config_path)).replace(str(tmp_data), str(data_path))
                        for p in dict.fromkeys(problems)]
        problems = list(dict.fromkeys(problems + outside_roots(config_path, config, data_path, datasets)))
        return {"ok": not problems, "config_path": str(config_path), "datasets_path": str(data_path),
                "problems": [structured(p, config_path, data_path, datasets) for p in problems]}

    def outside_roots(config_path: Path, config: dict[str, Any], data_path: Path, datasets: list[Any]) -> list[str]:
        problems = path_problems(confined, config, train_fields(), str(config_path))
        kinds = dataset_fields()
        for index, entry in enumerate(datasets):
            if isinstance(entry, dict) and entry.get("dataset_type", "image") in kinds:
                where = f"{data_path}: dataset {entry.get('id', index)!r}"
                problems += path_problems(confined, entry, kinds[entry.get("dataset_type", "image")]["fields"], where)
        return problems

    def structured(text: str, config_path: Path, data_path: Path, datasets: list[Any]) -> dict[str, Any]:
        p = split_problem(text, (str(config_path), str(data_path)))
        scope = "config" if p.file == str(config_path) else "datasets" if p.file == str(data_path) else "other"
        index = None
        if isinstance(p.dataset, int) and not isinstance(p.dataset, bool):
            index = p.dataset
        elif p.dataset is not None:
            index = next((i for i, d in enumerate(datasets) if isinstance(d, dict) and d.get("id") == p.dataset), None)
        if scope == "datasets" and index is None and p.dataset is None:
            scope = "datasets-list"
        return {"text": p.text, "scope": scope, "dataset_index": index, "key": p.key, "message": p.message,
                "mentions": list(p.mentions)}

    @app.get("/api/config")
    async def open_config(path: str):
        config_path = confined.confine(path)
        config = _read_json(config_path, "config file")
        if not isinstance(config, dict):
            raise ApiError(422, f"{config_path}: the config must be a JSON object of keys and values")
        datasets: list[Any] = []
        try:
            data_path = datasets_location(config_path, config)
        except PathRefused:
            data_path = None  # the check below shows the problem at data_backend_config
        if data_path is not None and data_path.exists():
            loaded = _read_json(data_path, "dataset list")
            datasets = loaded if isinstance(loaded, list) else []
        result = check(config_path, config, datasets)
        return {"path": str(config_path), "config": config, "datasets": datasets, **result}

    @app.post("/api/config/check")
    async def check_config(body: ConfigBody):
        return check(confined.confine(body.path), body.config, body.datasets)

    @app.put("/api/config")
    async def save_config(body: ConfigBody):
        config_path = confined.confine(body.path)
        if config_path.suffix != ".json":
            raise ApiError(400, f"{body.path!r}: a config file name ends with .json")
        data_path = datasets_location(config_path, body.config)
        if data_path.suffix != ".json":
            raise ApiError(400, f"data_backend_config {str(data_path)!r}: a dataset list file name ends with .json")
        if config_path.is_dir() or data_path.is_dir():
            raise ApiError(400, "a folder of that name is in the way; choose another file name")
        _write_json(data_path, body.datasets)
        _write_json(config_path, body.config)
        return {"saved": [str(config_path), str(data_path)], **check(config_path, body.config, body.datasets)}

    # --- runs
    @app.get("/api/runs")
    async def list_runs():
        return {"runs": [run.summary() for run in registry.list() if confined.inside(run.output_dir)]}

    def find(run_id: str):
        run = registry.get(run_id) if run_id.replace("-", "").isalnum() else None
        if run is None or not confined.inside(run.output_dir):
            raise ApiError(404, f"no run {run_id!r}")
        return run

    @app.post("/api/runs")
    async def start_run(body: PathBody):
        config_path = confined.confine(body.path)
        config = _read_json(config_path, "config file")
        if not isinstance(config, dict):
            raise ApiError(422, f"{config_path}: the config must be a JSON object of keys and values")
        data_path = datasets_location(config_path, config)
        datasets = _read_json(data_path, "dataset list") if data_path.is_file() else []
        problems: list[str] = []
        try:
            run_cfg = load_config(config_path)
        except ConfigError as e:
            problems = list(e.problems)
        problems += outside_roots(config_path, config, data_path, datasets if isinstance(datasets, list) else [])
        if problems:
            raise ApiError(422, "the configuration cannot be used; fix the problems shown", ok=False,
                           problems=[structured(p, config_path, data_path, datasets) for p in problems])
        output_dir = confined.confine(run_cfg.train.output_dir)
        if (active := registry.active_on(output_dir)) is not None:
            raise ApiError(409, f"run {active.id} is still writing to {output_dir}; stop it first")
        output_dir.mkdir(parents=True, exist_ok=True)
        run = registry.spawn(config_path, output_dir)
        return run.summary(detail=True)

    @app.get("/api/runs/{run_id}")
    async def get_run(run_id: str):
        return find(run_id).summary(detail=True)

    @app.post("/api/runs/{run_id}/command")
    async def command(run_id: str, body: CommandBody):
        run = find(run_id)
        if body.command not in ("stop", "sample", "save", "kill"):
            raise ApiError(400, f"unknown command {body.command!r}; use stop, sample, save or kill")
        status, _ = run.status()
        if status not in ("starting", "running", "stopping"):
            raise ApiError(409, f"run {run.id} is {status}; commands go to runs that are going")
        registry.command(run, body.command)
        return run.summary(detail=True)

    @app.get("/api/runs/{run_id}/file")
    async def run_file(run_id: str, path: str):
        run = find(run_id)
        if Path(path).is_absolute():
            raise ApiError(400, "give the path relative to the run's output folder")
        target = confined.confine(run.output_dir / path)
        if not target.is_relative_to(run.output_dir.resolve()):
            raise PathRefused(f"{path!r} is outside the run's output folder")
        if not target.is_file():
            raise ApiError(404, f"{path!r}: no such file in the run's output folder")
        media = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        inline = media.startswith(("image/", "video/", "text/"))
        return FileResponse(target, media_type=media, content_disposition_type="inline" if inline else "attachment",
                            filename=target.name)

    @app.get("/api/runs/{run_id}/log")
    async def run_log(run_id: str, lines: int = 200):
        return {"lines": find(run_id).log_tail(max(1, min(lines, 2000)))}

    return app


def serve(host: str = "127.0.0.1", port: int = 8001, roots: list[str] | None = None, token: str | None = None,
          state_dir: str | None = None) -> None:
    import uvicorn

    token = access_token(host, token)
    app = create_app(roots or [os.getcwd()], token=token, state_dir=state_dir)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{'[' + shown + ']' if ':' in shown else shown}:{port}/"
    print(f"difftune server: roots {', '.join(str(r) for r in app.state.roots)}", flush=True)
    print(f"open {url}{'?token=' + token if token else ''}", flush=True)
    if token and not is_loopback(host):
        print("this server listens beyond this machine: every request must carry the access token", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
