"""The command line's own words (difftune/cli.py)."""

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
