"""`make demo`: generate a small captioned dataset and a config, then train a LoRA on the tiny model."""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40)}
SHAPES = ("circle", "square")


def make_dataset(folder: Path, count: int = 8, size: tuple[int, int] = (64, 64), seed: int = 0) -> list[Path]:
    """Images of a coloured shape on a plain background, each with a `.txt` caption beside it."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        fg, bg = rng.sample(list(COLOURS), 2)
        shape = SHAPES[i % len(SHAPES)]
        img = Image.new("RGB", size, COLOURS[bg])
        draw = ImageDraw.Draw(img)
        w, h = size
        box = (w * 0.2, h * 0.2, w * 0.8, h * 0.8)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[fg])
        path = folder / f"{i:03d}-{fg}-{shape}.png"
        img.save(path)
        path.with_suffix(".txt").write_text(f"a {fg} {shape} on a {bg} background")
        paths.append(path)
    return paths


MARKER = ".difftune-demo"  # in a folder the demo made: it may replace the config and delete output/ there


def folder_problem(root: Path) -> str | None:
    """Why the demo must not run in `root`, or None. It writes config/, data/ and cache/ and deletes output/ each
    run: in a folder of the user's (`--dir .` in a project) that would replace their config and delete their
    results. A new or empty folder, or one the demo made (its marker, or its own config.json), is fine."""
    if root.exists() and not root.is_dir():
        return f"--dir {root}: a file, not a folder; give a new folder for the demo"
    if not root.exists() or not any(root.iterdir()) or (root / MARKER).is_file():
        return None
    config = root / "config" / "config.json"
    try:
        if json.loads(config.read_text()) == demo_config(root):  # made by an earlier demo without the marker
            return None
    except (OSError, ValueError):
        pass
    return (f"--dir {root}: the folder holds files the demo did not make; the demo writes config/, data/ and cache/ "
            "there and deletes output/ each run, so give a new or empty folder (e.g. --dir demo)")


def demo_config(root: Path, steps: int = 100) -> dict:
    return {
        "model_family": "lumina2", "model_flavour": "tiny-random", "model_type": "lora",
        "output_dir": str(root / "output"), "data_backend_config": str(root / "config" / "multidatabackend.json"),
        "mixed_precision": "no", "train_batch_size": 2, "learning_rate": 1e-3, "lora_rank": 8,
        "max_train_steps": steps, "checkpoint_step_interval": 50, "validation_step_interval": 50,
        "validation_prompt": "a red circle on a blue background", "validation_resolution": "64x64",
        "validation_num_inference_steps": 10, "seed": 42,
    }


def write_demo_config(root: Path, steps: int = 100) -> Path:
    config_dir = root / "config"
    config_dir.mkdir(parents=True, exist_ok=True)
    datasets = [
        {"id": "shapes", "type": "local", "dataset_type": "image", "instance_data_dir": str(root / "data"),
         "caption_strategy": "textfile", "resolution": 64, "resolution_type": "pixel_area",
         "cache_dir_vae": str(root / "cache" / "vae"), "repeats": 0},
        {"id": "text-embeds", "type": "local", "dataset_type": "text_embeds", "default": True,
         "cache_dir": str(root / "cache" / "text")},
    ]
    (config_dir / "multidatabackend.json").write_text(json.dumps(datasets, indent=2))
    path = config_dir / "config.json"
    path.write_text(json.dumps(demo_config(root, steps), indent=2))
    return path


def run_demo(root: Path) -> None:
    import shutil

    from difftune.config import ConfigError, load_config
    from difftune.train.loop import train
    from difftune.train.setup import build_run

    if (problem := folder_problem(root)) is not None:
        raise ConfigError([problem])
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text("made by `difftune demo`: it replaces config/ and deletes output/ here each run\n")
    shutil.rmtree(root / "output", ignore_errors=True)  # a fresh run each time; caches are reused
    make_dataset(root / "data")
    config = write_demo_config(root)
    run_cfg = load_config(config)
    adapter = train(build_run(run_cfg))
    samples = sorted((root / "output" / "validation").glob("*.png"))
    print(f"\ndemo done.\n  config:  {config}\n  LoRA:    {adapter}\n  samples: " + "\n           ".join(map(str, samples)))
