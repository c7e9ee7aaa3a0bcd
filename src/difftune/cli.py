"""`difftune` command line: thin calls into config/, data/ and train/.

    difftune train [--config PATH | env=NAME] [--key value ...]
    difftune check [--config PATH | env=NAME] [--all] [--key value ...]
    difftune cache [--config PATH | env=NAME] [--key value ...]
    difftune plan  [--config PATH | env=NAME] [--gpu-memory GiB] [--processes N] [--key value ...]

env=NAME reads config/NAME/config.json (SimpleTuner's config environments: `simpletuner train env=NAME`).
    difftune demo  [--dir DIR]
    difftune server [--host 127.0.0.1] [--port 8001] [--root DIR ...] [--token TOKEN] [--state-dir DIR]
    difftune configure [PATH]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from difftune.config import ConfigError, RunConfig, TrainConfig, load_config

DEFAULT_CONFIG = "config/config.json"

# SimpleTuner's words before the options (`simpletuner train env=NAME --key value`)
_WORD = re.compile(r"(env|example|config_backend)=(.*)", re.DOTALL)


def parse_overrides(rest: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value`, or a bare `--flag` (true) -> {key: value}. Values stay strings: the
    config loader reads numbers and booleans from them ("0.0", "false") and blames a bad one on the
    command line. A key given twice is an error (the first would be dropped silently)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--"):
            if _WORD.fullmatch(token):
                raise ConfigError([f"command line: {token!r} comes after an option; write it first, before the "
                                   "--key value options"])
            raise ConfigError([f"command line: unexpected {token!r}; options are written --key value"])
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                value = rest[i + 1]
                i += 1
            else:
                _needs_value(key.lstrip("-"))
                value = "true"
        if not key:
            raise ConfigError([f"command line: {token!r} names no key; options are written --key value"])
        if key.lstrip("-") in out:
            raise ConfigError([f"command line: --{key.lstrip('-')} is given twice; keep one"])
        out[key.lstrip("-")] = value
        i += 1
    return out


def _needs_value(key: str) -> None:
    """A bare `--key` means true, which only an on/off key takes: `--output_dir --max_train_steps 3` set output_dir
    to 'true'. Keys the schema does not know are left to the loader's message."""
    import typing

    from difftune.config.compat import KEY_ALIASES

    info = TrainConfig.model_fields.get(KEY_ALIASES.get(key, key))
    if info is not None and bool not in (info.annotation, *typing.get_args(info.annotation)):
        raise ConfigError([f"command line: --{key} needs a value (a bare --flag means true, for on/off keys "
                           f"only); write --{key} VALUE"])


