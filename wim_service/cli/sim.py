"""`wim sim`: replay a trace over simulated replicas through the placement policies
(`wim_service.sim`), or write a synthetic WiM document trace. The engine profile it reads by
default ships with the project; `wim calibrate` measures one.

wim sim --trace wim_service/sim/traces/mooncake_conversation_4000.jsonl.gz --replicas 64
wim sim --trace docs.jsonl --replicas 1,2,4,8 --policies sticky,wim --json-out sim.json
wim sim --generate docs.jsonl --requests 2000 --rate 2 --documents 20 --zipf-exponent 1.2
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from wim_service.cli.lifecycle import refused
from wim_service.placement.policy import POLICIES, policy_name
from wim_service.placement.profile import EngineProfile
from wim_service.sim.floor import floor_line, ttft_floor
from wim_service.sim.generate import GeneratorOptions, generate, write_trace
from wim_service.sim.replay import Loss, simulate
from wim_service.sim.report import percentile, plot_p95, summarise, table
from wim_service.sim.settings import SimSettings, check_bounds
from wim_service.sim.traces import MAX_ARRIVAL_S, read_trace

MAX_REPLICAS = 64
TIME_SCALES = (0.001, 10_000)  # --time-scale's bounds
GENERATOR_DEFAULTS = GeneratorOptions()
SIM_DEFAULTS = SimSettings()


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="simulate placement policies over a trace",
        description="Replay a trace over simulated engine replicas through the placement "
        "policies; or --generate a WiM document trace. `wim calibrate` measures the engine "
        "profile a replay reads.",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--trace", type=Path, help="Mooncake or WiM document trace (.jsonl[.gz])")
    mode.add_argument("--generate", type=Path, metavar="FILE", help="write a WiM document trace")
    _add_replay_arguments(parser)
    _add_generator_arguments(parser)
    parser.set_defaults(main=main)


def _add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replay (--trace)")
    group.add_argument(
        "--replicas", default="8", help="replicas, 1-64, or a list to sweep: 1,2,4,8 (8)"
    )
    group.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="(%(default)s; `wim`, expected_wait's old name, still works)",
    )
    group.add_argument("--profile", type=Path, help="engine profile (default: the shipped one)")
    group.add_argument("--json-out", type=Path, help="also write the rows as a JSON list here")
    group.add_argument(
        "--plot", type=Path, metavar="PNG", help="also plot p95 TTFT against --replicas here"
    )
    group.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply arrival times by this: above 1 spreads the trace for a smaller fleet; "
        f"{TIME_SCALES[0]:g}-{TIME_SCALES[1]:,} (%(default)s)",
    )
    group.add_argument(
        "--kv-capacity-tokens",
        type=int,
        help="KV tokens per replica instead of the profile's (what a bigger KV cache would do)",
    )
    _add_session_arguments(group)
    _add_copy_arguments(group)
    _add_admission_arguments(group)
    group.add_argument(
        "--lose-replica",
        action="append",
        default=[],
        metavar="T:INDEX",
        help="lose replica INDEX (0 is the first) T seconds into the trace (after "
        "--time-scale), as the service loses one whose engine dies; may be repeated",
    )


def _add_session_arguments(group: argparse._ArgumentGroup) -> None:
    d = SIM_DEFAULTS
    group.add_argument(
        "--slots", type=int, default=d.slots, help="session slots per replica (%(default)s)"
    )
    group.add_argument(
        "--copy-idle-s",
        type=float,
        default=d.copy_idle_s,
        help="a document copy unused this long is retired (%(default)s)",
    )
    group.add_argument(
        "--segment-tokens",
        type=int,
        default=d.segment_tokens,
        help="document tokens per WiM segment, one margin each (%(default)s)",
    )
    group.add_argument(
        "--margin-tokens",
        type=int,
        default=d.margin_tokens,
        help="tokens decoded per margin (%(default)s)",
    )
    group.add_argument(
        "--side-by-side-kv-reserve",
        type=float,
        default=d.side_by_side_kv_reserve,
        help="a query runs beside the one in its copy's turn only if this share of the "
        "engine's KV stays free after it, as the engine replicas' side_by_side_kv_reserve "
        "(%(default)s; 0: whenever free)",
    )


def _add_copy_arguments(group: argparse._ArgumentGroup) -> None:
    d = SIM_DEFAULTS
    group.add_argument(
        "--max-copies",
        type=int,
        default=d.max_copies,
        help="copies of one document the expected_wait policy may open (%(default)s)",
    )
    group.add_argument(
        "--restore-copies",
        action=argparse.BooleanOptionalAction,
        default=d.restore_copies,
        help="a copy of a document read before restores its KV, as a service with a KV store "
        "does (the profile's restore cost); --no-restore-copies: it re-reads the document "
        "(default: restore, as ./run.sh runs with a store)",
    )


def _add_admission_arguments(group: argparse._ArgumentGroup) -> None:
    d = SIM_DEFAULTS
    group.add_argument(
        "--retries",
        type=int,
        default=d.retries,
        help="times a refused request (429) is sent again after its Retry-After, for trace "
        "rows that do not say (`retries`) (%(default)s)",
    )
    group.add_argument(
        "--cheapest-first",
        action=argparse.BooleanOptionalAction,
        default=d.cheapest_first,
        help="expected_wait refuses the costliest arrivals first while the fleet is short, as "
        "the service's router does (its cheapest_first); --no-cheapest-first: it refuses only "
        "what finds no room (default: on)",
    )
    group.add_argument(
        "--deadline-s",
        type=float,
        default=d.deadline_s,
        help="a job still running this long after it was sent is stopped, as the service "
        "stops it (its request_timeout_s); an answer later than this after its first send "
        "is not goodput (%(default)s)",
    )


def _add_generator_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("document trace (--generate)")
    d = GENERATOR_DEFAULTS
    group.add_argument("--requests", type=int, default=d.requests, help="rows (%(default)s)")
    group.add_argument("--rate", type=float, default=d.rate, help="queries per second (Poisson)")
    group.add_argument(
        "--documents", type=int, default=d.documents, help="distinct documents (%(default)s)"
    )
    group.add_argument(
        "--zipf-exponent",
        type=float,
        default=d.zipf_exponent,
        help="document popularity: the k-th document is asked 1/k^s as often (%(default)s)",
    )
    group.add_argument(
        "--queries-per-session",
        type=int,
        default=d.queries_per_session,
        help="queries one user asks in a row (%(default)s)",
    )
    group.add_argument("--think-s", type=float, default=d.think_s, help="mean s between queries")
    group.add_argument(
        "--document-tokens", default="{}-{}".format(*d.document_tokens), help="LOW-HIGH"
    )
    group.add_argument("--query-tokens", type=int, default=d.query_tokens, help="(%(default)s)")
    group.add_argument("--answer-tokens", type=int, default=d.answer_tokens, help="(%(default)s)")
    group.add_argument(
        "--wim-fraction",
        type=float,
        default=d.wim_fraction,
        help="share of WiM queries; the rest are plain long-context requests (%(default)s)",
    )
    group.add_argument(
        "--duration-s", type=float, help="leave out the queries arriving after this many s"
    )
    group.add_argument(
        "--margins",
        type=int,
        help="margins each WiM query writes, the other segments skipped (default: every segment's)",
    )
    group.add_argument("--seed", type=int, default=d.seed, help="(%(default)s)")


def main(args: argparse.Namespace) -> int:
    try:
        if args.generate is not None:
            return generate_trace(args)
        return replay(args)
    except (OSError, ValueError) as exc:  # TraceError and pydantic's errors included
        return refused(exc)


def parse_replicas(text: str) -> list[int]:
    shown = text if len(text) <= 40 else f"{text[:30]}..."  # an error stays one short line
    parts = text.split(",")
    if len(parts) > MAX_REPLICAS:  # a sweep's runs and rows, bounded as its fleet sizes are
        raise ValueError(f"--replicas takes at most {MAX_REPLICAS} counts, not {len(parts):,}")
    try:
        counts = [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"--replicas takes counts like 8 or 1,2,4,8, not {shown!r}") from None
    if any(not 1 <= n <= MAX_REPLICAS for n in counts):
        raise ValueError(f"--replicas must be within 1-{MAX_REPLICAS}, not {shown}")
    return counts


def parse_losses(texts: list[str], replicas: int) -> list[Loss]:
    """`--lose-replica`'s T:INDEX pairs, each INDEX one of `replicas` (the sweep's fewest)."""
    if len(texts) > MAX_REPLICAS:
        raise ValueError(f"--lose-replica takes at most {MAX_REPLICAS} losses")
    losses = []
    for text in texts:
        shown = text if len(text) <= 40 else f"{text[:30]}..."
        at, _, index = text.partition(":")
        try:
            loss = (float(at), int(index))
        except ValueError:
            raise ValueError(f"--lose-replica takes T:INDEX, like 300:0, not {shown!r}") from None
        check_bounds(
            [
                ("--lose-replica T", loss[0], 0, MAX_ARRIVAL_S),
                ("--lose-replica INDEX", loss[1], 0, replicas - 1),
            ]
        )
        losses.append(loss)
    return losses


def parse_policies(text: str) -> list[str]:
    names = [policy_name(name.strip()) for name in text.split(",") if name.strip()]
    for name in names or [text]:
        if name not in POLICIES:
            raise ValueError(f"unknown placement policy {name!r}; one of {', '.join(POLICIES)}")
    return names


def settings_from(args: argparse.Namespace) -> SimSettings:
    settings = SimSettings(
        slots=args.slots,
        copy_idle_s=args.copy_idle_s,
        segment_tokens=args.segment_tokens,
        margin_tokens=args.margin_tokens,
        max_copies=args.max_copies,
        restore_copies=args.restore_copies,
        retries=args.retries,
        cheapest_first=args.cheapest_first,
        deadline_s=args.deadline_s,
        side_by_side_kv_reserve=args.side_by_side_kv_reserve,
    )
    settings.check()
    return settings


def profile_from(args: argparse.Namespace) -> EngineProfile:
    if args.profile is not None and not args.profile.is_file():
        raise ValueError(f"no profile file {args.profile}")
    profile = EngineProfile.load(args.profile)
    if args.kv_capacity_tokens is not None:
        if args.kv_capacity_tokens < profile.block_tokens:
            raise ValueError(f"--kv-capacity-tokens must be at least {profile.block_tokens}")
        profile = profile.with_kv_capacity(args.kv_capacity_tokens)
    return profile


def copies_line(profile: EngineProfile, settings: SimSettings) -> str:
    """How a copy of a document read before is charged in this replay."""
    if not settings.restore_copies:
        return "copies re-read their document (--no-restore-copies)"
    if profile.restore is None:
        return "copies re-read their document (the profile has no restore cost)"
    return "copies restore their document's KV"


def replay(args: argparse.Namespace) -> int:
    """Every policy at every fleet size: a table on stdout, the rows as JSON if asked."""
    counts, policies = parse_replicas(args.replicas), parse_policies(args.policies)
    losses = parse_losses(args.lose_replica, min(counts))
    check_bounds([("--time-scale", args.time_scale, *TIME_SCALES)])
    settings, profile = settings_from(args), profile_from(args)
    trace = read_trace(args.trace).scaled(args.time_scale)
    print(
        f"{args.trace}: {len(trace.requests)} {trace.kind} requests, time scale "
        f"{args.time_scale:g}; profile {profile.model} ({profile.machine}), "
        f"{profile.kv_capacity_tokens} KV tokens per replica; {copies_line(profile, settings)}",
        file=sys.stderr,
    )
    floors = ttft_floor(trace, profile, settings)
    floor_p95 = percentile(list(floors.values()), 95)
    rows: list[dict[str, Any]] = []
    for replicas in counts:
        for policy in policies:
            row = summarise(simulate(trace, policy, replicas, profile, settings, losses))
            rows.append(row | {"floor_p95_s": None if floor_p95 is None else round(floor_p95, 3)})
    print(table(rows))
    print(floor_line(floors))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    if args.plot is not None:
        title = f"{args.trace.name}, time scale {args.time_scale:g}"
        plot_p95(rows, args.plot, title=title, floor_s=floor_p95)
    return 0


def generator_options(args: argparse.Namespace) -> GeneratorOptions:
    low, sep, high = args.document_tokens.partition("-")
    try:
        document_tokens = (int(low), int(high if sep else low))
    except ValueError:
        raise ValueError(
            f"--document-tokens takes LOW-HIGH, not {args.document_tokens!r}"
        ) from None
    given = {f.name: getattr(args, f.name) for f in fields(GeneratorOptions)}
    return GeneratorOptions(**{**given, "document_tokens": document_tokens})


def generate_trace(args: argparse.Namespace) -> int:
    rows = generate(generator_options(args))
    write_trace(rows, args.generate)
    documents = len({row["document_id"] for row in rows})
    print(f"wrote {len(rows)} requests over {documents} documents to {args.generate}")
    return 0
