#!/usr/bin/env bash
# Set up (first run only) and run WiM on the sample document with the offline default model.
# Extra arguments go to `wim run`, e.g. ./run.sh --json --relevance classifier
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh
exec .venv/bin/wim run --context examples/harbor_report.txt \
  --query "What is the access code for the night gate?" --segment-tokens 192 "$@"