def config_environment(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """Read SimpleTuner's leading `env=NAME` (config/NAME/config.json; 'default' is config/config.json),
    `config_backend=json` (what difftune reads anyway) and refuse `example=` and the other backends, in words. Sets
    args.config (DEFAULT_CONFIG when neither --config nor env= names one); returns the options after the words."""
    words: dict[str, str] = {}
    while rest and (match := _WORD.fullmatch(rest[0])):
        word, value = match.groups()
        if word in words:
            raise ConfigError([f"command line: {word}= is given twice; keep one"])
        words[word] = value.strip()
        rest = rest[1:]
    if (example := words.get("example")) is not None:
        raise ConfigError([f"command line: example={example}: difftune bundles no example configs (SimpleTuner's "
                           f"`train example=` runs one of its own); put a config.json and its multidatabackend.json in "
                           f"config/{example or 'NAME'}/ and run `difftune {args.command} env={example or 'NAME'}`"])
    env = words.get("env")
    if env is not None:
        if not env:
            raise ConfigError(["command line: env= names no config environment; write env=NAME (config/NAME/config.json)"])
        if args.config is not None:
            raise ConfigError([f"command line: --config {args.config} and env={env} both name the config; keep one"])
        args.config = environment_config(env, "env=")
    elif args.config is None:  # SimpleTuner's loader reads these variables too (train.sh reads ENV)
        args.config = environment_variable_config()
    args.config = args.config or DEFAULT_CONFIG
    backend = words.get("config_backend", "json").lower()
    if backend in ("env", "toml"):
        from difftune.config.jsonfile import CONVERT

        raise ConfigError([f"command line: config_backend={backend}: {CONVERT} {args.config}"])
    if backend == "cmd":
        raise ConfigError(["command line: config_backend=cmd: give the settings in the config file, or as --key value "
                           f"after `difftune {args.command}` (they override the file's)"])
    if backend != "json":
        raise ConfigError([f"command line: config_backend={backend}: difftune reads JSON configs; remove it"])
    return rest


def environment_config(env: str, how: str) -> str:
    """The config of environment `env` as SimpleTuner finds it: 'default' is config/config.json; else `env` itself
    when it names a .json file, then env/config.json, then config/env/config.json (its usual place)."""
    if env == "default":
        return DEFAULT_CONFIG
    tried = ([Path(env)] if env.endswith(".json") else []) + [Path(env) / "config.json", Path("config") / env / "config.json"]
    found = next((p for p in tried if p.is_file()), None)
    if found is None:
        from difftune.config.jsonfile import CONVERT, sibling_config

        other = next((o for p in tried if (o := sibling_config(p)) is not None), None)  # SimpleTuner's TOML or ENV
        if other is not None:
            raise ConfigError([f"{how}{env}: {other} is there, but no config.json; {CONVERT} "
                               f"{other.with_suffix('.json')}"])
        raise ConfigError([f"{how}{env}: no config file at {' or '.join(map(str, dict.fromkeys(tried)))}; name a config "
                           "environment (config/NAME/config.json), or pass --config PATH"])
    return str(found)


ENV_VARIABLES = ("SIMPLETUNER_ENVIRONMENT", "SIMPLETUNER_ENV", "ENV")  # read by SimpleTuner's loader, in this order


def environment_variable_config() -> str | None:
    """The config a SimpleTuner environment variable names (None: none is set, or only `ENV` naming no config
    environment, which POSIX shells also use for their start-up file: then config/config.json, with a note)."""
    import os

    if path := os.environ.get("CONFIG_PATH", "").strip():  # SimpleTuner's JSON loader reads it first
        print(f"note: CONFIG_PATH={path}: reading it (pass --config to choose another)", file=sys.stderr)
        return path
    name = next((n for n in ENV_VARIABLES if os.environ.get(n, "").strip()), None)
    if name is None:
        return None
    value = os.environ[name].strip()
    if name == "ENV" and Path(value).is_file() and not value.endswith(".json"):  # a shell's start-up file (POSIX sh
        return None  # reads ENV), not a config
    try:
        found = environment_config(value, f"{name}=")
    except ConfigError:
        if name != "ENV":
            raise
        print(f"note: ENV={value} names no config environment (no config/{value}/config.json); reading "
              f"{DEFAULT_CONFIG}", file=sys.stderr)
        return None
    if found != DEFAULT_CONFIG:
        print(f"note: {name}={value}: reading {found} (pass --config to choose another)", file=sys.stderr)
    return found


def _load(args: argparse.Namespace, rest: list[str]) -> RunConfig:
    rest = config_environment(args, rest)
    launcher = Path(args.config).parent / "config.env"
    if launcher.is_file() and _main_process():  # SimpleTuner's loader and train.sh source it; nothing here reads it
        print(f"note: {launcher} is not read (SimpleTuner's launcher settings, such as TRAINING_NUM_PROCESSES and "
              f"MIXED_PRECISION): put training settings in {args.config}; for several processes run 'torchrun "
              f"--nproc_per_node N -m difftune.cli train --config {args.config}'", file=sys.stderr)
    return load_config(args.config, parse_overrides(rest))


def _check_blocks(cfg: Any) -> None:
    """A TREAD route, a CREPA or LayerSync block past the transformer's last block, a LyCORIS preset or
    lora_target_modules that match nothing, refused before any model loads as train refuses them."""
    from difftune.train import crepa, layersync, tread

    tread.check_before_load(cfg)
    crepa.check_before_load(cfg)
    layersync.check_before_load(cfg)
    if cfg.model_type == "lora" and cfg.lora_type == "lycoris":
        from difftune.adapters.lycoris import check_preset

        check_preset(cfg)
    from difftune.adapters.targets import check_targets

    check_targets(cfg)  # lora_target_modules that name no layer


def cmd_check(args: argparse.Namespace, rest: list[str]) -> int:
    run_cfg = _load(args, rest)
    quiet_libraries()  # the checks below import lycoris, torchao and transformers: their import-time notices
    from difftune.train.plan import DataError, check_data
    from difftune.train.run_lock import check_writable

    check_writable(Path(run_cfg.train.output_dir))  # as train does before any model loads
    _check_blocks(run_cfg.train)
    from difftune.train.hub import HubAccessError, login_missing

    if (problem := login_missing(run_cfg.train)) is not None:  # train asks the hub itself; check stays offline
        raise HubAccessError(problem)

    try:
        report = check_data(run_cfg, args.all)  # discovery and training's bucket plan (WORLD_SIZE processes, else 1)
    except DataError:
        for note in run_cfg.notes():  # the config's notes still hold, and may explain the data error
            print(f"note: {note}")
        raise
    print(report)
    for note in run_cfg.notes():
        print(f"note: {note}")
    print(f"{args.config}: OK ({run_cfg.train.model_family}, {run_cfg.train.flavour()}{', ' + run_cfg.train.model_source() if run_cfg.train.model_source() else ''})")
    return 0


# Third-party lines that say nothing a difftune user can act on, dropped from the console:
# transformers' notice that its image processors fall back to PIL without torchvision (difftune never
# needs torchvision), and bitsandbytes' CPU notice about an optional kernel download (4-bit CPU kernels,
# which difftune does not use; this machine reaches no kernel hub anyway). torchao, imported by diffusers
# whenever it is installed: its CUDA-only kernel libraries that a CPU build of torch cannot load, torch's
# notice about its enum registrations, and diffusers' notice about torchao checkpoint classes (difftune
# quantizes after loading and never loads torchao checkpoints).
NOISE = ("requires torchvision (not installed)", "kernels-community", "/torchao/_C",
         "is an Enum subclass and is now natively supported by torch.compile", "Unable to import `torchao`")
NOISY_LOGGERS = ("bitsandbytes", "bitsandbytes.backends.cpu.ops", "torchao", "torch.utils._pytree",
                 "diffusers.quantizers.torchao.torchao_quantizer")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in NOISE)


