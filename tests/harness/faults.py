"""The load the multi-node fault scenarios run (tests/multinode/) and the figures they report:
a document session, a fixed count of questions in flight when a fault strikes and more sent
right after it, each retried by the client as one following `Retry-After` would.

A client reaches the cluster as docs/deploy.md has it: through a load balancer in front of
port 8000 of every host but the head (`proxy_location: EveryNode`; a router with a question
from the head's proxy answers nothing while the head is away: docs/reliability.md). The
balancer is the client's own (`Balancer`): it sends a request to the first host's proxy and,
when a proxy refuses the connection or does not take it within `CONNECT_TIMEOUT_S`, to the
next host's, as nginx's and Envoy's retry on a failed connect do; a host that failed a connect
is tried last for `PASSIVE_DOWN_S` after (nginx's `max_fails=1 fail_timeout`, Envoy's outlier
detection), and a proxy that sends nothing for `READ_TIMEOUT_S` is given up. A question is
asked as docs/serving.md advises for long answers: streamed (`"stream": true`), so that the
routers' heartbeats let that idle timeout be a few seconds; its answer is the stream's `done`
event. A request lost after it was sent (cut, silent, or ended by a 5xx-kind `error` event)
is the client's to retry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.harness.live_stack import OPTIONS, auth, metric_in, parse_sse, query_body, settled
from tests.harness.multinode import HTTP_PORT, Cluster
from tests.harness.multinode_deploy import serve_config
from wim_service.serving.errors import status_of

# A request is lost when it has no answer after this many attempts, 1 s apart.
RETRIES = 4
# Questions kept in flight through a fault, and sent after it.
IN_FLIGHT = 4
AFTER = 4
CONNECT_TIMEOUT_S = 2.0
# The longest the balancer waits for a proxy's next bytes (nginx's `proxy_read_timeout`): four
# of the routers' heartbeats (`stream_heartbeat_s` in deploy/serve_config_multinode.yaml). A
# request on a connection to a host that was partitioned gets nothing more, and no deadline of
# the service can reach it there; this ends it, for the client to retry.
READ_TIMEOUT_S = 8.0
PASSIVE_DOWN_S = 10.0
# Every host's proxy but the head's, in the balancer's order (docs/deploy.md).
BALANCED_HOSTS = ("r1", "r2", "e1", "e2")
# When each proxy last failed a connect (monotonic s), shared by every client as a balancer's
# view of its upstreams is.
_failed_at: dict[str, float] = {}
_failed_lock = threading.Lock()


def cluster_block_size() -> int:
    """The KV block size of the cluster's engines (`live_stack.from_pinned_kv`), read from
    its serve config when a test asks, not when this module is imported."""
    return int(serve_config()["applications"][0]["args"]["engine"]["block_size"])


class Balancer:
    """The load balancer in front of every host's Serve proxy but the head's."""

    def __init__(self, cluster: Cluster) -> None:
        self.bases = [f"http://{cluster.nodes[name].ip}:{HTTP_PORT}" for name in BALANCED_HOSTS]
        self.client = httpx.Client(
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            headers=auth(),
            trust_env=False,
        )

    def _order(self) -> list[str]:
        """The hosts in order, those that failed a connect within `PASSIVE_DOWN_S` last."""
        now = time.monotonic()
        with _failed_lock:
            down = {b for b, at in _failed_at.items() if now - at < PASSIVE_DOWN_S}
        return sorted(self.bases, key=lambda base: base in down)

    def stream(self, path: str, body: dict[str, Any]) -> tuple[int, str, dict]:
        """A streamed answer read to its end (`streamed`): status, router and body."""
        failed: httpx.TransportError | None = None
        for base in self._order():
            try:
                with self.client.stream("POST", base + path, json=body) as response:
                    return streamed(response)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                with _failed_lock:
                    _failed_at[base] = time.monotonic()
                failed = exc
        assert failed is not None
        raise failed

    def close(self) -> None:
        self.client.close()


def streamed(response: httpx.Response) -> tuple[int, str, dict]:
    """The status of a streamed answer as a client judges it, its router, and its body: the
    `done` event's data (200); an `error` event's code's status; 0 for a stream that ended
    without either (cut)."""
    router = response.headers.get("X-WiM-Router", "")
    if response.status_code != 200:
        return response.status_code, router, {"error": response.read().decode(errors="replace")}
    events = parse_sse("".join(response.iter_text()))
    for kind, data in events:
        if kind == "done":
            return 200, router, data
        if kind == "error":
            return status_of(data["code"]), router, {"error": data}
    return 0, router, {"error": f"the stream ended after {len(events)} events, without an answer"}


@dataclass
class Answer:
    status: int  # of the last attempt; 0: no HTTP answer
    seconds: float  # from the first attempt to the last one's end
    attempts: int
    body: dict
    router: str
    ended: float  # monotonic seconds
    # Why each attempt before the last was retried: its status (0: no HTTP answer), the router
    # that answered it, if any, and its error, so that a failed assertion shows it.
    retried_for: list[str] = field(default_factory=list)


def ask(cluster: Cluster, document_id: str) -> Answer:
    """One question on a document session, streamed, retried on a 5xx (a status or an `error`
    event) or a cut or silent connection."""
    started = time.monotonic()
    status, router, attempts = 0, "", 0
    body: dict = {}
    retried_for: list[str] = []
    balancer = Balancer(cluster)
    try:
        while attempts < RETRIES:
            attempts += 1
            try:
                status, router, body = balancer.stream(
                    "/wim", {**query_body(document_id), "stream": True}
                )
            except httpx.TransportError as exc:
                status, router, body = 0, "", {"error": repr(exc)}
            if status == 200 or 0 < status < 500:
                break
            retried_for.append(f"{status} from {router or 'no router'}: {body.get('error')!s:.300}")
            time.sleep(1.0)
    finally:
        balancer.close()
    ended = time.monotonic()
    return Answer(status, ended - started, attempts, body, router, ended, retried_for)


@dataclass
class Outcome:
    answers: list[Answer]
    fault_s: float  # how long striking the fault took (a node's processes all stopped)
    struck: float  # monotonic seconds when the fault had struck
    fault_to_whole_s: float

    @property
    def lost(self) -> list[Answer]:
        return [a for a in self.answers if a.status != 200]

    @property
    def longest_s(self) -> float:
        return max(a.seconds for a in self.answers)

    @property
    def longest_after_fault_s(self) -> float:
        """From the fault having struck to the latest answer: the questions in flight had run
        a second before it, work the lost node took with it."""
        return max(a.ended for a in self.answers) - self.struck

    def replicas_after(self) -> set[str]:
        """The replicas that answered the questions ending once the fault had struck (one that
        ended while it was striking may still come from the replica it took)."""
        return {a.body["replica"] for a in self.answers if a.ended > self.struck}


def load(
    cluster: Cluster, document_id: str, fault: Callable[[], None]
) -> tuple[list[Answer], float, float]:
    """`IN_FLIGHT` questions running when `fault` strikes, `AFTER` more sent right after it;
    their answers, when the fault began to strike and when it had struck."""
    pool = ThreadPoolExecutor(IN_FLIGHT + AFTER)
    try:
        running = [pool.submit(ask, cluster, document_id) for _ in range(IN_FLIGHT)]
        # Mid-query: the engines are busy with them (one alone takes a second or more).
        time.sleep(1.0)
        striking = time.monotonic()
        fault()
        struck = time.monotonic()
        later = [pool.submit(ask, cluster, document_id) for _ in range(AFTER)]
        return [future.result() for future in running + later], striking, struck
    finally:
        # Not waiting for questions still open when the run stops (a SIGTERM, a failure):
        # the cluster's teardown ends them.
        pool.shutdown(wait=False, cancel_futures=True)


def under_fault(
    cluster: Cluster,
    document_id: str,
    fault: Callable[[], None],
    heal: Callable[[], None],
) -> Outcome:
    """The questions of `load` through `fault`; then `heal` and wait until the cluster is
    whole."""
    answers, striking, struck = load(cluster, document_id, fault)
    heal()
    cluster.wait_whole("the cluster whole again")
    return Outcome(answers, struck - striking, struck, time.monotonic() - striking)


class Later:
    """`action` run `delay_s` after `start()`, as a fault schedule's second step (a link that
    comes back, a GCS restarted); `wait()` returns once it has run, and raises what it
    raised."""

    def __init__(self, delay_s: float, action: Callable[[], None]) -> None:
        self.failed: BaseException | None = None

        def run() -> None:
            try:
                action()
            except BaseException as exc:
                self.failed = exc

        self.timer = threading.Timer(delay_s, run)

    def start(self) -> None:
        self.timer.start()

    def wait(self) -> None:
        self.done(None)

    def done(self, within_s: float | None) -> bool:
        """Whether `action` has run, waiting for it at most `within_s` (None: until it has)."""
        self.timer.join(within_s)
        if self.failed is not None:
            raise self.failed
        return not self.timer.is_alive()


def report(
    record_property: Callable[[str, object], None],
    scenario: str,
    outcome: Outcome,
    normal_s: float,
    more: str = "",
) -> None:
    """The scenario's figures, printed at the end of the run (`figure` properties:
    tests/conftest.py), also under xdist and without -s (docs/reliability.md)."""
    retried = sum(a.attempts > 1 for a in outcome.answers)
    record_property(
        "figure",
        f"[multinode] {scenario}: lost {len(outcome.lost)}/{len(outcome.answers)} "
        f"(retried {retried}), longest {outcome.longest_s:.1f} s vs {normal_s:.1f} s "
        f"normal (the last answer {outcome.longest_after_fault_s:.1f} s after the fault had "
        f"struck), whole again after {outcome.fault_to_whole_s:.1f} s (the fault took "
        f"{outcome.fault_s:.1f} s to strike){more}",
    )


@contextmanager
def session_on(cluster: Cluster, text: str) -> Iterator[dict]:
    """A document session, opened (and timed: `open_s`) and ended; then no session and no KV
    reservation may be left on any replica."""
    with cluster.client() as client:
        started = time.monotonic()
        response = client.post("/documents", json={"context": text, "options": OPTIONS})
        assert response.status_code == 201, response.text
        opened = {**response.json(), "open_s": time.monotonic() - started}
        yield opened
        assert client.delete(f"/documents/{opened['document_id']}").status_code == 204
        cluster.wait_for(lambda: settled(client), "no session or reservation left", 120)


def per_router(client: httpx.Client, name: str, **labels: str) -> dict[str, float]:
    """A metric as each of the two routers counts it (Serve's proxy picks one per scrape)."""
    seen: dict[str, float] = {}
    for _ in range(60):
        response = client.get("/metrics")
        seen[response.headers["X-WiM-Router"]] = metric_in(response.text, name, **labels)
        if len(seen) == 2:
            return seen
    pytest.fail(f"one router answered 60 scrapes in a row: {sorted(seen)}")
