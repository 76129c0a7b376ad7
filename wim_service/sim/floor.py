"""The least time to first token any placement could give a trace's requests.

Each request is costed alone on an idle replica that caches every prefix an earlier request
of the trace prefilled (a cache without eviction) and, for a WiM query, holds its document if
an earlier WiM query read it (the first one of each document reads it first, as every policy
must): only its own prefill and margins remain, as the engine runs them alone (`alone_s`).
A query that arrives while its document's first read still runs waits for the rest of it: no
replica holds the document's KV sooner (a read of its own, begun later, would end later).
No policy at any fleet size serves a request sooner under
the profile's costs, so this floor tells what placement can still win on a trace: where the
floor's p95 is above half of a policy's p95, no placement halves that p95.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from wim_service.placement.policy import first_token_s
from wim_service.placement.profile import EngineProfile
from wim_service.placement.state import PrefixCache, ReplicaState, Work
from wim_service.sim.jobs import work_for
from wim_service.sim.report import percentile
from wim_service.sim.settings import SimSettings
from wim_service.sim.traces import Trace


def ttft_floor(trace: Trace, profile: EngineProfile, settings: SimSettings) -> dict[int, float]:
    """Each placeable request's least TTFT, by its index in the trace (requests larger than a
    replica's KV are left out, as the replay never places them)."""
    capacity = profile.kv_capacity_tokens // profile.block_tokens
    seen = PrefixCache(sys.maxsize)
    idle = ReplicaState("floor", free_blocks=0, free_sessions=0, prefix_cache=seen)
    floors: dict[int, float] = {}
    read_ends: dict[str, float] = {}  # document -> when its first read ends, at the soonest
    for request in trace.requests:
        work = work_for(request, profile, settings, trace.block_tokens)
        if work.kv_blocks + work.document_blocks > capacity:
            continue
        if request.margins is not None:  # the margins its row says are written
            work = replace(work, margins=request.margins)
        document, read_s = work.document, 0.0
        if document is not None and document not in read_ends:
            # Its first read, from its text: nothing of it was saved yet.
            read_s = profile.read_seconds(work.document_tokens, saved=False)
            read_ends[document] = request.arrival_s + read_s
        elif document is not None:  # the rest of its first read, if it still runs
            read_s = max(0.0, read_ends[document] - request.arrival_s)
        floors[request.index] = read_s + alone_s(profile, work, idle)
        seen.insert(work.prefix)
    return floors


def alone_s(profile: EngineProfile, work: Work, idle: ReplicaState) -> float:
    """`work`'s first token alone on the idle replica, its document (if any) held, as its
    engine gives it: a document query's margins and its answer's prefill with the margins'
    notes (`EngineProfile.lone_query_seconds`). The policy's own estimate (`first_token_s`)
    leaves the notes out, which only shifts every holder alike; a floor that left them out
    would not be one any placement can reach."""
    if work.document is None:
        return first_token_s(profile, work, idle)
    query_tokens = work.prompt_tokens - work.document_tokens
    return profile.lone_query_seconds(
        work.document_tokens, query_tokens, work.margins, work.margin_tokens
    )


def floor_line(floors: dict[int, float]) -> str:
    """The floor's percentiles, as `wim sim` prints them under its table."""
    p50, p95, p99 = (percentile(list(floors.values()), q) for q in (50, 95, 99))
    if p50 is None or p95 is None or p99 is None:
        return "floor: no request fits a replica"
    return (
        f"floor: TTFT p50 {p50:.2f} s, p95 {p95:.2f} s, p99 {p99:.2f} s (each request alone "
        "on a replica caching every earlier prefix: no placement does better)"
    )
