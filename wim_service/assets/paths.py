"""Where prepared assets live: one cache folder, overridable for CI and containers."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$WIM_CACHE_DIR`, else `~/.cache/wim_service`."""
    root = os.environ.get("WIM_CACHE_DIR") or Path.home() / ".cache" / "wim_service"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def force_offline() -> None:
    """No model hub, ever: every load in this process reads local folders only."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
