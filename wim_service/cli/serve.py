"""`wim serve`: the HTTP service on local Ray (Ray Serve's `serve run` with our environment)."""

from __future__ import annotations

import argparse
import base64
import os
import secrets
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from wim_service.cli.lifecycle import run_subprocess

DEFAULT_SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the HTTP service on local Ray (Ray Serve's `serve run` with our environment)",
        description="Run the HTTP service on local Ray. Documents' KV is saved to a directory in "
        "the cache folder (sealed with a key kept beside it) unless WIM_KV_STORE names a store, "
        "so that a restarted service restores documents instead of reading them again.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_SERVE_CONFIG,
        help="Ray Serve config file; engine settings are its `args.engine` (default: %(default)s)",
    )
    parser.set_defaults(main=main)


def main(args: argparse.Namespace) -> int:
    """Run `serve run CONFIG` (so the config's deployments apply) until a signal stops it.

    A child rather than an `exec`: `serve run` ended by SIGTERM leaves Ray's processes and
    the replicas' engines behind, and on Ctrl-C takes seconds to shut down; `run_subprocess`
    turns either signal into its Ctrl-C and kills whatever it has not ended in time."""
    from wim_service.assets.default_model import default_model_dir
    from wim_service.assets.punkt import punkt_data_dir

    # Prepare the offline assets once here rather than in every replica at once.
    default_model_dir()
    punkt_data_dir()
    env = {
        **os.environ,
        # Ray starts workers at nice 15 and the engines would inherit it.
        "RAY_worker_niceness": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **local_kv_store(os.environ),
    }
    serve = Path(sys.executable).with_name("serve")
    url = service_url(args.config)
    threading.Thread(target=announce_ready, args=(url,), daemon=True).start()
    return run_subprocess([str(serve), "run", str(args.config)], env)


def local_kv_store(env: Mapping[str, str]) -> dict[str, str]:
    """The KV store of one machine, unless `env` names one (`WIM_KV_STORE`): a directory in
    the cache folder, sealed with a master key kept beside it (made once, readable by this
    user only), so that a restarted service or a replaced engine restores documents instead
    of reading them again (docs/kv-store.md). A deployment gives the key as a secret."""
    from wim_service.assets.paths import cache_dir
    from wim_service.engine.kv_transfer.documents import STORE_ENV
    from wim_service.engine.kv_transfer.keys import MASTER_KEY_ENV

    if env.get(STORE_ENV):
        return {}
    key_file = cache_dir() / "kv-master.key"
    if not key_file.exists():
        with os.fdopen(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(base64.b64encode(secrets.token_bytes(32)).decode())
    return {
        STORE_ENV: str(cache_dir() / "kv"),
        MASTER_KEY_ENV: env.get(MASTER_KEY_ENV) or key_file.read_text().strip(),
    }


def service_url(config: Path) -> str:
    """Where the config's HTTP proxy listens (Serve's defaults: 127.0.0.1:8000)."""
    import yaml

    http = (yaml.safe_load(config.read_text()) or {}).get("http_options") or {}
    return f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"


def announce_ready(url: str, poll_s: float = 2.0) -> None:
    """Print one line once `/readyz` answers 200: `serve run`'s own log does not say when an
    engine replica can answer (its "Deployed app" line never came on the default config)."""
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=poll_s) as answer:
                if answer.status == 200:
                    print(f"wim_service ready at {url} (POST /wim, /v1, the page at /)", flush=True)
                    return
        except OSError:
            pass  # not listening yet, or 503 until an engine replica is ready
        time.sleep(poll_s)
