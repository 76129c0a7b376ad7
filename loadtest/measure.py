"""Measured load test: the service on 127.0.0.1 with a fixed number of engine replicas, the
Locust users of locustfile.py at a constant arrival rate for a bounded time, and a summary.

    .venv/bin/python loadtest/measure.py --replicas 1 --out /tmp/wim-load/replicas-1
    .venv/bin/python loadtest/measure.py --replicas 2 --out /tmp/wim-load/replicas-2

It writes the effective serve config beside the service's log, waits for every replica, runs
Locust headless (`--csv`, `--html`, the /metrics sampler's CSV) into `--out`, checks that no
session or reserved KV is left, stops the service and writes `summary.md` there: per request
name the requests, failures, rates sent, answered and offered, and p50/p95/p99; time to first
margin; failures by reason; sessions and KV over the run; the commands; load average, `nproc`.

Exit status 0 only if every failure was a designed refusal (429, 503) and the service settled.
Loopback only; at most 30 minutes of load (the locustfile's own cap).
"""

from __future__ import annotations

import argparse
import csv
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from statistics import fmean

import httpx
from local_service import (
    ROOT,
    SNAPSHOT_COLUMNS,
    settled,
    start_service,
    stop_service,
    wait_ready,
    write_config,
)
from loopback import require_loopback
from workload import DEFAULT_RATE, MAX_RATE, QUESTION_NAMES, REFUSALS, WEIGHTS

HARD_MAX_MINUTES = 30
STOP_TIMEOUT_S = 120  # Locust lets running requests finish this long after the run time
SETTLE_TIMEOUT_S = 120
DESIGNED = tuple(REFUSALS.values())
CSV_PREFIX = "locust"


@dataclass
class Run:
    """What measure.py knows of a run besides Locust's files."""

    replicas: int
    users: int
    rate: float  # questions per second per user
    seconds: float  # Locust's --run-time
    startup_s: float  # from starting the service to every replica ready
    commands: list[str]
    loads: dict[str, str]  # moment -> `uptime`
    nproc: int
    settled: bool
    locust_status: int


# -- the summary ---------------------------------------------------------------------------


def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as rows:
        return list(csv.DictReader(rows))


def reason(error: str) -> str:
    """A failure's reason as the locustfile gave it (Locust's CSV wraps it in its class)."""
    wrapper = "CatchResponseError("
    if error.startswith(wrapper) and error.endswith(")"):
        error = error[len(wrapper) : -1].strip("'\"")
    return error


def as_seconds(milliseconds: str) -> str:
    try:
        return f"{float(milliseconds) / 1000:.2f}"
    except ValueError:  # "N/A": no successful request
        return "-"


def offered(run: Run) -> dict[str, float]:
    """Questions per second offered, by request name: each user class's share of the users
    (exact when the users are a multiple of the weights' sum) times the rate per user."""
    per_weight = run.users / sum(WEIGHTS.values()) * run.rate
    return {name: WEIGHTS[kind] * per_weight for kind, name in QUESTION_NAMES.items()}


def unexpected_failures(out: Path) -> list[dict[str, str]]:
    failures = read_csv(out / f"{CSV_PREFIX}_failures.csv")
    return [row for row in failures if reason(row["Error"]) not in DESIGNED]


