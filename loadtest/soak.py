"""Soak test: a mixed load on the local service for minutes, with the RSS of the router and of
every engine replica sampled, to show that nothing grows without bound.

    .venv/bin/python loadtest/soak.py                  # starts the service on 127.0.0.1:8768
    .venv/bin/python loadtest/soak.py --url http://127.0.0.1:8000 --key sk-...   # targets one

The load: job users send one-shot jobs (the sample report and a short text, some streamed)
and document sessions (open, two queries, delete); one more thread sends malformed requests
and reads and deletes of unknown documents at `--edge-rate` per second. Each RSS figure is a whole
process tree (an engine replica's Ray worker with its vLLM EngineCore), found from the process
that listens on the URL's port: its raylet's descendants titled `ray::ServeReplica:<app>:...`.
Growth compares the median of the first samples after the warm-up with the median of the last.

Exit status 0 only if every process grew less than `--max-growth`, no answer was a 5xx, no
request failed in transport, and no session or KV reservation was left at the end. Loopback
only, bounded by `--minutes` and `--max-requests` (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
from local_service import ROOT, settled, start_service, stop_service, wait_ready, write_config
from loopback import require_loopback

DOCUMENT = (ROOT / "examples" / "harbor_report.txt").read_text()
QUESTIONS = (
    "What is the access code for the night gate?",
    "Who replaced Margaret Oyelaran?",
    "How many boats are registered?",
)
SHORT = "The night gate of the harbour opens with the access code 4417. The day gate has none."
OPTIONS = {"segment_tokens": 192, "margin_max_tokens": 16, "answer_max_tokens": 16}
# Refused before any engine work (4xx): each must leave nothing behind.
BAD_BODIES = (
    b"{not json",
    b'{"context": "x", "query": "\\ud800"}',
    b'{"context": "x", "query": "q", "options": {"stop_token_ids": [999999999]}}',
    b'{"context": "x", "query": "q", "options": {"prompts": {"yes": "Nope", "no": "Nah"}}}',
    b'{"context": "x", "query": "q", "options": {"prompts": {"system": "\\ue000"}}}',
    b'{"context": "   ", "query": "q"}',
)
SAMPLES_PER_END = 3  # samples whose median is the baseline (after warm-up) and the end value
HARD_MAX_REQUESTS = 20_000
HARD_MAX_MINUTES = 60


@dataclass
class Tally:
    """Status counts by kind of request, shared by the load threads."""

    counts: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, budget: int) -> bool:
        with self.lock:
            self.sent += 1
            return self.sent <= budget

    def record(self, kind: str, response: httpx.Response | None, error: str = "") -> None:
        with self.lock:
            if response is None:
                self.counts[f"{kind} transport-error"] += 1
                self.failures.append(f"{kind}: {error}")
                return
            self.counts[f"{kind} {response.status_code}"] += 1
            if response.status_code >= 500:
                self.failures.append(f"{kind}: {response.status_code} {response.text[:200]}")


class Load:
    """One client thread's loop of mixed requests until the deadline or the request budget."""

    def __init__(self, url: str, key: str | None, tally: Tally, seed: int) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(base_url=url, timeout=600, headers=headers)
        self.tally = tally
        self.random = random.Random(seed)

    def call(self, kind: str, method: str, path: str, **kwargs: object) -> httpx.Response | None:
        try:
            response = self.client.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            self.tally.record(kind, None, repr(exc))
            return None
        self.tally.record(kind, response)
        return response

    def one_shot(self) -> None:
        query = self.random.choice(QUESTIONS)
        body = {"context": DOCUMENT, "query": query, "options": OPTIONS}
        self.call("one-shot", "POST", "/wim", json=body)

    def short_one_shot(self) -> None:
        body = {"context": SHORT, "query": QUESTIONS[0], "stream": self.random.random() < 0.5}
        self.call("short one-shot", "POST", "/wim", json=body)

    def session(self) -> None:
        opened = self.call(
            "open", "POST", "/documents", json={"context": DOCUMENT, "options": OPTIONS}
        )
        if opened is None or opened.status_code != 201:
            return
        document_id = opened.json()["document_id"]
        for query in self.random.sample(QUESTIONS, 2):
            body = {"document_id": document_id, "query": query}
            self.call("query", "POST", "/wim", json=body)
        self.call("delete", "DELETE", f"/documents/{document_id}")

    def bad(self) -> None:
        body = self.random.choice(BAD_BODIES)
        headers = {"content-type": "application/json"}
        self.call("bad-input", "POST", "/wim", content=body, headers=headers)

    def unknown(self) -> None:
        self.call("unknown-document", self.random.choice(("GET", "DELETE")), "/documents/doc-0")

    def jobs(self) -> list[tuple[Callable[[], None], int]]:
        """Engine work: the mix of a job user."""
        return [(self.one_shot, 2), (self.short_one_shot, 2), (self.session, 1)]

    def edge(self) -> list[tuple[Callable[[], None], int]]:
        """Requests refused at the edge: many of them, while the jobs run."""
        return [(self.bad, 3), (self.unknown, 1)]

    def run(
        self,
        steps: list[tuple[Callable[[], None], int]],
        deadline: float,
        budget: int,
        pause_s: float,
    ) -> None:
        actions, weights = zip(*steps, strict=True)
        while time.monotonic() < deadline and self.tally.take(budget):
            self.random.choices(actions, weights)[0]()
            time.sleep(pause_s)
        self.client.close()


