#!/usr/bin/env bash
# One lent-GPU call of at most 10 minutes (the device tool's limit), run in the repository root on the GPU machine:
#   bash tools/gpu_session.sh <part>     (carry .whl/ made by tools/gpu_wheels.sh)
# Parts, each planned to fit one call; what each prints goes to BENCHMARKS.md with the machine and commit:
#   tests-1  make test-gpu's first group: CUDA-only tests (side streams, activation offload), bf16 user path, spec
#            configs, block streaming, TREAD
#   tests-2  its second group: CREPA, quantization, DoRA, EMA, prefetch, masked loss, eval loss, regularisation,
#            model offload (never run on a GPU so far)
#   levers   Lumina2 1024² bs1: each quantized base (peak after quantized_saves), TREAD, activation offload,
#            streaming (+ int8); and the step with LoRA casts skipped (issue 17)
#   pro      K5 Video Pro 81f bs1 checkpointed: resident, streamed, streamed + activation offload (the 24 GB goal
#            of issue 14), streamed + TREAD
#   compile  compiled steps: K5 Image and Video Lite (+ TREAD), Lumina2 512² with dynamo_mode reduce-overhead
#   fullft   Lumina2 1024² bs1 full fine-tune (adamw_bf16, checkpointed): optimizer on the GPU, stepping in CPU
#            memory (optimizer_cpu_offload_method 'cpu'), and with optimizer_offload_gradients; then the CPU
#            optimizer rates of that machine (make bench-host-optimizer)
# Rows are also written as JSON lines under $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: tools/gpu_session.sh tests-1|tests-2|levers|pro|compile|fullft}
out=${OUT:-/tmp/out}
mkdir -p "$out"
python=$(command -v python || command -v python3)
python() { "$python" "$@"; }
if [ -d .whl ]; then
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
else
    export PYTHONPATH=$PWD/src:$PWD/tests
fi
export PYTHONUNBUFFERED=1 DIFFTUNE_HOME=/tmp/dth HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
git log -1 --format='commit %h %s' 2>/dev/null || true
bench() { python -m difftune.bench_gpu --steps 3 --warmup 1 --out "$out/$part.jsonl" "$@"; }
case "$part" in
    tests-1) python -m pytest -q -m "not slow" -x tests/test_gpu.py tests/test_bf16.py tests/test_spec_configs.py \
                 tests/test_offload.py tests/test_tread.py tests/test_activation_offload.py 2>&1 | tail -30 ;;
    tests-2) python -m pytest -q -m "not slow" tests/test_crepa.py tests/test_quantization.py tests/test_dora.py \
                 tests/test_ema.py tests/test_prefetch.py tests/test_masked_loss.py tests/test_eval_loss.py \
                 tests/test_regularisation.py tests/test_model_offload.py tests/test_lora_casts.py 2>&1 | tail -30 ;;
    levers) bench --cases lumina2-1024-bs1 --matrix levers --checkpointing ;;
    pro) bench --cases k5-video-pro-81f-bs1 --matrix stream ;;
    compile) bench --cases k5-image-1024-bs1 k5-video-lite-81f-bs2 --matrix tread --compiled --checkpointing
             bench --cases lumina2-512-bs2 --matrix quick --compile-mode reduce-overhead ;;
    fullft) python -m difftune.bench_gpu --steps 2 --warmup 0 --out "$out/$part.jsonl" --cases lumina2-1024-bs1 \
                --matrix fullft
            python -m difftune.bench_host_optimizer --repeats 2 ;;
    *) echo "unknown part $part"; exit 2 ;;
esac
