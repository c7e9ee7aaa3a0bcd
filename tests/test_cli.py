"""The command line's own words (difftune/cli.py)."""

import json
import re

import pytest

from conftest import write_config
from difftune.cli import main


def test_check_names_the_flavour_it_will_train(tmp_path, dataset, capsys):
    """`difftune check`'s OK line names the flavour in use (it said 'tiny-random' for every tiny flavour), and the
    model source where the flavour has one."""
    from families import make_pairs

    make_pairs(dataset, tmp_path / "inputs")
    i2i = write_config(tmp_path / "i2i", dataset, model_family="kandinsky5-image", model_flavour="tiny-random-i2i",
                       conditioning_dir=tmp_path / "inputs", dataset={"conditioning_data": "inputs"})
    assert main(["check", "--config", str(i2i)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{i2i}: OK (kandinsky5-image, tiny-random-i2i)"
    real = write_config(tmp_path / "real", dataset, model_flavour=None)  # lumina2's default flavour: a hub id
    assert main(["check", "--config", str(real)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{real}: OK (lumina2, 2.0, Alpha-VLLM/Lumina-Image-2.0)"


@pytest.mark.parametrize("command", ["cache", "train"])
def test_ctrl_c_while_caching_says_what_is_kept(tmp_path, dataset, monkeypatch, capsys, command):
    """Ctrl-C before the first step: no checkpoint exists, so the message must not offer one to resume; the cache
    entries written so far are what is kept. `difftune cache` records the stop in events.jsonl."""
    import json
    import signal

    from difftune.train import caching

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(caching, "_fill_latents", interrupted)
    path = write_config(tmp_path, dataset)
    assert main([command, "--config", str(path)]) == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "\ninterrupted; " in err and "checkpoint can be resumed" not in err
    assert ("no checkpoint was written yet" if command == "train" else "the caches written so far are kept") in err
    if command == "cache":
        events = [json.loads(x) for x in (tmp_path / "output" / "events.jsonl").read_text().splitlines()]
        assert {k: events[-1].get(k) for k in ("event", "stage", "reason")} == {
            "event": "stopped", "stage": "cache", "reason": "interrupted"}


def test_cache_stops_on_sigterm_keeping_what_it_wrote(tmp_path, dataset, monkeypatch, capsys):
    """`difftune cache` sent SIGTERM while it encodes latents: it exits with 143 and a stopped event; the text cache it
    had filled is reused by the next run, which completes. The SIGTERM handler before it is back afterwards."""
    import json
    import os
    import signal

    from difftune.train import caching

    path = write_config(tmp_path, dataset)
    real = caching._fill_latents

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(caching, "_fill_latents", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["cache", "--config", str(path)]) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    assert "terminated by SIGTERM; the caches written so far are kept" in capsys.readouterr().err
    events = [json.loads(x) for x in (tmp_path / "output" / "events.jsonl").read_text().splitlines()]
    assert {k: events[-1].get(k) for k in ("event", "stage", "reason")} == {
        "event": "stopped", "stage": "cache", "reason": "terminated by SIGTERM"}
    monkeypatch.setattr(caching, "_fill_latents", real)
    assert main(["cache", "--config", str(path)]) == 0
    assert "caches complete: 4 training items" in capsys.readouterr().out
    events = [json.loads(x) for x in (tmp_path / "output" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "info" and e["message"].startswith("text cache") and "0 newly encoded" in e["message"]
               for e in events)


def test_demo_never_replaces_a_users_config_nor_deletes_their_output(tmp_path, capsys):
    """`difftune demo --dir .` in a project replaced config/config.json and deleted output/ without a word."""
    import json

    from difftune.demo import MARKER, demo_config, folder_problem

    project = tmp_path / "project"
    (project / "config").mkdir(parents=True)
    (project / "config" / "config.json").write_text('{"model_family": "lumina2", "learning_rate": 1e-5}')
    (project / "output").mkdir()
    (project / "output" / "pytorch_lora_weights.safetensors").write_bytes(b"weeks of training")
    assert main(["demo", "--dir", str(project)]) == 2
    assert "holds files the demo did not make" in capsys.readouterr().err
    assert (project / "output" / "pytorch_lora_weights.safetensors").read_bytes() == b"weeks of training"
    assert json.loads((project / "config" / "config.json").read_text())["learning_rate"] == 1e-5
    (tmp_path / "afile").write_text("x")
    assert "a file, not a folder" in folder_problem(tmp_path / "afile")
    assert folder_problem(tmp_path / "new") is None and folder_problem(project / "config" / "empty") is None
    earlier = tmp_path / "earlier"  # a demo folder from before the marker: its own config.json says so
    (earlier / "config").mkdir(parents=True)
    (earlier / "config" / "config.json").write_text(json.dumps(demo_config(earlier)))
    assert folder_problem(earlier) is None
    (project / MARKER).write_text("")
    assert folder_problem(project) is None


def test_a_bare_flag_is_true_for_on_off_keys_only():
    """`--output_dir --max_train_steps 3` set output_dir to the text 'true', and check accepted it."""
    from difftune.cli import parse_overrides
    from difftune.config import ConfigError

    assert parse_overrides(["--gradient_checkpointing", "--max_train_steps", "3"]) == {
        "gradient_checkpointing": "true", "max_train_steps": "3"}
    for key in ("output_dir", "validation_prompt", "validation_steps"):  # the last: SimpleTuner's name of a number
        with pytest.raises(ConfigError) as info:
            parse_overrides([f"--{key}", "--max_train_steps", "3"])
        assert f"--{key} needs a value" in str(info.value)


def test_cache_into_a_training_runs_output_dir_is_refused(tmp_path, dataset, capsys):
    """`difftune cache` wrote its discovery, loading and data-report events into a live run's events.jsonl."""
    from difftune.train.run_lock import output_dir_lock

    path = write_config(tmp_path, dataset)
    with output_dir_lock(tmp_path / "output"):  # a training run holds it (2 s of waiting, then refused)
        assert main(["cache", "--config", str(path)]) == 2
    assert "is in use by another training run" in capsys.readouterr().err
    assert not (tmp_path / "output" / "events.jsonl").exists()


def test_cache_under_several_processes_is_refused(tmp_path, dataset, monkeypatch, capsys):
    """Under torchrun each worker filled every cache on its own: twice the work, every log line twice."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["cache", "--config", str(write_config(tmp_path, dataset))]) == 2
    assert "difftune cache runs as one process, not 2 (WORLD_SIZE)" in capsys.readouterr().err


def test_world_size_without_a_launcher_is_one_line(tmp_path, dataset, monkeypatch, capsys):
    """`export WORLD_SIZE=2` (as for `difftune check`) then a plain `difftune train`: accelerate's traceback
    ('MASTER_ADDR env was not set') after the config was read."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert main(["train", "--config", str(write_config(tmp_path, dataset))]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE is 2, but this process was not started by torchrun" in err and "Traceback" not in err


def test_only_process_0_says_what_the_run_did(tmp_path, dataset, monkeypatch, capsys):
    """Under torchrun every process printed its notes, a result line naming the folder, and (stopped by torchrun
    after process 0 failed) a checkpoint to resume from another run."""
    from difftune.train import setup

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(setup, "build_run", stopped)
    monkeypatch.setenv("RANK", "1")
    path = write_config(tmp_path, dataset, validation_prompt="", validation_steps=5)  # a config with a note
    assert main(["train", "--config", str(path)]) == 130
    said = capsys.readouterr()
    assert "note:" not in said.out and "interrupted" not in said.err
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--config", str(path)]) == 130
    said = capsys.readouterr()
    assert "note: " in said.out and "interrupted; no checkpoint was written yet" in said.err


def test_check_prints_the_config_notes_when_the_data_fails_too(tmp_path, capsys):
    """A failing data scan hid the config's notes, which `train` prints (and which may explain the failure)."""
    (tmp_path / "empty").mkdir()
    config = write_config(tmp_path, tmp_path / "empty", aspect_bucket_rounding=2)
    assert main(["check", "--config", str(config)]) != 0
    assert "note: aspect_bucket_rounding 2 not used" in capsys.readouterr().out


def test_config_environments_as_simpletuner_names_them(tmp_path, dataset, monkeypatch, capsys):
    """`difftune check env=NAME` reads config/NAME/config.json (SimpleTuner's `simpletuner train env=NAME`), with
    options after it; its other words are read or refused in words, before anything loads."""
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path / "config" / "portrait", dataset)
    (tmp_path / "config" / "portrait" / "config" / "config.json").rename(tmp_path / "config" / "portrait" / "config.json")
    assert main(["check", "env=portrait", "--max_train_steps", "3"]) == 0
    assert "config/portrait/config.json: OK" in capsys.readouterr().out
    assert main(["check", "config_backend=json", "env=portrait"]) == 0  # JSON: what difftune reads anyway
    capsys.readouterr()
    refusals = {("check", "--max_train_steps", "3", "env=portrait"): "'env=portrait' comes after an option",
                ("check", "env=portrait", "--config", "config/portrait/config.json"): "both name the config",
                ("check", "env=portrait", "env=other"): "env= is given twice",
                ("check", "env="): "env= names no config environment",
                ("train", "example=kontext.peft-lora"): "difftune bundles no example configs",
                ("check", "env=portrait", "config_backend=toml"): "reads only JSON configs.* config/portrait/config.json",
                ("plan", "config_backend=cmd"): "config_backend=cmd: give the settings in the config file",
                ("check", "env=missing"): "env=missing: no config file at missing/config.json or "
                                          "config/missing/config.json",
                ("check", "env=tomlish"): "env=tomlish: config/tomlish/config.toml is there, but no config.json; "
                                          "difftune reads only JSON configs"}
    (tmp_path / "config" / "tomlish").mkdir()
    (tmp_path / "config" / "tomlish" / "config.toml").write_text('model_family = "lumina2"\n')
    for argv, message in refusals.items():
        assert main(list(argv)) == 2, argv
        assert re.search(message, capsys.readouterr().err), argv


def test_config_environments_by_path_and_by_variable(tmp_path, dataset, monkeypatch, capsys):
    """SimpleTuner's other spellings: env= as a folder or a .json file, and its environment variables (SIMPLETUNER_ENV,
    ENV as train.sh reads it) when neither --config nor env= is given; a relative data_backend_config that SimpleTuner's
    web UI wrote relative to the config environments' folder is found there."""
    monkeypatch.chdir(tmp_path)
    for name in ("SIMPLETUNER_ENVIRONMENT", "SIMPLETUNER_ENV", "ENV"):
        monkeypatch.delenv(name, raising=False)
    write_config(tmp_path / "config" / "webui", dataset)
    env = tmp_path / "config" / "webui"
    (env / "config" / "config.json").rename(env / "config.json")
    (env / "config" / "multidatabackend.json").rename(env / "multidatabackend.json")
    config = json.loads((env / "config.json").read_text())
    (env / "config.json").write_text(json.dumps({**config, "data_backend_config": "webui/multidatabackend.json"}))
    for word in ("env=webui", "env=config/webui", "env=config/webui/config.json"):
        assert main(["check", word]) == 0, word
        out = capsys.readouterr()
        assert "config/webui/config.json: OK" in out.out
        assert "note: data_backend_config 'webui/multidatabackend.json' is not in the folder difftune runs in" in out.out
    monkeypatch.setenv("SIMPLETUNER_ENV", "webui")
    assert main(["check"]) == 0
    assert "note: SIMPLETUNER_ENV=webui: reading config/webui/config.json" in capsys.readouterr().err
    monkeypatch.setenv("SIMPLETUNER_ENV", "nope")
    assert main(["check"]) == 2 and "SIMPLETUNER_ENV=nope: no config file at" in capsys.readouterr().err
    monkeypatch.delenv("SIMPLETUNER_ENV")
    # ENV is also a POSIX shell's start-up file: one that names no config environment is passed over, said
    monkeypatch.setenv("ENV", "production")
    assert main(["check"]) == 2  # config/config.json does not exist here either
    assert "note: ENV=production names no config environment" in capsys.readouterr().err
    monkeypatch.setenv("ENV", "webui")
    assert main(["check"]) == 0 and "ENV=webui: reading config/webui/config.json" in capsys.readouterr().err
    monkeypatch.setenv("ENV", "config/webui/config.json")  # a .json file: a config, not a shell's start-up file
    assert main(["check"]) == 0 and "ENV=config/webui/config.json: reading" in capsys.readouterr().err
    assert main(["check", "--config", "config/webui/config.json"]) == 0  # --config wins, nothing said
    assert "ENV=" not in capsys.readouterr().err


def test_a_stop_command_during_caching_stops_at_once_with_the_caches_kept(tmp_path, dataset, monkeypatch, capsys):
    """The web UI's Stop while a run was caching waited for the caches to fill and one step to train."""
    import time

    import difftune.train.setup as setup
    from difftune.train.commands import send_command

    real = setup.fill_caches

    def slow(*args, **kwargs):  # caching that takes a while: the command arrives in the middle of it
        send_command(tmp_path / "output", "stop")
        time.sleep(3)
        return real(*args, **kwargs)

    monkeypatch.setattr(setup, "fill_caches", slow)
    assert main(["train", "--config", str(write_config(tmp_path, dataset, max_train_steps=5))]) == 143
    assert "stop command while caching" in capsys.readouterr().err
    events = [json.loads(line)["event"] for line in (tmp_path / "output" / "events.jsonl").read_text().splitlines()]
    assert "step" not in events and not list((tmp_path / "output" / "commands").glob("*.json"))


def test_an_error_every_process_meets_is_said_once(tmp_path, dataset, monkeypatch, capsys):
    """Under torchrun every process printed the same config or checkpoint error, interleaved into one garbled line;
    process 0 says it, another process says only an error of its own, with its number."""
    from difftune.cli import _error, main

    path = write_config(tmp_path, dataset, learning_rate=-1)
    monkeypatch.setenv("RANK", "1")
    assert main(["check", "--config", str(path)]) == 2
    assert "learning_rate" in capsys.readouterr().err  # RANK alone (no WORLD_SIZE): one process, said as ever
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["check", "--config", str(path)]) == 2
    assert capsys.readouterr().err == ""
    _error(OSError("its own"), everywhere=False)
    assert capsys.readouterr().err == "error (process 1): its own\n"
    monkeypatch.setenv("RANK", "0")
    assert main(["check", "--config", str(path)]) == 2
    assert "learning_rate" in capsys.readouterr().err


def test_a_process_that_lost_process_0_says_one_line(monkeypatch, capsys):
    """When process 0 stopped on an error, the others printed gloo's "Connection closed by peer" traceback under its
    message; they say one line, and a process 0 (or a single process) meeting the same error still raises it."""
    import difftune.cli as cli

    def broken(args, rest):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:29500\nmore")

    monkeypatch.setattr(cli, "cmd_check", broken)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error (process 1): lost contact with the other processes ([../third_party/gloo") and \
        "more" not in err and err.count("\n") == 1, err
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        cli.main(["check"])


def test_plan_and_cache_say_the_configs_notes(tmp_path, dataset, capsys):
    """`difftune cache --resolution 96` (every dataset sets its own) changed nothing and said nothing."""
    from difftune.cli import main

    path = write_config(tmp_path, dataset, max_train_steps=1)
    for command in ("plan", "cache"):
        assert main([command, "--config", str(path), "--resolution", "96"]) == 0
        assert "note: the command line's resolution applies to no dataset" in capsys.readouterr().out, command
