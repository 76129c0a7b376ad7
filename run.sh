#!/usr/bin/env bash
# Set up (first run only) and start the WiM service on local Ray with the offline default model:
# http://127.0.0.1:8000 (POST /wim, POST /documents, GET /docs). Ctrl-C stops it.
# Extra arguments go to `wim serve`, e.g. ./run.sh --config my_serve_config.yaml
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh
exec .venv/bin/wim serve "$@"