def quiet_libraries() -> None:
    """The hub libraries draw a progress bar per component load; ours is the one that matters. Their
    import-time notices that do not concern the user are filtered (see NOISE); every other warning stays."""
    noise = _DropNoise()
    for name in NOISY_LOGGERS:  # before the imports below, which may import torchao
        logging.getLogger(name).addFilter(noise)
    from transformers.utils import logging as transformers_logging

    for handler in transformers_logging._get_library_root_logger().handlers:
        handler.addFilter(noise)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def result_line(cfg: TrainConfig, path: Path) -> str:
    """What was saved, in the words of what was trained."""
    if cfg.model_type == "full":
        return f"model saved to {path} (a diffusers transformer folder)"
    kind = "LyCORIS" if cfg.lora_type == "lycoris" else "LoRA"
    comfyui = path.with_name("comfyui_lora.safetensors")
    beside = f", and for ComfyUI to {comfyui}" if cfg.lora_format == "comfyui" and comfyui.exists() else ""
    return f"{kind} saved to {path}{beside}"


def end_processes() -> None:
    """Several processes: leave the process group once every one has finished. Left to the interpreter's exit,
    gloo's worker threads can outlive it and abort the process (SIGABRT, "terminate called without an active
    exception") after the run succeeded: torchrun then reports the run as failed."""
    import time

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # A gloo worker thread drops each finished collective (the last barrier's), whose tensors it can only let go
        # with the GIL. The process group's destructor, which runs with the GIL held when the DDP model is freed,
        # joins that thread: if the main thread got here first, both waited forever, a finished run that never
        # exited (py-spy: ~ProcessGroupGloo in std::thread::join, the worker in gil_scoped_acquire; seen in CI on a
        # loaded machine). Waiting a moment without the GIL lets the worker finish first.
        time.sleep(0.5)
        dist.destroy_process_group()


def resume_hint(output_dir: Path) -> str:
    """What a stopped `difftune train` leaves to go on from: its last checkpoint, or (stopped while it cached,
    before a step was trained) the cache entries written so far."""
    from difftune.train.checkpoint import find_latest

    latest = find_latest(output_dir)
    if latest is None:
        return "no checkpoint was written yet; the cache entries written so far are kept, and the next run reuses them"
    return f"the last checkpoint ({latest.name}) can be resumed with resume_from_checkpoint latest"


