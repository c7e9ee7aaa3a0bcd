"""`make bench-gpu` (difftune.bench_gpu) on the tiny models on the CPU: the script a GPU machine runs works, and
its rows carry the figures the table prints. The GPU figures themselves are in BENCHMARKS.md."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from difftune import bench_gpu


def args(**kw):
    return argparse.Namespace(**{"steps": 1, "warmup": 0, "compile_backend": "eager", **kw})


def test_one_configuration_gives_a_full_row():
    case = bench_gpu.tiny_case(bench_gpu.CASES["lumina2-512-bs2"])
    row = bench_gpu.run_config(case, bench_gpu.Setup("native-math", checkpointing=True), args(), torch.device("cpu"))
    assert row["attention"] == "sdpa math" and row["checkpointing"] and not row["compile"]
    assert row["step_s"] > 0 and row["tflop_per_step"] >= 0 and row["tokens_per_s"] > 0
    assert row["mfu"] is None and row["peak_gib"] is None  # on the CPU: no peak to compare with, no CUDA memory
    text = bench_gpu.table([row, {**row, "error": "out of memory"}])
    assert "sdpa math" in text and "out of memory" in text and text.count("\n") == 3


def test_matrix():
    quick = bench_gpu.configurations(argparse.Namespace(matrix="quick", backends=["auto", "native"]))
    S = bench_gpu.Setup
    assert quick == [S("auto"), S("native"), S("auto", True, False), S("auto", False, True), S("auto", True, True)]
    assert len(bench_gpu.configurations(argparse.Namespace(matrix="full", backends=["auto", "native"]))) == 8
    levers = bench_gpu.configurations(argparse.Namespace(matrix="levers", backends=["native"],
                                                         precisions=["int8-quanto", "fp8-torchao"], tread_ratio=0.5,
                                                         checkpointing=False))
    assert [s.levers() for s in levers] == ["-", "int8-quanto", "fp8-torchao", "TREAD 0.5", "-",
                                            "activations offloaded", "streamed", "int8-quanto, streamed"]
    assert all(s.checkpointing for s in levers if s.activations)
    assert all(s.checkpointing for s in levers if s.stream)  # streaming is measured as it is meant to run


@pytest.mark.parametrize("name,setup", [
    ("lumina2-512-bs2", dict(precision="int8-quanto")), ("lumina2-512-bs2", dict(tread=0.5)),
    ("k5-video-lite-81f-bs2", dict(precision="int8-torchao")),
    ("k5-video-lite-81f-bs2", dict(checkpointing=True, stream=True, activations=True)),
    ("lumina2-512-bs2", dict(checkpointing=True, full="offload+grads")),
], ids=["lumina2-int8-quanto", "lumina2-tread", "k5-video-int8-torchao", "k5-video-stream-activations",
        "lumina2-full-optimizer-offload-grads"])
def test_each_lever_runs_a_step_on_the_tiny_models(name, setup):
    """The levers matrix's rows, one step each: quantized base + LoRA, TREAD, block streaming with checkpointing
    (synchronous on the CPU). A lever that broke would give an error row on the GPU machine and lose its figure."""
    case = bench_gpu.tiny_case(bench_gpu.CASES[name])
    row = bench_gpu.run_config(case, bench_gpu.Setup("native", **setup), args(), torch.device("cpu"))
    assert row["step_s"] > 0 and row["levers"] == bench_gpu.Setup("native", **setup).levers()
    assert ("streamed_gib" in row) == bool(setup.get("stream"))


def test_refuses_to_run_real_size_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit):
        bench_gpu.main(["--cases", "lumina2-512-bs2"])


@pytest.mark.slow
def test_whole_script_on_tiny_models(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    rows = bench_gpu.main(["--tiny", "--cases", "k5-video-lite-81f-bs2", "--steps", "1", "--warmup", "0",
                           "--compile-backend", "eager", "--out", str(out)])
    assert len(rows) == 4 and not [r for r in rows if "error" in r]
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    assert "| K5 Video Lite" in capsys.readouterr().out


def test_compile_mode_reaches_the_config_and_the_row():
    """--compile-mode is dynamo_mode of the compiled rows (inductor only: another backend gives the config's error)."""
    case = bench_gpu.tiny_case(bench_gpu.CASES["lumina2-512-bs2"])
    with pytest.raises(ValueError, match="dynamo_mode"):
        bench_gpu.run_config(case, bench_gpu.Setup("native", compiled=True), args(compile_mode="max-autotune-no-cudagraphs"),
                             torch.device("cpu"))
    row = bench_gpu.run_config(case, bench_gpu.Setup("native"), args(compile_mode="reduce-overhead"), torch.device("cpu"))
    assert row["compile"] is False  # uncompiled rows ignore it
    assert "| reduce-overhead |" in bench_gpu.table([{**row, "compile": "reduce-overhead"}])
