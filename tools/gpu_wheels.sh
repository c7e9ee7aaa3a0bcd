#!/usr/bin/env bash
# Download, on this (CPU) machine, the wheels a lent GPU machine lacks, into .whl/ (ignored by git; carry it with
# the device tool's `carry: [".whl"]`). The GPU image (as of 2026-11-24) has torch (CUDA), transformers,
# huggingface_hub, tokenizers, accelerate, peft, safetensors, einops and bitsandbytes; the rest of what difftune
# imports comes from here, at constraints.txt's pins, for CPython 3.12 on x86-64 Linux: 47 MB of the 64 MB a call
# may carry (no room for wandb, so the spec blocks that report to wandb fail there).
set -euo pipefail
cd "$(dirname "$0")/.."
want="diffusers pydantic pydantic-core annotated-types typing-inspection torchao optimum-quanto lycoris-lora toml
      av torch-optimi lion-pytorch prodigyopt schedulefree"
pins=()
for name in $want; do
    pin=$(grep -i "^${name}==" constraints.txt || true)
    pins+=("${pin:-$name}")
done
mkdir -p .whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${pins[@]}"
du -sh .whl
