"""What a run writes is readable as any file the user makes (0666 less the umask), not private: the LoRA a ComfyUI
server running as another user loads, the checkpoints, and a cache_dir shared between users. Atomic writes through
`tempfile.mkstemp` and safetensors 0.8's `save_file` both created 0600 files."""

from __future__ import annotations

import stat

import pytest

from conftest import write_config
from difftune.config import load_config
from difftune.files import CREATE_MODE
from difftune.train.loop import train
from difftune.train.setup import build_run


def test_results_checkpoints_and_caches_get_the_ordinary_mode(tmp_path, dataset):
    if not CREATE_MODE & 0o044:
        pytest.skip("this process's umask makes every new file private anyway")
    run = build_run(load_config(write_config(tmp_path, dataset, max_train_steps=2, checkpoint_step_interval=1,
                                             lora_format="comfyui")))
    train(run)
    written = [p for p in tmp_path.rglob("*") if p.is_file() and "config" not in p.parts]
    kinds = {p.suffix for p in written}
    assert {".safetensors", ".pt", ".json"} <= kinds
    assert any("cache" in p.parts for p in written) and any("checkpoints" in p.parts for p in written)
    private = [str(p.relative_to(tmp_path)) for p in written if stat.S_IMODE(p.stat().st_mode) != CREATE_MODE]
    assert not private
