"""`wim sim`: a discrete-event replay of a request trace over N simulated engine replicas,
placed by the same policies (`wim_service.placement`) that the live router runs.

Modules: `traces` (Mooncake and WiM document traces into one record), `generate` (synthetic
document traces), `engine` (one replica's time line), `jobs` (how a request runs on it),
`replay` (the event loop, placement and the queue for room), `report` (the summary table),
`floor` (the TTFT no placement beats).

What the model simplifies, on purpose:

* Costs are the `EngineProfile`'s fitted formulas, not a model run: a prefill costs
  `prefill.seconds(new, cached)`, a decode step `decode.step_seconds(batch, context)`; a
  copy of a document read before, a restore of its KV (`restore`, unless `--no-restore-copies`)
  or else its prefill (`EngineProfile.read_seconds`, as the live placement charges it).
* An engine does one thing at a time: prefills one after another (first queued, first run),
  and between them decode runs of the whole batch. A prefill pauses decoding (no chunked-prefill
  overlap); it waits only for the decode step under way.
* KV is reserved per job at placement for its worst case (prompt, margins and answer) and given
  back when it ends; a document copy holds its blocks and one query's until retired (idle
  `copy_idle_s`, or at once when a job finds no room and its document has another copy, as
  the live router's `DocumentCopies.reclaim`). Queries take turns in the copy's query
  blocks; one arriving while another runs starts at once beside it in blocks of its own if
  the engine has them free (as a live session does; the jobs waiting for room elsewhere are
  not consulted). Cached
  prefixes live in the KV no copy holds, as an LRU of the trace's hash blocks (Mooncake's 512
  tokens; a document trace's documents in the engine's 32-token KV blocks, as vLLM caches them),
  and never block a placement: vLLM evicts them on demand.
* A document's first WiM row opens its session first: the read is placed on its own, and that
  row's query and any arriving meanwhile are placed when it ends (as the live client opens a
  session, then asks).
* Session slots (the service's max_sessions) are taken by each copy; a plain request takes
  none (as on a live engine, it reserves KV only); placement sees free KV, free slots, each
  replica's exact prefix cache, and its backlog as a live replica reports it: each placed
  job's expected cost less the time it has run (`placement/backlog.py`; a query that opens
  a copy books its read, then itself), not the engine's exact queue, which no live replica
  knows. Placement takes those reports as the router takes its replicas': every
  `load_poll_s` and again before a refusal or a copy (`placement/polls.py`), with what it
  placed since booked on top (`placement/ledger.py`).
* A query opens a copy by the router's rules (`placement/copies.py`): one read of a document
  at a time, the copy taking queries once read; a query whose copy may not open, or that the
  policy finds no room for, runs on its session's primary, unbooked.
* A WiM query's margins (one per segment, or its trace row's `margins`: the others skipped)
  are one prefill of every margin prompt over the document's KV, then decode side by side in
  the batch; the answers WiM starts beside them (`answer_early`) are the profile's
  `query_extra_tokens`, prefilled with the answer after the margins; no margin is judged or
  dropped, every answer decodes its full `answer_tokens`, and nothing fails or is cancelled
  but by a lost replica or the deadline (below).
* Admission is the service's: a new session or job no replica has room for (after idle spare
  copies were reclaimed, as the live router's `reclaim`) is refused, `429` with Retry-After
  (`SimSettings.retry_after_s`), and so is a call to a replica past the engine deployment's
  queue bound (`replica_calls` at once, `queued_calls` more queued at the router); its
  client sends it again after the Retry-After as often as its trace row's `retries` says (the
  replay's `retries` for rows that say none). A refused session's read takes its waiting
  queries with it. A query of a document some replica holds needs no new room and queues at
  its copy, as a live query waits its session's turn. A request larger than an empty
  replica's KV is counted as too large, never placed.
* A replica may be lost at a given time (`simulate(..., losses=...)`, `wim sim
  --lose-replica T:INDEX`), as the live router sees one die: placement no longer sees it,
  its copies are gone (a session whose primary it held is taken over by its first live copy,
  or read again at its next query, restored), the reads and queries on it are placed again,
  and a plain request on it fails (503, counted with the refused unless its client retries).
  The live router fails a session over at its next query; the replay at the loss.
* A job still running `deadline_s` (the router's `request_timeout_s`) after it was sent is
  stopped as the router stops it (504 `deadline_exceeded`): its engine aborts it (its queued
  prefills go, its sequences leave the batch after the step under way, a prefill under way
  ends unused), it gives back its KV and its copy's turn, its booking ends, and a copy it
  opened and had not read is closed with its cancelled read. It counts as `timed_out`, not
  answered. The clock starts at each send (a retry after a `429` starts it again; a query
  failed over keeps it); a session's read has none (`POST /documents` has no deadline), and
  its query's clock starts once it is read, as the client asks then. Goodput counts the
  answers that end within `deadline_s` of their request's first send.

Speed: 64 replicas over the shipped 4,000-request Mooncake trace, all three policies, in a few
seconds (`scripts/bench_sim.sh`).
"""
