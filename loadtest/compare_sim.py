"""Check `wim sim` against the real service: one trace replayed live and simulated, per
placement policy, and their TTFT p50/p95 side by side.

    .venv/bin/python loadtest/compare_sim.py --out /tmp/wim-compare
    .venv/bin/python loadtest/compare_sim.py --calibrate --policies sticky,expected_wait --out DIR

For each policy: start the service on 127.0.0.1:`--port` from deploy/serve_config.yaml with
2 engine replicas (no autoscaling), each on a core of its own (`cpu_threads_bind: rank`),
`args.router.placement: <policy>` and the profile as its `cost_profile`; wait until both
replicas are ready, replay the trace (loadtest/replay.py, at most `--replay-minutes`), stop
the service with every process it started; then simulate the trace in-process, as
`wim sim --trace FILE --replicas 2 --policies <policy> --profile P.json` does (the replay's
time scale, segment and margin sizes), and print per policy the live and simulated TTFT p50
and p95 and goodput (answers per second; a refused request, 429, is none), their relative
difference, whether each is within `--tolerance`, the requests refused, and the median live
over simulated time of the trace's plain rows that prefilled their whole prompt (about 1 when
the engines ran at the profile's speed: on 4 December the VM came up on a CPU with AVX-512
BF16, `dtype: auto` ran bfloat16 there, and the engines ran 2.4x faster than the float32
profile measured before).

The profile must describe the engines as they run here: one engine on one core, in the dtype
the serve config's `dtype: auto` picks on this CPU. The default is the one shipped for that
(`placement/profiles/one-core.json`, measured on the development machine in bfloat16, on a CPU
with AVX-512 BF16); `--calibrate` measures this machine's first (12 minutes on 4 December), with the
serve config's engine settings and `rank` binding; `--profile` reuses one, with a warning
when its dtype is not the engines' here. (`wim sim`'s own
default, `default.json`, describes one engine with both cores: two engines sharing both cores
each ran about half as fast while the other worked.)

Everything goes to `--out`: the trace, the profile measured, each serve config and service
log, `live-<policy>.json` (replay.py's report, a record per request), `sim-<policy>.json`
(`wim sim --json-out`'s row, plus each request's simulated first-token time by trace row),
`comparison.json` (with `uptime` at the start and end of each live replay).

Budget on the 2-core machine: the default trace (no `--trace`, `DEFAULT_TRACE`) has 15
requests within 3 minutes: 5 users asking 3 each, 40 s apart on average, over 3 documents of
1,500-3,000 tokens, a quarter of the queries plain, 24-token queries, 16-token answers. Each
policy takes the engines' start-up (1-2 min; 120 s at load average 4), the documents'
preparation (10-20 s), at most `--replay-minutes` (3.5) of replay and the shutdown (~15 s):
about 12 minutes for the 3 policies (4 December 08:26-08:38, load average 1-3), plus the
calibration. Run it on an otherwise idle machine.
Ctrl-C or SIGTERM stops the replay (its sessions closed) and the service.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import psutil
from local_service import (
    ROOT,
    serve_config,
    start_service,
    stop_service,
    wait_ready,
    write_config,
)
from measure import output, port_taken

from wim_service.cli.lifecycle import run_subprocess
from wim_service.engine.config import EngineConfig
from wim_service.placement.policy import POLICIES, policy_name
from wim_service.placement.profile import EngineProfile
from wim_service.sim.generate import GeneratorOptions, generate, write_trace
from wim_service.sim.replay import simulate
from wim_service.sim.report import summarise
from wim_service.sim.settings import SimSettings
from wim_service.sim.traces import Trace, TraceError, read_trace

REPLICAS = 2
# Each engine replica on a core of its own (`cpu_threads_bind: rank`): the simulator's replicas
# are independent machines, and two engines sharing the 2 cores (the serve config's `nobind`)
# each ran about half as fast while the other worked (4 December: 1.7-3.5x, median 2.2x, the
# simulated first-token times while both replicas were busy; docs/routing.md).
ENGINE = {"cpu_threads_bind": "rank"}
# The profile of one such engine, measured with `--calibrate` on the 2-core machine.
ONE_CORE_PROFILE = ROOT / "wim_service" / "placement" / "profiles" / "one-core.json"
REPLAY = Path(__file__).resolve().with_name("replay.py")
WIM = Path(sys.executable).with_name("wim")
# WiM's sizes, the same for the live replay and the simulator.
SEGMENT_TOKENS = 512
MARGIN_TOKENS = 16
# Small enough for a few minutes per policy on 2 cores; documents shared by several users.
DEFAULT_TRACE = GeneratorOptions(
    requests=15,
    rate=0.2,
    documents=3,
    zipf_exponent=0.0,
    queries_per_session=3,
    think_s=40.0,
    document_tokens=(1500, 3000),
    query_tokens=24,
    answer_tokens=16,
    wim_fraction=0.75,
    duration_s=180.0,
    # replay.py's needle documents hold what a query asks in one segment, and `margin_skip`
    # writes no margin for the others: each WiM query of the first run wrote one margin.
    margins=1,
)


class Stopped(Exception):
    """SIGTERM: unwind as Ctrl-C does, through every `finally` that stops something."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Stopped