def _launched() -> None:
    """WORLD_SIZE above 1 without a launcher's rendezvous (an `export WORLD_SIZE=4` kept from `difftune check`):
    accelerate failed with 'MASTER_ADDR env was not set' after the config was read."""
    import os

    from difftune.config.resume_check import world_size

    if world_size() > 1 and "MASTER_ADDR" not in os.environ:
        raise ConfigError([f"WORLD_SIZE is {world_size()}, but this process was not started by torchrun or "
                           "accelerate launch (MASTER_ADDR is not set): unset WORLD_SIZE to train as one process, or "
                           f"launch torchrun --nproc_per_node {world_size()} -m difftune.cli train ..."])


def _main_process() -> bool:
    """Process 0 of a launch (or the only one): the one that prints what the run did. The others say nothing but
    errors, so a torchrun console reads as one run."""
    import os

    return os.environ.get("RANK", "0") in ("0", "")


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    run_cfg = _load(args, rest)
    _launched()
    from difftune.train.run_lock import (
        OutputDirInUse,
        Terminated,
        check_writable,
        output_dir_lock,
        sigterm_stops,
    )

    check_writable(Path(run_cfg.train.output_dir))

    # SIGTERM stops like Ctrl-C (an interrupted checkpoint); a second run into the same output_dir is refused
    # before any model loads (train/run_lock.py)
    try:
        with sigterm_stops(), output_dir_lock(Path(run_cfg.train.output_dir)):
            quiet_libraries()
            for note in run_cfg.notes() if _main_process() else []:
                print(f"note: {note}")
            from difftune.train.loop import train
            from difftune.train.setup import build_run

            run = build_run(run_cfg)
            result = train(run)
            end_processes()
    except OutputDirInUse as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        reason, signum = (e.reason, e.signum) if isinstance(e, Terminated) else ("interrupted", signal.SIGINT)
        if _main_process():  # another: stopped by torchrun when process 0 failed, maybe before its run began
            print(f"{reason}; {resume_hint(Path(run_cfg.train.output_dir))}", file=sys.stderr)
        return 128 + signum  # the shell's status for a process ended by that signal
    if not _main_process():
        return 0
    print(result_line(run_cfg.train, result))
    written = [p for p in (run.output_dir / "validation").glob("*") if p.suffix in (".png", ".mp4")]
    if run.validation and written:
        print(f"validation samples in {run.output_dir / 'validation'}")
    from difftune.train.hub import HUB_UPLOAD_FAILED, result_failure

    if failure := result_failure(run):  # push_to_hub: last, so neither a reader nor a script takes it as published
        print(f"error: {failure}", file=sys.stderr)
        return HUB_UPLOAD_FAILED
    return 0


PLAN_DOES_NOT_FIT = 3  # `difftune plan --gpu-memory`: exit status when no set of levers fits


def cmd_plan(args: argparse.Namespace, rest: list[str]) -> int:
    """Predicted peak accelerator memory per phase; with --gpu-memory, the cheapest levers that fit (exit 0),
    or exit 3 when nothing fits."""
    run_cfg = _load(args, rest)
    quiet_libraries()
    _check_blocks(run_cfg.train)
    from difftune.config.resume_check import world_size
    from difftune.memory_plan.levers import choose, reserve_for
    from difftune.memory_plan.predict import predict
    from difftune.memory_plan.render import render
    from difftune.train.plan import discover_all

    processes = args.processes or world_size()  # as `difftune check`: WORLD_SIZE when --processes is not given
    found = discover_all(run_cfg, processes=processes, given="--processes" if args.processes else None)
    try:
        prediction = predict(run_cfg.train, found, processes)
        choice = None
        if args.gpu_memory is not None:
            choice = choose(run_cfg.train, found, args.gpu_memory, processes, prediction,
                            reserve_for(args.gpu_memory))
    except ValueError as e:  # e.g. an architecture without a config or coefficients: said, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in run_cfg.notes():  # as check says them: an override that changes nothing, a key not used
        print(f"note: {note}")
    render(prediction, choice)
    return PLAN_DOES_NOT_FIT if choice is not None and not choice.fits else 0


