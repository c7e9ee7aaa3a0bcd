"""What `difftune train` prints is true and free of third-party noise."""

import os
import subprocess
import sys

from conftest import write_config
from difftune import cli


def test_a_run_prints_no_library_noise_and_says_what_it_saved(tmp_path, dataset):
    config = write_config(tmp_path, dataset, max_train_steps=1, validation_prompt="a cat",
                          validation_resolution="32x32", validation_num_inference_steps=1)
    done = subprocess.run([sys.executable, "-m", "difftune.cli", "train", "--config", str(config)],
                          capture_output=True, text=True, timeout=300, env=os.environ | {"PYTHONWARNINGS": "default"})
    assert done.returncode == 0, done.stderr[-2000:]
    for noise in ("requires torchvision", "kernels-community", "Traceback", "Loading pipeline components"):
        assert noise not in done.stderr + done.stdout, noise
    assert f"LoRA saved to {tmp_path / 'output'}" in done.stdout
    assert f"validation samples in {tmp_path / 'output' / 'validation'}" in done.stdout
    assert "validating 1/2 (32x32)" in done.stderr  # on the progress bar while it samples (a video: minutes)


def test_a_kandinsky5_bf16_run_prints_no_torch_dispatch_warning(tmp_path, dataset):
    """diffusers' Kandinsky 5 attention feeds fp32 queries to a bf16 RMSNorm (as the stock pipeline does): torch's
    once-a-process "Mismatch dtype ... Cannot dispatch to fused implementation" was on every bf16 run's console."""
    config = write_config(tmp_path, dataset, max_train_steps=1, model_family="kandinsky5-image",
                          mixed_precision="bf16", validation_prompt="a cat", validation_resolution="32x32",
                          validation_num_inference_steps=1)
    done = subprocess.run([sys.executable, "-m", "difftune.cli", "train", "--config", str(config)],
                          capture_output=True, text=True, timeout=300, env=os.environ | {"PYTHONWARNINGS": "default"})
    assert done.returncode == 0, done.stderr[-2000:]
    for noise in ("Mismatch dtype", "UserWarning"):
        assert noise not in done.stderr + done.stdout, (done.stderr + done.stdout)[-3000:]


def test_full_finetune_says_model_and_no_samples_line_without_validation(tmp_path, dataset, capsys):
    config = write_config(tmp_path, dataset, max_train_steps=1, model_type="full")
    assert cli.main(["train", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "LoRA" not in out and "validation samples" not in out
    assert f"model saved to {tmp_path / 'output' / 'transformer'}" in out


def test_the_noise_filter_keeps_other_warnings():
    """The handlers keep the stream they were made with (pytest's, at import), so the test points them at
    a buffer of its own: what the user's terminal would get."""
    import io
    import logging

    from transformers.utils import logging as transformers_logging

    cli.quiet_libraries()
    buffer = io.StringIO()
    handlers = transformers_logging._get_library_root_logger().handlers
    bnb = logging.StreamHandler(buffer)
    logging.getLogger("bitsandbytes").addHandler(bnb)
    streams = [h for h in handlers if isinstance(h, logging.StreamHandler)]
    # Assigned, not setStream: that flushes the old stream, which an earlier in-process run under pytest's
    # capture may have closed.
    old = [h.stream for h in streams]
    for h in streams:
        h.stream = buffer
    try:
        logger = transformers_logging.get_logger("transformers.test")
        logger.warning("`X` requires torchvision (not installed); falling back")
        logger.warning("a warning the user needs")
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load from kernels-community: offline")
    finally:
        for h, stream in zip(streams, old, strict=True):
            h.stream = stream
        logging.getLogger("bitsandbytes").removeHandler(bnb)
    err = buffer.getvalue()
    assert "a warning the user needs" in err
    assert "torchvision" not in err and "kernels-community" not in err


def test_the_event_log_is_strict_json_when_a_value_is_not_finite(tmp_path):
    """A NaN loss (a skipped step) was written as `NaN`, which JavaScript's JSON.parse and the web server's strict
    JSON answers refuse: it is null in the log (the warning says what happened)."""
    import json
    import math

    from difftune.train.events import Events

    events = Events(tmp_path / "events.jsonl", console=False)
    events.emit("step", step=1, loss=math.nan, lr=math.inf, parts=[1.0, -math.inf], nested={"x": math.nan})
    events.close()

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    record = json.loads((tmp_path / "events.jsonl").read_text(), parse_constant=refuse)
    assert (record["loss"], record["lr"], record["parts"], record["nested"]) == (None, None, [1.0, None], {"x": None})


def test_an_event_log_cut_mid_line_and_a_full_disk(tmp_path, capsys):
    """A log an earlier run left cut (a crash or a full disk mid-write) gets the new run's first event on its own
    line; a log that can no longer be written stops with one warning, and the run goes on."""
    import errno
    import json

    from difftune.train.events import Events

    log = tmp_path / "events.jsonl"
    log.write_text('{"event": "info", "message": "a"}\n{"event": "st')
    events = Events(log)
    events.emit("info", message="resumed")
    events.close()
    assert json.loads(log.read_text().splitlines()[-1])["message"] == "resumed"

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    events = Events(log)
    events._log = FullDisk()
    events.emit("step", step=1, loss=0.5, lr=1e-4)
    events.emit("info", message="still here")  # not written, no second warning, no exception
    events.close()
    shown = capsys.readouterr()
    shown = shown.out + shown.err
    assert shown.count(f"cannot write {log} (No space left on device): the event log stops here") == 1
    assert "still here" in shown
