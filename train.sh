#!/usr/bin/env bash
# SimpleTuner's legacy entry point, kept for the quickstarts' `./train.sh`:
#   ./train.sh [--key value ...]
# runs `difftune train --config config/config.json [--key value ...]` from the current folder.
# ENV=foo (or SIMPLETUNER_ENV=foo) uses config/foo/config.json, as difftune reads them (SimpleTuner's config
# environments; a folder or a .json file too); CONFIG_PATH=path names the file directly. Extra arguments are
# passed through as overrides. The exit status is difftune's.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
args=()  # --config PATH, or nothing: difftune then reads SIMPLETUNER_ENVIRONMENT, SIMPLETUNER_ENV and ENV itself
if [[ -n "${CONFIG_PATH:-}" ]]; then
    config="$CONFIG_PATH"
    args=(--config "$config")
else
    # for the config.env warning only: the file difftune will read (its rules), when there is one
    env="${SIMPLETUNER_ENVIRONMENT:-${SIMPLETUNER_ENV:-${ENV:-}}}"
    config="config/config.json"
    if [[ -n "$env" && "$env" != "default" ]]; then
        for candidate in "$env" "$env/config.json" "config/$env/config.json"; do
            if [[ -f "$candidate" && "$candidate" == *.json ]]; then config="$candidate"; break; fi
        done
    fi
fi

# SimpleTuner's train.sh sources config.env (TRAINING_NUM_PROCESSES, accelerate and dynamo settings); this one
# does not, so say so rather than run with its settings silently dropped.
env_file="$(dirname "$config")/config.env"
if [[ -f "$env_file" ]]; then
    echo "train.sh: warning: $env_file is not read (SimpleTuner's launcher settings such as TRAINING_NUM_PROCESSES)." \
        "Put training settings in $config; for several processes run" \
        "'torchrun --nproc_per_node N -m difftune.cli train --config $config'." >&2
fi

if [[ -x "$here/.venv/bin/difftune" ]]; then
    exec "$here/.venv/bin/difftune" train ${args[@]+"${args[@]}"} "$@"
elif command -v difftune >/dev/null 2>&1; then
    exec difftune train ${args[@]+"${args[@]}"} "$@"
else
    echo "train.sh: difftune is not installed; run 'make setup' (or 'pip install -e .') first" >&2
    exit 127
fi
