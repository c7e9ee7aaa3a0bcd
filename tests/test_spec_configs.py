"""The specs as a test suite: every config block of ../shared/spec/*.txt, verbatim, through `load_config`
and two training steps on the tiny models.

The blocks are fixtures in tests/spec_blocks/ (written by tests/spec_blocks/extract.py); manifest.json
says, for each, how it is combined and what is expected of it:

- `expect: "trains"`: `load_config` accepts it, every key reaches the config unchanged, and it trains two
  steps (and validates, when it has validation keys) with a finite loss and a saved result.
- `expect: "refused"`: `load_config` raises a ConfigError whose every problem says "not implemented yet"
  and names one of `refused_keys`, and all of them are named. The block with those keys removed then
  trains (unless nothing of it is left but the base config, which the other blocks already train).
- `xfail`: a bug (a crash, a wrong error); the block's test is a strict xfail with that reason.

When a feature lands, the block's test fails until its manifest entry is updated: that is intended.

Only these are swapped (`swap_config`, `swap_datasets`): the model source (the family's tiny random
model, and a tiny random CLIP for `evaluation_type: clip`), absolute paths (made relative: each block runs in its own temporary folder, so the relative data,
cache, output and prompt-library paths the specs write are kept as written), step counts and intervals,
validation sizes, frames and inference steps, and dataset sizes (divided by 16: 1024 px -> 64 px) and
frame counts. `mixed_precision` stays as written (difftune's default, bf16, where a block does not set it).
The network is replaced at its edges: W&B runs offline, and the hub client's uploads are recorded
(`offline_services`).
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from difftune.config import ConfigError, load_config
from difftune.config.problems import split_problem
from difftune.config.schema import TrainConfig

HERE = Path(__file__).resolve().parent
BLOCKS = HERE / "spec_blocks"
MANIFEST = json.loads((BLOCKS / "manifest.json").read_text(encoding="utf-8"))
ENTRIES = {e["id"]: e for e in MANIFEST["blocks"]}
TESTED = [e for e in MANIFEST["blocks"] if e["file"]]
SPEC_DIR = HERE.parents[1] / "shared" / "spec"

STEPS = 2
VALIDATION_SIZE = "32x32"
SIZE_DIVISOR = 16  # dataset sizes in pixels: 1024 -> 64
TRAIN_FRAMES = 5
VALIDATION_FRAMES = {"t2v": 5, "i2v": 17}  # the stock I2V pipeline needs 17 (load.check_i2v_validation)
INTERVAL_KEYS = ("checkpoint_step_interval", "validation_step_interval", "eval_steps_interval")
PATH_KEYS = ("output_dir", "data_backend_config", "user_prompt_library", "lycoris_config")
DATASET_SIZE_KEYS = ("resolution", "minimum_image_size", "maximum_image_size", "target_downsample_size")
DATASET_PATH_KEYS = ("instance_data_dir", "cache_dir", "cache_dir_vae")
VALIDATION_KEYS = ("validation_prompt", "user_prompt_library")

RESULTS: dict[str, str] = {}  # block id -> outcome, for the summary line
REFUSED_BY: Counter[str] = Counter()


# --- reading the fixtures ----------------------------------------------------------------------------


def block_value(block_id: str) -> Any:
    """A block's JSON value; a fragment (key-value lines without braces) is read as its object."""
    text = (BLOCKS / ENTRIES[block_id]["file"]).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads("{" + text.strip().rstrip(",") + "}")


def clean(key: str) -> str:
    return key.lstrip("-")  # the specs write some config keys as "--key"; the loader takes both


# --- the swaps -----------------------------------------------------------------------------------------


def relative(path: str) -> str:
    return path.lstrip("/") if path.startswith("/") else path


def swap_config(config: dict[str, Any], family: str, flavour: str) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if clean(k) != "pretrained_model_name_or_path"}
    out["model_flavour"] = flavour
    out["max_train_steps"] = STEPS
    if out.get("evaluation_type") == "clip":  # the hub's CLIP cannot be downloaded here
        from difftune.models.tiny_clip import tiny_clip

        out["evaluation_clip_model"] = str(tiny_clip())
    for key in list(out):
        name = clean(key)
        if name in INTERVAL_KEYS and isinstance(out[key], int) and out[key] > 0:
            out[key] = STEPS  # due once, at the last step
        elif name in PATH_KEYS and isinstance(out[key], str):
            out[key] = relative(out[key])
    names = {clean(k) for k in out}
    if names & set(VALIDATION_KEYS):
        out["validation_resolution"] = VALIDATION_SIZE
        out["validation_num_inference_steps"] = 1
        if family == "kandinsky5-video":
            out["validation_num_video_frames"] = VALIDATION_FRAMES["i2v" if flavour.endswith("i2v") else "t2v"]
    return out


