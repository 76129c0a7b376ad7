#!/usr/bin/env bash
# Set up (first run only), lint, then run the whole test suite on the real default model.
# Extra arguments go to pytest, e.g. ./test.sh -k segmentation
set -euo pipefail
cd "$(dirname "$0")"
# The suite's system tools too (promtool, when run as root); WIM_INSTALL_SYSTEM_TOOLS=0 skips.
WIM_INSTALL_SYSTEM_TOOLS="${WIM_INSTALL_SYSTEM_TOOLS:-1}" scripts/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Types: strict for wim_service/wim and wim_service/serving (pyproject's [tool.mypy]).
.venv/bin/mypy wim_service
status=0
# Two workers: the multi-node cluster's tests beside the engines' (tests/conftest.py); -n 0
# after them runs everything in one process.
.venv/bin/python -m pytest -p no:cacheprovider -n 2 --dist loadgroup "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$status"
