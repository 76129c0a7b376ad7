#!/usr/bin/env bash
# How long `wim sim` takes: 64 simulated replicas over the shipped 4,000-request Mooncake trace,
# every placement policy, with the machine's load average (a benchmark, not a test).
# Usage: scripts/bench_sim.sh [PYTHON]   (default: the venv's python)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:-.venv/bin/python}"
trace=wim_service/sim/traces/mooncake_conversation_4000.jsonl.gz
uptime
time "$python" -c 'import sys; from wim_service.cli import main; sys.exit(main(sys.argv[1:]))' \
    sim --trace "$trace" --replicas 64 --policies round_robin,sticky,wim
uptime