def swap_datasets(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for entry in entries:
        entry = json.loads(json.dumps(entry))
        if entry.get("resolution_type", "pixel") != "area":
            for key in DATASET_SIZE_KEYS:
                if isinstance(entry.get(key), int | float) and entry[key] > 64:
                    entry[key] = int(entry[key] // SIZE_DIVISOR)
        for key in DATASET_PATH_KEYS:
            if isinstance(entry.get(key), str):
                entry[key] = relative(entry[key])
        video = entry.get("video")
        if isinstance(video, dict):
            for key in ("num_frames", "min_frames", "max_frames"):
                if isinstance(video.get(key), int) and video[key] > TRAIN_FRAMES:
                    video[key] = TRAIN_FRAMES
        out.append(entry)
    return out


# --- one combination: config + datasets (+ prompt library), materialised in a folder -----------------


def tiny_flavour(combine: dict[str, Any]) -> str:
    return combine.get("flavour", "tiny-random")


def combination(block_id: str) -> dict[str, Any]:
    """What runs for `block_id`: {config, datasets, prompts (path -> library), config_block, datasets_block}."""
    entry = ENTRIES[block_id]
    combine = entry.get("combine", {})
    if entry["kind"] == "prompts":
        return combination(combine["with"])  # a prompt library runs with the config block that names it
    family = entry["family"]
    base = dict(MANIFEST["base_configs"][family])
    if entry["kind"] == "config":
        block = block_value(block_id)
        config = block if combine.get("base") is None else {**base, **combine.get("add", {}), **block}
        datasets_id = combine.get("datasets")
        datasets = block_value(datasets_id) if datasets_id else MANIFEST["minimal_datasets"][family]
    elif entry["kind"] == "datasets":
        block = None
        config, datasets = {**base, **combine.get("add", {})}, block_value(block_id)
    else:
        raise AssertionError(f"{block_id}: kind {entry['kind']!r} has no runner yet")
    datasets = list(datasets) + combine.get("extra_datasets", [])
    prompts = {}
    if combine.get("prompts"):
        library = next(v for k, v in config.items() if clean(k) == "user_prompt_library")
        prompts[library] = block_value(combine["prompts"])
    return {"family": family, "flavour": tiny_flavour(combine), "config": config, "datasets": datasets,
            "prompts": prompts, "block": block}


def materialise(combo: dict[str, Any], root: Path, media: dict[str, Path]) -> Path:
    """Write config.json, the dataset list and the prompt library under `root` (the working folder);
    fill each dataset's folder with generated images or clips. Returns the config path."""
    config = swap_config(combo["config"], combo["family"], combo["flavour"])
    datasets = swap_datasets(combo["datasets"])
    backend = next((v for k, v in config.items() if clean(k) == "data_backend_config"), None)
    if backend is None:
        backend = config["data_backend_config"] = "config/multidatabackend.json"
    for path, value in [(backend, datasets), *combo["prompts"].items()]:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(json.dumps(value, indent=1), encoding="utf-8")
    for entry in datasets:
        folder = entry.get("instance_data_dir")
        if folder and not (root / folder).exists():
            kind = "clips" if entry.get("dataset_type") == "video" else "images"
            shutil.copytree(media[kind], root / folder)
    path = root / "config" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    return path


# --- running ------------------------------------------------------------------------------------------


def events(output_dir: Path) -> list[dict[str, Any]]:
    lines = (output_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def train_two_steps(path: Path) -> dict[str, Any]:
    from difftune.train.loop import train
    from difftune.train.setup import build_run

    run_cfg = load_config(path)
    adapter = train(build_run(run_cfg))
    log = events(Path(run_cfg.train.output_dir))
    done = [e for e in log if e["event"] == "done"]
    samples = [str(Path(p).resolve()) for p in done[-1]["samples"]] if done else None
    cfg = run_cfg.train
    return {"steps": {e["step"]: e["loss"] for e in log if e["event"] == "step"},
            "adapter": str(Path(adapter).resolve()), "samples": samples, "validates": bool(cfg.validation_prompts()),
            # what the tracker, evaluation and hub keys did (checked in check_trained when the block sets them)
            "evaluates": cfg.evaluation_type == "clip", "evaluations": [e["step"] for e in log if e["event"] == "evaluation"],
            "uploads": cfg.push_to_hub, "uploaded": [e["what"] for e in log if e["event"] == "hub_upload"],
            "trackers": cfg.report_to, "wandb_runs": len(list(Path(cfg.output_dir).glob("wandb/offline-run-*"))),
            "tensorboard": len(list(Path(cfg.output_dir).glob("tensorboard/*/events.out.tfevents.*")))}


_RUNS: dict[str, Any] = {}  # identical combinations (the three Kandinsky 5 Image guides) train once


def run_once(key: str, path: Path) -> dict[str, Any]:
    if key not in _RUNS:
        try:
            _RUNS[key] = train_two_steps(path)
        except BaseException as e:  # noqa: BLE001 - replayed below for every block of this combination
            _RUNS[key] = e
    if isinstance(_RUNS[key], BaseException):
        raise _RUNS[key]
    return _RUNS[key]


def check_trained(result: dict[str, Any]) -> None:
    assert sorted(result["steps"]) == list(range(1, STEPS + 1)), result["steps"]
    assert all(math.isfinite(loss) for loss in result["steps"].values()), result["steps"]
    assert Path(result["adapter"]).exists()
    assert result["samples"] is not None, "no 'done' event"
    if result["validates"]:
        assert result["samples"], "validation keys were given, but no sample was written"
        assert all(Path(p).exists() for p in result["samples"])
    else:
        assert result["samples"] == []
    if result["evaluates"]:
        assert result["evaluations"], "evaluation_type clip, but no evaluation event"
    if result["uploads"]:
        assert result["uploaded"] and result["uploaded"][-1].startswith("result"), result["uploaded"]
    if result["trackers"] in ("wandb", "all"):
        assert result["wandb_runs"] == 1
    if result["trackers"] in ("tensorboard", "all"):
        assert result["tensorboard"] >= 1


def same(expected: Any, actual: Any) -> bool:
    """The value a block gives == what the config holds (nested models compared key by key)."""
    if isinstance(actual, BaseModel) and isinstance(expected, dict):
        return all(same(v, getattr(actual, clean(k))) for k, v in expected.items())
    if isinstance(actual, list) and isinstance(expected, list):  # a list of nested models (tread_config.routes)
        return len(actual) == len(expected) and all(same(e, a) for e, a in zip(expected, actual, strict=True))
    return expected == actual


def check_keys_arrived(combo: dict[str, Any], path: Path) -> None:
    """Nothing silently dropped or coerced: every key of the (swapped) block is in the loaded config (a
    `{model_family}` placeholder filled in)."""
    run_cfg = load_config(path)
    family = run_cfg.train.model_family
    config = json.loads(path.read_text(encoding="utf-8").replace("{model_family}", family))
    for key, value in config.items():
        if clean(key) in TrainConfig.model_fields:
            assert same(value, getattr(run_cfg.train, clean(key))), key
    backend = Path(run_cfg.train.data_backend_config)
    loaded = {d.id: d for d in [*run_cfg.datasets.images, *run_cfg.datasets.validation_only.values(),
                                *run_cfg.datasets.all_text_embeds.values()]}
    for entry in json.loads(backend.read_text(encoding="utf-8").replace("{model_family}", family)):
        if entry.get("disabled"):
            continue
        dataset = loaded[entry["id"]]
        for key, value in entry.items():
            assert same(value, getattr(dataset, clean(key))), f"{entry['id']}.{key}"


def difftune_check(path: Path, capsys) -> tuple[int, str]:
    """`difftune check --config PATH`, as a user runs it: (exit status, its output)."""
    from difftune.cli import main

    capsys.readouterr()
    status = main(["check", "--config", str(path)])
    out = capsys.readouterr()
    return status, out.out + out.err


def check_refused(block_id: str, keys: list[str], path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problems = info.value.problems
    backend = json.loads(path.read_text(encoding="utf-8")).get("data_backend_config", "")
    named = set()
    for problem in problems:
        assert "not implemented yet" in problem, f"{block_id}: a problem other than 'not implemented yet': {problem}"
        key = split_problem(problem, (str(path), backend)).key
        assert key in keys, f"{block_id}: refused key {key!r} is not in the manifest's refused_keys: {problem}"
        named.add(key)
    assert named == set(keys), f"{block_id}: expected refusals of {sorted(keys)}, got {sorted(named)}"


# --- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def spec_media(tmp_path_factory) -> dict[str, Path]:
    """One generated image folder and one clip folder, copied into every block's data folders."""
    from difftune.data.video import synthetic_clip
    from difftune.demo import make_dataset

    root = tmp_path_factory.mktemp("spec-media")
    make_dataset(root / "images", count=4, size=(64, 64))
    (root / "clips").mkdir()
    for i in range(2):  # 12 frames, 32x24, 24 fps: a moving square
        synthetic_clip(root / "clips" / f"clip{i}.mp4", frames=12, seed=i)
        (root / "clips" / f"clip{i}.txt").write_text(f"a moving square number {i}")
    return {"images": root / "images", "clips": root / "clips"}


@pytest.fixture(autouse=True)
def offline_services(monkeypatch):
    """W&B offline; the hub client's create_repo and upload_folder record their calls instead of uploading."""
    from huggingface_hub import HfApi

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    calls: list[tuple[str, dict[str, Any]]] = []
    # push_to_hub logs in (whoami) before any model loads: a user with a write token (`check` looks for it offline)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_a_logged_in_user")
    monkeypatch.setattr(HfApi, "whoami", lambda self, *a, **k: {"name": "me", "auth": {"accessToken": {"role": "write"}}})
    monkeypatch.setattr(HfApi, "create_repo", lambda self, *a, **k: calls.append(("create_repo", k)))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, *a, **k: calls.append(("upload_folder", k)))
    return calls


@pytest.fixture(scope="module", autouse=True)
def summary(request):
    """Prints the module's count line once its last test has run."""
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not RESULTS:
        return
    outcomes = Counter(v.split(":")[0] for v in RESULTS.values())
    keys = ", ".join(f"{k} x{n}" for k, n in sorted(REFUSED_BY.items()))
    others = sum(1 for e in MANIFEST["blocks"] if not e["file"])
    xfails = sum(1 for e in TESTED if e.get("xfail"))
    line = (
        f"spec blocks: {len(TESTED)} total, {outcomes['trains']} run verbatim, {outcomes['refused']} refused as "
        f"not implemented yet (keys: {keys or 'none'}), {xfails} xfail (bugs), "
        f"{outcomes['stripped']} refused blocks train once their refused keys are removed; "
        f"{others} shell blocks are not config (install, login, a train command without flags)"
    )
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line(line)


# --- the tests ----------------------------------------------------------------------------------------


def marks(entry: dict[str, Any], field: str = "xfail") -> list:
    reason = entry.get(field)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


@pytest.mark.parametrize("block_id", [pytest.param(e["id"], marks=marks(e)) for e in TESTED])
def test_spec_block(block_id, tmp_path, monkeypatch, spec_media, capsys):
    entry = ENTRIES[block_id]
    expect = entry["expect"]
    combo = combination(block_id)
    monkeypatch.chdir(tmp_path)
    path = materialise(combo, tmp_path, spec_media)
    status, output = difftune_check(path, capsys)
    if expect == "refused":
        check_refused(block_id, entry["refused_keys"], path)
        assert status == 2 and "not implemented yet" in output, output
        RESULTS[block_id] = "refused"
        REFUSED_BY.update(entry["refused_keys"])
        return
    assert expect == "trains", f"{block_id}: expect must be 'trains' or 'refused'"
    assert status == 0, output
    check_keys_arrived(combo, path)
    key = json.dumps([combo["config"], combo["datasets"], combo["prompts"], combo["flavour"]], sort_keys=True)
    check_trained(run_once(key, path))
    RESULTS[block_id] = "trains"


def stripped_cases() -> list:
    """Refused blocks that keep something once the refused keys are gone (else they are the base config,
    which the dataset blocks' tests already train)."""
    cases = []
    for e in TESTED:
        if e.get("expect") != "refused":
            continue
        block = block_value(e["id"])
        if isinstance(block, dict) and {clean(k) for k in block} - set(e["refused_keys"]):
            cases.append(pytest.param(e["id"], marks=marks(e, "stripped_xfail")))
    return cases


@pytest.mark.parametrize("block_id", stripped_cases())
def test_refused_block_trains_without_its_refused_keys(block_id, tmp_path, monkeypatch, spec_media, capsys):
    """The user's way round a refusal: remove the keys named, keep the rest as written."""
    entry = ENTRIES[block_id]
    combo = combination(block_id)
    refused = set(entry["refused_keys"])
    combo["config"] = {k: v for k, v in combo["config"].items() if clean(k) not in refused}
    monkeypatch.chdir(tmp_path)
    path = materialise(combo, tmp_path, spec_media)
    status, output = difftune_check(path, capsys)
    assert status == 0, output
    check_keys_arrived(combo, path)
    key = json.dumps([combo["config"], combo["datasets"], combo["prompts"], combo["flavour"]], sort_keys=True)
    check_trained(run_once(key, path))
    RESULTS[f"{block_id}:stripped"] = "stripped"


def test_manifest_covers_every_block():
    for e in TESTED:
        assert e.get("expect") in ("trains", "refused"), f"{e['id']}: no expectation in manifest.json"
        if e["expect"] == "refused":
            assert e.get("refused_keys"), f"{e['id']}: refused without refused_keys"
        assert (BLOCKS / e["file"]).exists(), e["file"]


@pytest.mark.skipif(not SPEC_DIR.is_dir(), reason=f"{SPEC_DIR} is not here to compare with")
def test_fixtures_equal_the_specs():
    """tests/spec_blocks/ is what extract.py takes from the specs today (rerun it with --write if not)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("spec_extract", BLOCKS / "extract.py")
    extract = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = extract  # dataclasses look their module up there
    spec.loader.exec_module(extract)
    assert extract.differences(extract.extract(SPEC_DIR)) == []