def cmd_cache(args: argparse.Namespace, rest: list[str]) -> int:
    """Fill every cache (text embeddings, latents, metadata) without training."""
    from difftune.config.resume_check import world_size

    if world_size() > 1:  # each torchrun worker would fill every cache on its own, twice the work and the logs
        raise ConfigError([f"difftune cache runs as one process, not {world_size()} (WORLD_SIZE): start it without "
                           "torchrun or accelerate launch; `torchrun ... -m difftune.cli train` splits its caching "
                           "between the processes"])
    run_cfg = _load(args, rest)
    quiet_libraries()
    for note in run_cfg.notes():
        print(f"note: {note}")
    import torch

    from difftune.train.plan import cache_everything

    if ondemand := cache_everything(run_cfg):
        print(f"vae_cache_ondemand ({', '.join(map(repr, ondemand))}): difftune cache encodes every latent now; "
              "training then reads them all from the cache")
    from difftune.train.events import Events
    from difftune.train.run_lock import (
        OutputDirInUse,
        Terminated,
        check_writable,
        output_dir_lock,
        sigterm_stops,
    )
    from difftune.train.setup import prepare_data

    output_dir = Path(run_cfg.train.output_dir)
    check_writable(output_dir)
    events = Events(output_dir / "events.jsonl")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        # as Ctrl-C: every cache entry is written whole (temp file + rename); the lock: not into a training run's
        # output_dir (its events.jsonl would get this command's events)
        with sigterm_stops(), output_dir_lock(output_dir):
            prepared = prepare_data(run_cfg, events, device)
    except OutputDirInUse as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        reason, signum = (e.reason, e.signum) if isinstance(e, Terminated) else ("interrupted", signal.SIGINT)
        events.emit("stopped", quiet=True, step=0, stage="cache", reason=reason)
        print(f"{reason}; the caches written so far are kept and reused", file=sys.stderr)
        return 128 + signum
    finally:
        events.close()
    print(f"caches complete: {len(prepared.data.items)} training items")
    return 0