# -- processes -----------------------------------------------------------------------------


def listener_pid(port: int) -> int:
    for connection in psutil.net_connections("tcp"):
        listening = connection.status == psutil.CONN_LISTEN and connection.laddr.port == port
        if listening and connection.pid:
            return connection.pid
    raise SystemExit(f"no process listens on port {port}")


def service_processes(port: int, app: str) -> dict[str, psutil.Process]:
    """The router and engine replica processes of the Ray cluster that serves `port`, by a
    name that stays the same while the process lives (role and pid)."""
    process: psutil.Process | None = psutil.Process(listener_pid(port))
    while process is not None and process.name() != "raylet":
        process = process.parent()
    if process is None:
        raise SystemExit(f"the process on port {port} is not under a Ray raylet")
    found = {}
    for child in process.children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        for role in ("WiMRouter", "EngineReplica"):
            if f"ServeReplica:{app}:{role}" in title:
                found[f"{role} pid {child.pid}"] = child
    return found


def tree_rss(process: psutil.Process) -> int | None:
    """RSS of a process and its descendants (an engine replica's vLLM EngineCore runs in a
    child process), or None once the process is gone."""
    try:
        members = [process, *process.children(recursive=True)]
        return sum(p.memory_info().rss for p in members if p.is_running())
    except psutil.Error:
        return None


