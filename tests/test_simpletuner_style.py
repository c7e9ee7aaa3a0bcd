"""Configs written the way SimpleTuner's example presets for these families are (tests/simpletuner_style/):
a user who copies such a preset gets `difftune check` to pass, every key to reach the config unchanged,
and a run that trains and validates, on the tiny models.

The runs go through the spec harness (tests/test_spec_configs.py): the same swaps (tiny model, sizes / 16,
two steps, short validation) and the same checks. The presets also set config-level dataset sizes
(`resolution: 480`), scaled here like the dataset entries' sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import test_spec_configs as harness
from difftune.config import load_config
from test_spec_configs import (
    SIZE_DIVISOR,
    check_keys_arrived,
    check_trained,
    difftune_check,
    materialise,
    train_two_steps,
)

spec_media = harness.spec_media  # the harness's fixtures, used here too
offline_services = harness.offline_services

HERE = Path(__file__).resolve().parent / "simpletuner_style"
PRESETS = {
    "lumina2.peft-lora": ("lumina2", "lumina2_peft_lora.json", "datasets_images.json", None),
    "kandinsky5-image.lycoris-lokr": ("kandinsky5-image", "kandinsky5_image_lycoris_lokr.json",
                                      "datasets_images.json", "kandinsky5_image_lycoris_config.json"),
    "kandinsky5-video.peft-lora": ("kandinsky5-video", "kandinsky5_video_peft_lora.json", "datasets_video.json",
                                   None),
    # SimpleTuner keys difftune gained late, together: config-level crop and caption defaults, vae_dtype,
    # disable_tf32, lr_power/lr_end, Huber loss, input perturbation, epoch intervals, base-model samples,
    # several images per prompt, compressed caches, the optimizer_beta and peft_lora_target_modules aliases
    "lumina2.many-keys": ("lumina2", "lumina2_many_keys.json", "datasets_plain.json", None),
}


def preset(name: str) -> dict:
    family, config_file, datasets_file, lycoris_file = PRESETS[name]
    config = json.loads((HERE / config_file).read_text(encoding="utf-8"))
    for key in ("resolution", "minimum_image_size"):  # config-level dataset defaults, in pixels
        if isinstance(config.get(key), int) and config[key] > 64:
            config[key] //= SIZE_DIVISOR
    return {"family": family, "flavour": "tiny-random", "config": config,
            "datasets": json.loads((HERE / datasets_file).read_text(encoding="utf-8")),
            "prompts": {}, "block": None, "lycoris": lycoris_file}


@pytest.mark.parametrize("name", list(PRESETS))
def test_simpletuner_style_preset_trains(name, tmp_path, monkeypatch, spec_media, capsys):
    combo = preset(name)
    monkeypatch.chdir(tmp_path)
    if combo["lycoris"]:
        target = tmp_path / combo["config"]["lycoris_config"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((HERE / combo["lycoris"]).read_text(encoding="utf-8"), encoding="utf-8")
    path = materialise(combo, tmp_path, spec_media)
    status, output = difftune_check(path, capsys)
    assert status == 0, output
    check_keys_arrived(combo, path)
    result = train_two_steps(path)
    check_trained(result)
    assert result["validates"] and result["samples"]
    cfg = load_config(path).train
    if cfg.disable_benchmark is False:  # base-model samples, and each later sample stitched beside them
        folder = Path(cfg.output_dir)
        assert list(folder.rglob("base-model*")) and list(folder.rglob("*-vs-base.png"))
    if cfg.num_validation_images > 1:
        assert any("1of2" in Path(p).name for p in result["samples"])
    if cfg.compress_disk_cache:  # every cache entry written deflated
        entries = [p for p in (tmp_path / "cache").rglob("*.safetensors")]
        assert entries and all(p.read_bytes()[:4] == b"DTZ1" for p in entries)