def cmd_demo(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:  # the demo's settings are fixed: an override would be silently ignored
        raise ConfigError([f"command line: unexpected {' '.join(rest)!r} for difftune demo (it takes only --dir); "
                           "to train with other settings, edit the demo's config.json and run difftune train "
                           "--config on it"])
    from difftune.demo import run_demo

    quiet_libraries()
    run_demo(Path(args.dir))
    return 0


def cmd_server(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise ConfigError([f"command line: unexpected {' '.join(rest)!r} for difftune server"])
    from difftune.ui.server import serve

    serve(args.host, args.port, args.root or None, args.token, args.state_dir)
    return 0


def cmd_configure(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise ConfigError([f"command line: unexpected {' '.join(rest)!r} for difftune configure"])
    quiet_libraries()  # the memory step imports the planner, and with it torchao's and the hubs' notices
    from difftune.ui.wizard import run_wizard

    path = args.path
    if path is not None and (match := _WORD.fullmatch(path)) is not None:  # SimpleTuner's words, as train takes them
        word, value = match.groups()
        if word != "env" or not value.strip():
            raise ConfigError([f"command line: {path!r}: difftune configure takes a config file or env=NAME"])
        value = value.strip()
        try:  # an existing environment as train finds it; else a new config/NAME/config.json
            path = environment_config(value, "env=")
        except ConfigError:
            path = str(Path("config") / value / "config.json")
    return run_wizard(path)


def _positive(kind: type) -> Any:
    """An argparse type: a finite number above 0 (argparse prints the message as a usage error)."""
    import math

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: give a number above 0")
        return value

    return parse


OVERRIDES_HELP = ("Any config.json key may follow as --key value (or --key=value, or --flag for true), overriding the "
                  "file's: difftune train --learning_rate 5e-5 --max_train_steps 500. env=NAME (first) reads "
                  "config/NAME/config.json, as SimpleTuner's environments.")


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 (a Latin-1 'café.png') is printed, not fatal
        try:
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            pass  # a stream without it (a test's capture)
    parser = argparse.ArgumentParser(prog="difftune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("train", "train a model"), ("check", "validate a config and its datasets"),
                           ("cache", "fill the text and latent caches without training")):
        p = sub.add_parser(name, help=helptext, epilog=OVERRIDES_HELP)
        p.add_argument("--config", default=None, help=f"config file (default {DEFAULT_CONFIG}; env=NAME: "
                                                       "config/NAME/config.json)")
    sub.choices["check"].add_argument("--all", action="store_true",
                                      help="list every left-out file and note (the report shows 20 of each)")
    plan = sub.add_parser("plan", help="predict peak accelerator memory; --gpu-memory picks levers that fit "
                                       f"(exit {PLAN_DOES_NOT_FIT} when nothing fits)", epilog=OVERRIDES_HELP)
    plan.add_argument("--config", default=None, help=f"config file (default {DEFAULT_CONFIG}; env=NAME: "
                                                     "config/NAME/config.json)")
    plan.add_argument("--gpu-memory", type=_positive(float), default=None, metavar="GiB",
                      help="accelerator memory to fit, in GiB (e.g. 24)")
    plan.add_argument("--processes", type=_positive(int), default=None, metavar="N",
                      help="processes (GPUs) the run will use (default: WORLD_SIZE, else 1); FSDP divides the "
                           "weights between them")
    demo = sub.add_parser("demo", help="train a LoRA on a tiny model and generated data (a minute or two on CPU)")
    demo.add_argument("--dir", default="demo", help="where the demo's data, config and outputs go")
    server = sub.add_parser("server", help="web UI: set runs up, start, watch and stop them (http://127.0.0.1:8001)")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (beyond loopback needs a token)")
    server.add_argument("--port", type=int, default=8001)
    server.add_argument("--root", action="append", help="folder the UI may read and write (repeatable; default .)")
    server.add_argument("--token", default=None, help="access token (default: generated when --host is not loopback)")
    server.add_argument("--state-dir", default=None, help="where the run registry lives (default $DIFFTUNE_HOME/ui)")
    configure = sub.add_parser("configure", help="terminal wizard that writes config.json and its dataset list")
    configure.add_argument("path", nargs="?", default=None, help=f"config to edit (default: new {DEFAULT_CONFIG})")
    args, rest = parser.parse_known_args(argv)
    handler = {"train": cmd_train, "check": cmd_check, "plan": cmd_plan, "cache": cmd_cache, "demo": cmd_demo,
               "server": cmd_server, "configure": cmd_configure}[args.command]
    try:
        return handler(args, rest)
    except ConfigError as e:
        _error(e, everywhere=True)
        return 2
    except Exception as e:
        from difftune.data.batches import NoUsableItem
        from difftune.data.cache import CacheWriteError
        from difftune.models.hub import ComponentError
        from difftune.train.checkpoint import CheckpointError, WriteError
        from difftune.train.hub import HubAccessError
        from difftune.train.plan import DataError
        from difftune.train.run_lock import NotWritable
        from difftune.train.trackers import TrackerError

        if _peer_gone(e):  # process 0 stopped (its error is said above): the others' gloo tracebacks hid it
            print(f"error (process {os.environ.get('RANK')}): lost contact with the other processes ({_first_line(e)}); "
                  "the process that stopped first says why", file=sys.stderr)
            return 1
        if not isinstance(e, DataError | ComponentError | CheckpointError | HubAccessError | CacheWriteError
                          | TrackerError | WriteError | NotWritable | NoUsableItem):
            raise
        # met alike by every process: the same files read, or a collective write (FSDP's sharded checkpoint)
        _error(e, everywhere=isinstance(e, DataError | CheckpointError | WriteError | ComponentError | HubAccessError))
        return 2
    except KeyboardInterrupt:  # train and cache say what is kept; check, plan, configure have nothing to keep
        print("interrupted", file=sys.stderr)
        return 130


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's, and NCCL's socket's


def _peer_gone(e: BaseException) -> bool:
    """A process other than 0 of a launch that failed in a collective because another process is gone."""
    several = os.environ.get("WORLD_SIZE", "1") not in ("1", "")
    return several and not _main_process() and isinstance(e, RuntimeError) and any(m in str(e) for m in PEER_GONE)


def _first_line(e: BaseException) -> str:
    line = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
    return line if len(line) <= 160 else line[:157] + "..."


def _error(e: BaseException, everywhere: bool) -> None:
    """The `error:` line. Under torchrun, an error every process meets alike (the config, the data, a checkpoint:
    the same files) is said by process 0 alone: N copies interleaved in one console read as one garbled line.
    Another process's own error is said with its number."""
    import os

    several = os.environ.get("WORLD_SIZE", "1") not in ("1", "")  # a launcher that sets RANK alone: said as ever
    if _main_process() or not several:
        print(f"error: {e}", file=sys.stderr)
    elif not everywhere:
        print(f"error (process {os.environ.get('RANK')}): {e}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
