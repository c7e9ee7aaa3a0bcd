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
    row = bench_gpu.run_config(case, "native-math", False, True, args(), torch.device("cpu"))
    assert row["attention"] == "sdpa math" and row["checkpointing"] and not row["compile"]
    assert row["step_s"] > 0 and row["tflop_per_step"] >= 0 and row["tokens_per_s"] > 0
    assert row["mfu"] is None and row["peak_gib"] is None  # on the CPU: no peak to compare with, no CUDA memory
    text = bench_gpu.table([row, {**row, "error": "out of memory"}])
    assert "sdpa math" in text and "out of memory" in text and text.count("\n") == 3


def test_matrix():
    quick = bench_gpu.configurations(argparse.Namespace(matrix="quick", backends=["auto", "native"]))
    assert quick == [("auto", False, False), ("native", False, False), ("auto", True, False),
                     ("auto", False, True), ("auto", True, True)]
    assert len(bench_gpu.configurations(argparse.Namespace(matrix="full", backends=["auto", "native"]))) == 8


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