def _requests_table(stats: list[dict[str, str]], run: Run) -> list[str]:
    """Rates over the load time: every request is sent within it (after it no task starts)."""
    offer = offered(run)
    lines = [
        "| type | name | requests | failures | sent/s | answered/s | offered/s "
        "| p50 s | p95 s | p99 s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    sent = answered = 0
    for row in stats:
        if row["Type"] == "TTFM" or row["Name"] == "Aggregated":  # the latter counts TTFM too
            continue
        count, failures = int(row["Request Count"]), int(row["Failure Count"])
        rate = f"{offer[row['Name']]:.3f}" if row["Name"] in offer else "-"
        lines.append(
            f"| {row['Type']} | `{row['Name']}` | {count} | {failures} | "
            f"{count / run.seconds:.3f} | {(count - failures) / run.seconds:.3f} | {rate} | "
            f"{as_seconds(row['50%'])} | {as_seconds(row['95%'])} | {as_seconds(row['99%'])} |"
        )
        if row["Name"] in offer:
            sent, answered = sent + count, answered + count - failures
    lines += [
        "",
        f"Questions: offered {sum(offer.values()):.3f}/s ({run.users} users x {run.rate:g}/s), "
        f"sent {sent / run.seconds:.3f}/s, answered {answered / run.seconds:.3f}/s. Locust is "
        "closed-loop: a user asks again only when its answer is back, so a saturated service "
        "lowers the rate sent instead of queueing more. Latencies count failed requests too.",
    ]
    return lines


def _ttfm_table(stats: list[dict[str, str]]) -> list[str]:
    rows = [row for row in stats if row["Type"] == "TTFM"]
    if not rows:
        return ["No margin arrived."]
    lines = [
        "From sending a streamed `POST /wim` to its first `margin` event.",
        "",
        "| name | first margins | p50 s | p95 s | p99 s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| `{row['Name']}` | {row['Request Count']} | {as_seconds(row['50%'])} | "
            f"{as_seconds(row['95%'])} | {as_seconds(row['99%'])} |"
        )
    return lines


def _failures_table(out: Path) -> list[str]:
    failures = read_csv(out / f"{CSV_PREFIX}_failures.csv")
    if not failures:
        return ["None."]
    lines = ["| method | name | reason | count | designed |", "| --- | --- | --- | ---: | --- |"]
    for row in failures:
        why = reason(row["Error"])
        designed = "yes" if why in DESIGNED else "**no**"
        lines.append(
            f"| {row['Method']} | `{row['Name']}` | {why} | {row['Occurrences']} | {designed} |"
        )
    return lines


def _metrics_table(out: Path) -> list[str]:
    rows = read_csv(out / "metrics.csv")
    if not rows:
        return ["No /metrics sample."]
    lines = [
        f"{len(rows)} samples of `GET /metrics`, every 5 s and one at the end (sums over the "
        "replicas; `vllm_kv_cache_usage_perc` is their mean).",
        "",
        "| metric | peak | mean |",
        "| --- | ---: | ---: |",
    ]
    for column in SNAPSHOT_COLUMNS:
        values = [float(row[column]) for row in rows]
        lines.append(f"| `{column}` | {max(values):g} | {fmean(values):.3g} |")
    return lines


def summarize(out: Path, run: Run) -> str:
    stats = read_csv(out / f"{CSV_PREFIX}_stats.csv")
    plural = "s" if run.replicas > 1 else ""
    lines = [
        f"# Load test: {run.replicas} engine replica{plural}, {run.users} users at "
        f"{run.rate:g} questions/s each",
        "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; the service was ready after "
        f"{run.startup_s:.0f} s; load for {run.seconds:g} s; `nproc` {run.nproc}; Locust's exit "
        f"status {run.locust_status} (1 after any failure, designed refusals included).",
        "",
        "Load average (`uptime`):",
        "",
        *(f"- {moment}: `{uptime}`" for moment, uptime in run.loads.items()),
        "",
        "## Requests",
        "",
        *_requests_table(stats, run),
        "",
        "## Time to first margin",
        "",
        *_ttfm_table(stats),
        "",
        "## Failures by reason",
        "",
        *_failures_table(out),
        "",
        "## Sessions and KV over the run",
        "",
        *_metrics_table(out),
        "",
        "Settled after the run (no session, no reserved KV): "
        + ("yes" if run.settled else "**no**"),
        "",
        "## Commands",
        "",
        "```bash",
        *run.commands,
        "```",
        "",
        f"Files in this folder: Locust's `{CSV_PREFIX}_*.csv` and `report.html`, `metrics.csv`, "
        "`locust.log`, `service.log`, `serve_config.yaml`.",
    ]
    return "\n".join(lines) + "\n"


# -- the run -------------------------------------------------------------------------------


def output(command: str) -> str:
    return subprocess.run([command], capture_output=True, text=True, check=False).stdout.strip()


def port_taken(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def measure_command(args: argparse.Namespace) -> list[str]:
    """This run's own command, every option spelled out."""
    return [
        ".venv/bin/python",
        "loadtest/measure.py",
        *("--replicas", str(args.replicas), "--out", str(args.out), "--port", str(args.port)),
        *("--minutes", f"{args.minutes:g}", "--users", str(args.users), "--rate", f"{args.rate:g}"),
    ]


def locust_command(args: argparse.Namespace, url: str) -> list[str]:
    out = args.out
    return [
        sys.executable,
        "-m",
        "locust",
        "-f",
        "loadtest/locustfile.py",
        "--headless",
        "--only-summary",
        "--host",
        url,
        "--users",
        str(args.users),
        "--spawn-rate",
        str(args.users),  # all at once: the arrival rate holds from the start
        "--run-time",
        f"{round(args.minutes * 60)}s",
        "--stop-timeout",
        str(STOP_TIMEOUT_S),
        "--csv",
        str(out / CSV_PREFIX),
        "--html",
        str(out / "report.html"),
        "--wim-rate",
        f"{args.rate:g}",
        "--wim-metrics-csv",
        str(out / "metrics.csv"),
    ]


def run_locust(command: list[str], log: Path, timeout_s: float) -> int:
    with log.open("wb") as output:
        locust = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
        try:
            return locust.wait(timeout_s)
        except subprocess.TimeoutExpired:
            locust.kill()
            return locust.wait(30)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, choices=(1, 2), required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for reports (created)")
    parser.add_argument("--port", type=int, default=8770, help="port of the service started")
    parser.add_argument("--minutes", type=float, default=5.0, help="load time (default 5)")
    weights = sum(WEIGHTS.values())
    parser.add_argument(
        "--users", type=int, default=4, help=f"Locust users, a multiple of {weights} (default 4)"
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=DEFAULT_RATE,
        help=f"questions per second per user (default {DEFAULT_RATE})",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=900, help="seconds to wait for the replicas"
    )
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= HARD_MAX_MINUTES:
        parser.error(f"--minutes must be in (0, {HARD_MAX_MINUTES}]")
    if args.users <= 0 or args.users % weights:
        parser.error(f"--users must be a positive multiple of {weights}: one user class each")
    if not 0 < args.rate <= MAX_RATE:  # as the locustfile checks it, but before the service starts
        parser.error(f"--rate must be in (0, {MAX_RATE}] per second")
    if port_taken(args.port):
        parser.error(f"something already listens on 127.0.0.1:{args.port}; pick --port")
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    url = require_loopback(f"http://127.0.0.1:{args.port}")
    config = args.out / "serve_config.yaml"
    write_config(config, args.port, args.replicas)
    command = locust_command(args, url)
    wim = Path(sys.executable).with_name("wim")
    commands = [
        shlex.join(measure_command(args)),
        f"# the service it started: deploy/serve_config.yaml on 127.0.0.1:{args.port}, "
        f"EngineReplica num_replicas {args.replicas}, no autoscaling",
        shlex.join([str(wim), "serve", "--config", str(config)]),
        "# the load",
        shlex.join(command),
    ]
    loads = {"before the service started": output("uptime")}
    print(f"starting the service on {url} (log: {args.out / 'service.log'})", flush=True)
    service = start_service(config, args.out / "service.log")
    try:
        probe = httpx.Client(base_url=url, timeout=60)
        wait_ready(probe, args.replicas, args.startup_timeout)
        startup_s = time.monotonic() - began
        loads["at the load's start"] = output("uptime")
        print(f"load for {args.minutes:g} min: {shlex.join(command)}", flush=True)
        bound_s = args.minutes * 60 + STOP_TIMEOUT_S + 120
        status = run_locust(command, args.out / "locust.log", bound_s)
        loads["at the load's end"] = output("uptime")
        try:
            quiet = settled(probe, SETTLE_TIMEOUT_S)
        except httpx.HTTPError as exc:  # a service that died under load has not settled
            print(f"/metrics unreadable after the load: {exc!r}", flush=True)
            quiet = False
    finally:
        print("stopping the service", flush=True)
        stop_service(service)
    run = Run(
        replicas=args.replicas,
        users=args.users,
        rate=args.rate,
        seconds=round(args.minutes * 60),
        startup_s=startup_s,
        commands=commands,
        loads=loads,
        nproc=int(output("nproc") or 0),
        settled=quiet,
        locust_status=status,
    )
    summary = summarize(args.out, run)
    (args.out / "summary.md").write_text(summary)
    print(summary)
    print(f"measure.py took {(time.monotonic() - began) / 60:.1f} min", flush=True)
    return 0 if quiet and not unexpected_failures(args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