class Sampler(threading.Thread):
    """RSS of every service process every `every_s` seconds, with the time of each sample."""

    def __init__(self, port: int, app: str, every_s: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.port, self.app, self.every_s, self.stop = port, app, every_s, stop
        self.samples: dict[str, list[tuple[float, int]]] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.monotonic()
            try:
                processes = service_processes(self.port, self.app)
            except (SystemExit, psutil.Error) as exc:  # e.g. the proxy is being replaced
                print(f"sampling skipped: {exc}", flush=True)
                processes = {}
            for name, process in processes.items():
                rss = tree_rss(process)
                if rss is not None:
                    self.samples.setdefault(name, []).append((now, rss))
            self.stop.wait(self.every_s)


def growth(samples: list[tuple[float, int]], after: float) -> tuple[int, int, float] | None:
    """(baseline, end, growth) from the samples taken after `after`."""
    late = [rss for t, rss in samples if t >= after]
    if len(late) < 2 * SAMPLES_PER_END:
        return None
    baseline = statistics.median(late[:SAMPLES_PER_END])
    end = statistics.median(late[-SAMPLES_PER_END:])
    return int(baseline), int(end), (end - baseline) / baseline


# -- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running service (loopback); default: start one")
    parser.add_argument("--port", type=int, default=8768, help="port of the service started")
    parser.add_argument("--replicas", type=int, default=1, help="engine replicas started")
    parser.add_argument("--key", default=os.environ.get("WIM_SOAK_API_KEY"), help="API key")
    parser.add_argument("--app", default="wim", help="the Serve application's name")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-minutes", type=float, default=2.0)
    parser.add_argument("--users", type=int, default=3, help="client threads sending jobs")
    parser.add_argument(
        "--edge-rate", type=float, default=4.0, help="refused requests per second (one thread)"
    )
    parser.add_argument("--max-requests", type=int, default=5000)
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--max-growth", type=float, default=0.10)
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= HARD_MAX_MINUTES:
        parser.error(f"--minutes must be in (0, {HARD_MAX_MINUTES}]")
    args.max_requests = min(args.max_requests, HARD_MAX_REQUESTS)
    args.warmup_minutes = min(args.warmup_minutes, args.minutes / 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = None
    replicas = 1  # at least, in a service this did not start
    if args.url is None:
        replicas = args.replicas
        log = Path(tempfile.gettempdir()) / f"wim-soak-{args.port}.log"
        print(f"starting the service on 127.0.0.1:{args.port} (log: {log})", flush=True)
        config = Path(tempfile.mkdtemp(prefix="wim-soak-")) / "serve_config.yaml"
        write_config(config, args.port, args.replicas)
        started = start_service(config, log)
        args.url = f"http://127.0.0.1:{args.port}"
    url = require_loopback(args.url)
    port = urlsplit(url).port or 80
    try:
        return soak(args, url, port, replicas)
    finally:
        if started is not None:
            stop_service(started)


def soak(args: argparse.Namespace, url: str, port: int, replicas: int) -> int:
    probe = httpx.Client(base_url=url, timeout=60)
    wait_ready(probe, replicas, timeout_s=900)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    stop = threading.Event()
    sampler = Sampler(port, args.app, args.sample_s, stop)
    sampler.start()
    tally = Tally()
    begin = time.monotonic()
    deadline = begin + args.minutes * 60
    budget = args.max_requests
    users = [Load(url, args.key, tally, seed) for seed in range(args.users)]
    threads = [threading.Thread(target=u.run, args=(u.jobs(), deadline, budget, 0)) for u in users]
    edge = Load(url, args.key, tally, seed=args.users)
    pause = 1 / args.edge_rate
    threads.append(threading.Thread(target=edge.run, args=(edge.edge(), deadline, budget, pause)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    sampler.join()
    elapsed = time.monotonic() - begin
    print(f"load average at end: {os.getloadavg()}; ran {elapsed / 60:.1f} min")
    quiet = settled(probe, timeout_s=120)
    ok = quiet and not tally.failures
    print("\nstatus counts:")
    for kind, count in sorted(tally.counts.items()):
        print(f"  {kind:<28} {count}")
    print(f"\nRSS growth after {args.warmup_minutes:g} min of warm-up:")
    if not sampler.samples:
        print("  no service process found")
        ok = False
    for name, samples in sorted(sampler.samples.items()):
        measured = growth(samples, begin + args.warmup_minutes * 60)
        if measured is None:
            print(f"  {name:<28} too few samples after warm-up ({len(samples)} in all)")
            continue
        baseline, end, grew = measured
        mark = "ok" if grew < args.max_growth else "TOO MUCH"
        print(f"  {name:<28} {baseline / 2**20:8.1f} MiB -> {end / 2**20:8.1f} MiB "
              f"{grew:+.1%} {mark}")  # fmt: skip
        ok = ok and grew < args.max_growth
    print(f"\nsettled (no session, no reserved KV): {quiet}")
    for failure in tally.failures[:10]:
        print(f"failure: {failure}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
