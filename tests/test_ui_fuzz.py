"""A bounded fuzz of every route of the web UI: a fixed-seed generator of malformed paths, query
parameters, headers and bodies, sent in-process (no network) until N requests, then it stops. Every
answer must be below 500 and carry a JSON message when it is an error.

The short run (a few hundred requests) is part of `make test`; the long one runs with the browser/UI
target (`make test-browser`, `make test-ui`): it is marked slow as well, so `make test` leaves it out.
Nothing is started: the registry's spawn is replaced, so a config that happens to pass does not train.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Mount

from conftest import write_config
from difftune.demo import make_dataset
from difftune.ui.server import ApiError, create_app

SEED = 12


def junk_paths(root: Path, outside: Path) -> list[str]:
    return [str(root), str(root / "config" / "config.json"), str(root / "config" / "multidatabackend.json"),
            str(root / "pipe.json"), str(root / "images"), str(root / "missing.json"), str(outside),
            str(outside / "secret.json"), "~nosuchuser/x.json", "~", "../../etc/passwd", "/dev/zero", "/proc/self/fd/0",
            "a\x00b", "", " ", "/" * 300, "x" * 5000, "é/ü/中.json", "\ud800", "config/config.json", ".", "..",
            str(root / "loop"), "%2e%2e/x", "C:\\windows", "org/model", "latest"]


def junk_value(rng: random.Random, paths: list[str], depth: int = 0):
    """Any JSON value, with a leaning to the ones that broke things: paths, huge numbers, wrong types."""
    kind = rng.randrange(12 if depth < 4 else 8)
    if kind == 0:
        return rng.choice(paths)
    if kind == 1:
        return rng.choice([0, -1, 1, 2 ** 63, -(2 ** 70), 10 ** 80, 1e308, -1e-320, 0.5, 3])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.choice(["", "null", "none", "image", "text_embeds", "lumina2", "tiny-random", "latest", "stop",
                           "../x", "a" * rng.randrange(1, 3000), "\u202e\u0000", "--x", "-1"])
    if kind in (4, 5, 6, 7):
        return rng.choice(paths) if rng.random() < 0.5 else "".join(rng.choice("ab/._-~\\%\x00é") for _ in range(8))
    if kind in (8, 9):
        return [junk_value(rng, paths, depth + 1) for _ in range(rng.randrange(4))]
    return {junk_key(rng): junk_value(rng, paths, depth + 1) for _ in range(rng.randrange(5))}


KEYS = ["model_family", "model_flavour", "output_dir", "--output_dir", "data_backend_config", "--cache_dir_vae",
        "cache_dir_vae", "instance_data_dir", "--instance_data_dir", "user_prompt_library", "--user_prompt_library",
        "lycoris_config", "init_lora", "resume_from_checkpoint", "pretrained_model_name_or_path", "id",
        "dataset_type", "parquet", "path", "text_embeds", "cache_dir", "learning_rate", "max_train_steps",
        "resolution", "disabled", "default", "caption_strategy", "", "-", "\x00", "é"]


def junk_key(rng: random.Random) -> str:
    return rng.choice(KEYS) if rng.random() < 0.8 else "".join(rng.choice("abc_-") for _ in range(6))


def junk_body(rng: random.Random, paths: list[str], valid: dict) -> tuple[bytes | None, dict]:
    """(raw body, headers): mutations of a valid body, then JSON of every type, then bytes that are not JSON."""
    roll = rng.random()
    if roll < 0.5:
        body = json.loads(json.dumps(valid))
        for _ in range(rng.randrange(1, 5)):
            target = rng.choice([body, body["config"], *(d for d in body["datasets"] if isinstance(d, dict))])
            if isinstance(target, dict):
                target[junk_key(rng)] = junk_value(rng, paths)
        if rng.random() < 0.2:
            body[rng.choice(["path", "config", "datasets", "command"])] = junk_value(rng, paths)
        content = json.dumps(body).encode()
    elif roll < 0.8:
        content = json.dumps(junk_value(rng, paths)).encode()
    else:
        content = rng.choice([b"", b"{", b"[" * 5000, b'{"path": NaN}', b'{"path": 1e999}', b"\xff\xfe\x00",
                              b'{"path": "x"' + b" " * 100, b'{"a":' * 200, b"null", b"9" * 5000,
                              bytes(rng.randrange(256) for _ in range(64))])
    headers = {"Content-Type": rng.choice(["application/json"] * 6 + ["text/plain", "application/json; charset=latin-1",
                                                                      "multipart/form-data", ""])}
    if rng.random() < 0.05:
        headers["Content-Length"] = rng.choice(["-1", "abc", "99999999999999", "0"])
    return content, headers


def route_table(app) -> list[tuple[str, str]]:
    """(method, path template) of every route the app has, read from the app itself."""
    table = []
    for route in app.routes:
        if isinstance(route, APIRoute):
            table += [(method, route.path) for method in sorted(route.methods)]
        elif isinstance(route, Mount):
            table.append(("GET", route.path + "/{path}"))
    return table


def fuzz(tmp_path: Path, monkeypatch, requests: int) -> dict[int, int]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    make_dataset(root / "images", count=2)
    write_config(root, root / "images")
    outside.mkdir()
    (outside / "secret.json").write_text("{}")
    os.mkfifo(root / "pipe.json")
    (root / "loop").symlink_to(root / "loop")
    monkeypatch.chdir(root)
    app = create_app([root], state_dir=tmp_path / "state")
    spawned = []

    def spawn(config_path, output_dir, *checked, **shown):  # a valid config may well come up: it is answered, not trained
        spawned.append(config_path)
        raise ApiError(409, "the fuzz starts nothing")

    monkeypatch.setattr(app.state.registry, "spawn", spawn)
    client = TestClient(app, raise_server_exceptions=False, base_url="http://localhost")
    rng = random.Random(SEED)
    paths = junk_paths(root, outside)
    valid = {"path": str(root / "config" / "config.json"),
             "config": json.loads((root / "config" / "config.json").read_text()),
             "datasets": json.loads((root / "config" / "multidatabackend.json").read_text())}
    routes = route_table(app)
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
    statuses: dict[int, int] = {}
    failures = []
    for n in range(requests):
        method, template = rng.choice(routes)
        if rng.random() < 0.1:
            method = rng.choice(methods)
        url = template.replace("{run_id}", rng.choice(["nope", "..", "20240101-000000-abcdef", "%00", "x" * 300,
                                                      "١٢٣", "a-b"]))
        url = url.replace("{path}", rng.choice(["app.js", "../server.py", "%2e%2e/x", "", "index.html"]))
        params = {rng.choice(["path", "files", "lines", "token", "x"]): str(junk_value(rng, paths))
                  for _ in range(rng.randrange(3))}
        content, headers = junk_body(rng, paths, valid) if method != "GET" or rng.random() < 0.1 else (None, {})
        if rng.random() < 0.03:
            headers["Host"] = rng.choice(["[::1", "evil.example", "127.0.0.1:99999", ""])
        try:
            r = client.request(method, url, params=params, content=content, headers=headers)
        except UnicodeEncodeError:  # a lone surrogate cannot even be put on the wire: not a request
            continue
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            failures.append((n, method, url, params, (content or b"")[:300], r.text[:300]))
        elif r.status_code >= 400:
            assert r.json().get("error"), (method, url, r.text[:200])
    assert not failures, f"{len(failures)} answers of 500 or more; the first: {failures[:3]}"
    assert all(Path(p).is_relative_to(root) for p in spawned), spawned
    assert not (outside / "out").exists() and sorted(p.name for p in outside.iterdir()) == ["secret.json"]
    assert sum(statuses.values()) >= requests * 0.95  # the fuzz really ran
    return statuses


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_fuzz_every_route_short(tmp_path, monkeypatch):
    statuses = fuzz(tmp_path, monkeypatch, 300)
    assert statuses.get(200) and sum(v for k, v in statuses.items() if 400 <= k < 500) > 100


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_fuzz_every_route_long(tmp_path, monkeypatch):
    statuses = fuzz(tmp_path, monkeypatch, 3000)
    print(f"fuzz: 3000 requests, statuses {dict(sorted(statuses.items()))}")
