#!/usr/bin/env bash
# SimpleTuner's legacy entry point, kept for the quickstarts' `./train.sh`:
#   ./train.sh [--key value ...]
# runs `difftune train [--key value ...]` from the current folder, which reads config/config.json, or the config
# that CONFIG_PATH names, or ENV=foo (SIMPLETUNER_ENV, SIMPLETUNER_ENVIRONMENT) config/foo/config.json, as
# SimpleTuner's loader does. A config.env beside the config is not read (difftune says so). Extra arguments are
# passed through as overrides. The exit status is difftune's.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -x "$here/.venv/bin/difftune" ]]; then
    exec "$here/.venv/bin/difftune" train "$@"
elif command -v difftune >/dev/null 2>&1; then
    exec difftune train "$@"
else
    echo "train.sh: difftune is not installed; run 'make setup' (or 'pip install -e .') first" >&2
    exit 127
fi