# -- one live run --------------------------------------------------------------------------


def service_tree(service: subprocess.Popen[bytes]) -> list[psutil.Process]:
    try:
        return psutil.Process(service.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stop_everything(service: subprocess.Popen[bytes], tree: list[psutil.Process]) -> list[int]:
    """Stop the service (`wim serve` ends Serve and its Ray), then kill what of `tree` (its
    processes seen while it ran: raylet, workers, EngineCores) outlived it. The pids
    killed."""
    stop_service(service)
    _, alive = psutil.wait_procs(tree, timeout=10)
    for process in alive:
        process.kill()
    return [process.pid for process in alive]


def run_replay(args: argparse.Namespace, policy: str, url: str, report: Path) -> int:
    command = [
        sys.executable,
        str(REPLAY),
        *("--url", url, "--trace", str(args.trace), "--json-out", str(report)),
        *("--policy-label", policy, "--max-minutes", f"{args.replay_minutes:g}"),
        *("--time-scale", f"{args.time_scale:g}"),
        *("--segment-tokens", str(SEGMENT_TOKENS), "--margin-max-tokens", str(MARGIN_TOKENS)),
    ]
    replay = subprocess.Popen(command, cwd=ROOT)
    try:
        return replay.wait()
    except KeyboardInterrupt:
        # A terminal's Ctrl-C reached the replay too (same process group): it is closing its
        # sessions; a signal from here as well would cut that short.
        _wait_or_kill(replay)
        raise
    except Stopped:
        replay.send_signal(signal.SIGTERM)  # it closes its sessions, then exits
        _wait_or_kill(replay)
        raise


def _wait_or_kill(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def live(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """Start the service with `policy`, replay the trace on it, stop it."""
    url = f"http://127.0.0.1:{args.port}"
    config = args.out / f"serve_config-{policy}.yaml"
    router = {"placement": policy, "cost_profile": str(args.profile)}
    write_config(config, args.port, REPLICAS, router, ENGINE)
    log = args.out / f"service-{policy}.log"
    print(f"[{policy}] starting the service on {url} (log: {log})", flush=True)
    loads = {"before the service started": output("uptime")}
    began = time.monotonic()
    service = start_service(config, log)
    tree: list[psutil.Process] = []
    report = args.out / f"live-{policy}.json"
    report.unlink(missing_ok=True)
    run: dict[str, Any] = {"status": None, "startup_s": None, "uptime": loads}
    try:
        with httpx.Client(base_url=url, timeout=30) as probe:
            wait_ready(probe, REPLICAS, args.startup_timeout)
        run["startup_s"] = time.monotonic() - began
        tree = service_tree(service)
        loads["replay start"] = output("uptime")
        run["status"] = run_replay(args, policy, url, report)
        loads["replay end"] = output("uptime")
    except SystemExit as exc:  # not ready in time: no live figures for this policy
        print(f"[{policy}] {exc}", flush=True)
    finally:
        tree = tree + service_tree(service)
        print(f"[{policy}] stopping the service", flush=True)
        run["killed_after_stop"] = stop_everything(service, tree)
    result = json.loads(report.read_text()) if report.exists() else {}
    result.pop("records", None)  # they stay in live-<policy>.json
    return run | result


# -- the simulator -------------------------------------------------------------------------


def simulated(args: argparse.Namespace, trace: Trace, policy: str) -> dict[str, Any]:
    """The simulator's row for `policy` on the trace, also written to sim-<policy>.json."""
    print(f"[{policy}] simulating {REPLICAS} replicas", flush=True)
    settings = SimSettings(
        segment_tokens=SEGMENT_TOKENS,
        margin_tokens=MARGIN_TOKENS,
        side_by_side_kv_reserve=live_engine().side_by_side_kv_reserve,
    )
    scaled = trace.scaled(args.time_scale)
    result = simulate(scaled, policy, REPLICAS, EngineProfile.load(args.profile), settings)
    row = summarise(result)
    # Each request's first-token time, by its row in the trace (as live-<policy>.json has them).
    ttft = {o.index: round(o.first_token_s - o.arrival_s, 3) for o in result.outcomes}
    report = row | {"ttft_s_by_row": [ttft.get(i) for i in range(len(trace.requests))]}
    (args.out / f"sim-{policy}.json").write_text(json.dumps(report, indent=1) + "\n")
    return row


# -- the comparison ------------------------------------------------------------------------


def relative(sim: float | None, live: float | None) -> float | None:
    return None if sim is None or not live else (sim - live) / live


# What is compared: (row key, the reports' key).
COMPARED = (("p50_s", "ttft_p50_s"), ("p95_s", "ttft_p95_s"), ("goodput", "goodput_per_s"))


def compare(policy: str, live_run: dict[str, Any] | None, sim: dict[str, Any] | None) -> dict:
    row: dict[str, Any] = {"policy": policy}
    for name, key in COMPARED:
        row[f"live_{name}"] = (live_run or {}).get(key)
        row[f"sim_{name}"] = (sim or {}).get(key)
        row[f"rel_diff_{name}"] = relative(row[f"sim_{name}"], row[f"live_{name}"])
    row["live_refused"] = (live_run or {}).get("refused")
    row["sim_refused"] = (sim or {}).get("refused")
    return row


def within(row: dict[str, Any], tolerance: float) -> str:
    diffs = [row[f"rel_diff_{name}"] for name, _ in COMPARED]
    if None in diffs:
        return "-"
    return "yes" if all(abs(d) <= tolerance for d in diffs) else "no"


def comparison_table(rows: list[dict[str, Any]], tolerance: float) -> str:
    def cell(value: Any, percent: bool = False) -> str:
        if value is None:
            return "-"
        return f"{value:+.0%}" if percent else f"{value:.2f}"

    header = ["policy", "live p50", "live p95", "sim p50", "sim p95", "diff p50", "diff p95"]
    header += ["live goodput/s", "sim goodput/s", "diff goodput", "refused live/sim"]
    header += [f"within {tolerance:.0%}?", "plain rows live/sim"]
    lines = [header]
    for row in rows:
        lines.append(
            [
                row["policy"],
                *(cell(row[k]) for k in ("live_p50_s", "live_p95_s", "sim_p50_s", "sim_p95_s")),
                cell(row["rel_diff_p50_s"], True),
                cell(row["rel_diff_p95_s"], True),
                cell(row["live_goodput"]),
                cell(row["sim_goodput"]),
                cell(row["rel_diff_goodput"], True),
                "/".join(
                    "-" if n is None else str(n) for n in (row["live_refused"], row["sim_refused"])
                ),
                within(row, tolerance),
                cell(row.get("plain_live_over_sim")),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines
    )


# -- main ----------------------------------------------------------------------------------


def live_engine() -> EngineConfig:
    """One engine replica's settings as the live service runs them here."""
    return EngineConfig(**(serve_config()["applications"][0]["args"]["engine"] | ENGINE))


def dtype_warning(profile: EngineProfile, engine: EngineConfig) -> str | None:
    """Why the profile cannot describe the live engines, if its dtype is not theirs on this
    CPU (a float32 profile against bfloat16 engines put a 4 December run 2.4x off)."""
    mismatch = profile.dtype_mismatch(engine.cpu_dtype())
    if mismatch is None:
        return None
    return (
        f"compare_sim: warning: {mismatch} here (dtype: {engine.dtype_label()}): the "
        "simulated times will not describe them; use --calibrate"
    )


def calibrate_profile(path: Path) -> int:
    """`wim calibrate` of one engine with the live service's engine settings, into `path`;
    its status."""
    flags = shlex.split(" ".join(live_engine().cli_argv()))
    print(f"calibrating one engine ({ENGINE}) into {path}", flush=True)
    return run_subprocess([str(WIM), "calibrate", "--out", str(path), *flags], os.environ)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for every report")
    parser.add_argument("--trace", type=Path, help="JSONL trace (default: a 3-minute one)")
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated (default: all three)"
    )
    parser.add_argument("--port", type=int, default=8772, help="port of the service started")
    parser.add_argument("--replay-minutes", type=float, default=3.5, help="per policy")
    parser.add_argument("--time-scale", type=float, default=1.0, help="see replay.py")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--tolerance", type=float, default=0.25, help="relative (default 25%%)")
    parser.add_argument("--skip-live", action="store_true", help="simulate only")
    parser.add_argument(
        "--profile",
        type=Path,
        default=ONE_CORE_PROFILE,
        help="engine profile for the simulator and the live router (default: the shipped "
        "one-core profile)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="first measure the profile of one engine as the live service runs it (one core; "
        "longer than the 8.4 minutes it takes with both cores) into OUT/profile.json, and use it",
    )
    args = parser.parse_args(argv)
    args.policies = [policy_name(p.strip()) for p in args.policies.split(",") if p.strip()]
    if unknown := [p for p in args.policies if p not in POLICIES]:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if not args.skip_live and port_taken(args.port):
        parser.error(f"something already listens on 127.0.0.1:{args.port}; pick --port")
    args.out = args.out.resolve()
    return args


def prepare_trace(args: argparse.Namespace) -> Trace:
    """The trace to compare on (the default one written to --out); a bad trace, or one that is
    not a WiM document trace, stops here, before any service starts."""
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trace is None:
        args.trace = args.out / "trace.jsonl"
        write_trace(generate(DEFAULT_TRACE), args.trace)
        print(f"wrote the default trace to {args.trace}", flush=True)
    args.trace = args.trace.resolve()
    trace = read_trace(args.trace)
    if trace.kind != "document":
        raise TraceError(f"{args.trace} is a {trace.kind} trace: the replay needs a WiM one")
    last = trace.requests[-1].arrival_s
    print(f"trace: {len(trace.requests)} requests over {last:.0f} s", flush=True)
    return trace


def plain_speed(args: argparse.Namespace, trace: Trace, policy: str) -> float | None:
    """The median of live over simulated first-token time of the trace's plain rows that
    prefilled their whole prompt (nothing of it cached live): a prefill and little else, so
    about 1 when the engines ran at the profile's speed (another CPU or dtype moves it:
    0.47-0.55 on 4 December against a profile of float32 engines). A cached row is left out:
    its time is mostly the engine's fixed cost, and a trace of cached rows put this at 0.47
    with the engines at the profile's speed (5 December). None without such rows live."""
    live_file, sim_file = args.out / f"live-{policy}.json", args.out / f"sim-{policy}.json"
    if not live_file.exists() or not sim_file.exists():
        return None
    simulated_s = json.loads(sim_file.read_text())["ttft_s_by_row"]
    ratios = sorted(
        record["ttft_s"] / simulated_s[record["row"]]
        for record in json.loads(live_file.read_text())["records"]
        if record["ttft_s"]
        and simulated_s[record["row"]]
        and not trace.requests[record["row"]].wim
        and not record.get("cached_tokens")
    )
    return ratios[len(ratios) // 2] if ratios else None


def run_policy(args: argparse.Namespace, trace: Trace, policy: str) -> dict[str, Any]:
    live_run = None if args.skip_live else live(args, policy)
    sim = simulated(args, trace, policy)
    speed = None if args.skip_live else plain_speed(args, trace, policy)
    return {
        "policy": policy,
        "live": live_run,
        "sim": sim,
        **compare(policy, live_run, sim),
        "plain_live_over_sim": speed,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trace = prepare_trace(args)
    except TraceError as exc:
        print(f"compare_sim: {exc}", file=sys.stderr)
        return 2
    if args.calibrate:
        args.profile = args.out / "profile.json"
        if status := calibrate_profile(args.profile):
            return status
    elif not args.profile.is_file():
        print(f"compare_sim: no profile at {args.profile}; use --calibrate", file=sys.stderr)
        return 2
    warning = dtype_warning(EngineProfile.load(args.profile), live_engine())
    if warning:
        print(warning, file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    results = []
    try:
        for policy in args.policies:
            results.append(run_policy(args, trace, policy))
    except (KeyboardInterrupt, Stopped) as exc:
        print("stopped: the service and the replay have been stopped", flush=True)
        return 143 if isinstance(exc, Stopped) else 130
    finally:
        report = {"trace": str(args.trace), "tolerance": args.tolerance, "policies": results}
        (args.out / "comparison.json").write_text(json.dumps(report, indent=1) + "\n")
    print(comparison_table(results, args.tolerance))
    print(f"reports in {args.out}")
    return 0 if all(within(r, args.tolerance) == "yes" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
