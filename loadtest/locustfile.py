"""Locust load test for wim_service: one-shot WiM requests, document sessions and OpenAI chat
completions, each user asking questions at a constant rate.

Run it from the repository root (see loadtest/README.md):

    .venv/bin/locust --config loadtest/locust.conf --wim-rate 0.05

It only ever targets loopback (the process exits when the host is anything else) and stops by
itself: after --run-time (5 minutes in locust.conf), and in any case after MAX_RUN_SECONDS or
MAX_REQUESTS, whichever comes first.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import random
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import gevent
import requests
from local_service import SNAPSHOT_COLUMNS, snapshot
from locust import HttpUser, constant_throughput, events, task
from locust.env import Environment
from locust.exception import StopUser
from locust.stats import CSV_STATS_INTERVAL_SEC
from loopback import NotLoopbackError, require_loopback
from workload import (
    DEFAULT_RATE,
    DOCUMENT,
    MAX_RATE,
    QUERIES_PER_SESSION,
    QUESTION_NAMES,
    QUESTIONS,
    REFUSALS,
    WEIGHTS,
)

from wim_service.serving.errors import status_of

# Hard caps, whatever the command line says; the environment may only lower them.
MAX_RUN_SECONDS = min(1800, int(os.environ.get("WIM_LOADTEST_MAX_SECONDS", 1800)))
MAX_REQUESTS = min(5000, int(os.environ.get("WIM_LOADTEST_MAX_REQUESTS", 5000)))
# A WiM request prefills a whole document and writes a margin per segment: slow on CPU.
REQUEST_TIMEOUT_S = 600
METRICS_EVERY_S = 5
# The entry type of the time from sending a streamed request to its first margin event.
TTFM = "TTFM"
ANSWER_TOKENS = 64  # the OpenAI user's `max_tokens`: WiM's default answer_max_tokens

log = logging.getLogger(__name__)


# -- options -------------------------------------------------------------------------------


def _rate(value: str) -> float:
    try:
        rate = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 < rate <= MAX_RATE:
        raise argparse.ArgumentTypeError(f"{value} is not a rate in (0, {MAX_RATE}] per second")
    return rate


def _csv_path(value: str) -> Path:
    path = Path(value)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of {value!r} does not exist")
    return path


@events.init_command_line_parser.add_listener
def _options(parser: Any, **_: Any) -> None:
    # Off the web UI, which would hand the values over as untyped text.
    parser.add_argument(
        "--wim-rate",
        type=_rate,
        default=DEFAULT_RATE,
        include_in_web_ui=False,
        help="questions per second per user (constant throughput; offered rate = users x "
        f"rate while answers come faster than that). Default {DEFAULT_RATE}.",
    )
    parser.add_argument(
        "--wim-key",
        default=os.environ.get("WIM_LOADTEST_KEY"),
        include_in_web_ui=False,
        help="API key sent as `Authorization: Bearer` (default: env WIM_LOADTEST_KEY)",
    )
    parser.add_argument(
        "--wim-metrics-csv",
        type=_csv_path,
        include_in_web_ui=False,
        help="append a row of the service's /metrics (sessions, KV, replicas) to this CSV "
        f"file every {METRICS_EVERY_S} s",
    )


def _auth(environment: Environment) -> dict[str, str]:
    key = environment.parsed_options.wim_key
    return {"Authorization": f"Bearer {key}"} if key else {}


# -- guard and sampler ---------------------------------------------------------------------


def quit_run(environment: Environment, reason: str) -> None:
    """End the whole run. From a greenlet of its own: `quit` kills every user greenlet, and the
    caller may be one of them."""
    log.warning("load test stops: %s", reason)
    if environment.runner is not None:
        gevent.spawn(environment.runner.quit)


class _Guard:
    """The loopback check and the hard caps of one Locust run."""

    def __init__(self, environment: Environment) -> None:
        self.environment = environment
        self.requests = 0

    def on_test_start(self, **_: Any) -> None:
        # The web UI can change the host just before a run starts: check it again.
        try:
            require_loopback(self.environment.host)
        except NotLoopbackError:
            self.stop("a host that is not loopback")
            raise
        gevent.spawn_later(MAX_RUN_SECONDS, self.stop, f"the {MAX_RUN_SECONDS} s cap")

    def on_request(self, request_type: str, **_: Any) -> None:
        if request_type == TTFM:  # a mark within a request already counted
            return
        self.requests += 1
        if self.requests == MAX_REQUESTS:
            self.stop(f"the {MAX_REQUESTS} request cap")

    def stop(self, reason: str) -> None:
        quit_run(self.environment, reason)


class _MetricsSampler:
    """A row of /metrics gauges (local_service.SNAPSHOT_COLUMNS) every METRICS_EVERY_S seconds
    while the test runs, and one as it stops. Read outside Locust's client: not a request of the
    load, and not counted against the request cap."""

    def __init__(self, environment: Environment, path: Path) -> None:
        self.environment = environment
        self.path = path
        self.started = time.monotonic()
        self.greenlet: gevent.Greenlet | None = None

    def on_test_start(self, **_: Any) -> None:
        self.started = time.monotonic()
        if not self.path.exists():
            with self.path.open("w", newline="") as out:
                csv.writer(out).writerow(("time", "elapsed_s", *SNAPSHOT_COLUMNS))
        self.greenlet = gevent.spawn(self._run)

    def on_test_stop(self, **_: Any) -> None:
        if self.greenlet is not None:
            self.greenlet.kill()
            self.greenlet = None
            self.sample()

    def _run(self) -> None:
        while True:
            self.sample()
            gevent.sleep(METRICS_EVERY_S)

    def sample(self) -> None:
        url = require_loopback(self.environment.host).rstrip("/") + "/metrics"
        try:
            # The router gathers every replica's metrics: slow on a saturated machine.
            response = requests.get(url, headers=_auth(self.environment), timeout=30)
            response.raise_for_status()
            row = snapshot(response.text)
        except (requests.RequestException, ValueError) as exc:
            log.warning("metrics sample skipped: %s", exc)
            return
        now = datetime.now(UTC).isoformat(timespec="seconds")
        elapsed = round(time.monotonic() - self.started, 1)
        with self.path.open("a", newline="") as out:
            csv.writer(out).writerow((now, elapsed, *(row[c] for c in SNAPSHOT_COLUMNS)))


def _let_the_csv_catch_up(**_: Any) -> None:
    """Locust rewrites its --csv files every CSV_STATS_INTERVAL_SEC and closes them at exit without
    a last write (locust issues #1806, #2299), so requests finished in the last second (those
    that ran into the stop timeout: the slowest) would be missing. Wait for one more write."""
    gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)


@events.init.add_listener
def _install_guard(environment: Environment, **_: Any) -> None:
    # An exception in an init listener makes Locust exit before any user starts.
    if environment.host is not None:
        require_loopback(environment.host)
    guard = _Guard(environment)
    environment.events.test_start.add_listener(guard.on_test_start)
    environment.events.request.add_listener(guard.on_request)
    if environment.parsed_options.csv_prefix:
        environment.events.quit.add_listener(_let_the_csv_catch_up)
    metrics_csv = environment.parsed_options.wim_metrics_csv
    if metrics_csv is not None:
        sampler = _MetricsSampler(environment, metrics_csv)
        environment.events.test_start.add_listener(sampler.on_test_start)
        environment.events.test_stop.add_listener(sampler.on_test_stop)


# -- users ---------------------------------------------------------------------------------


def _describe(response: Any) -> str:
    return REFUSALS.get(response.status_code) or (
        f"{response.status_code}: {response.error or response.text[:200]}"
    )


def _object(text: str) -> dict[str, Any]:
    """`text` as a JSON object, or {} if it is not one."""
    try:
        body = json.loads(text)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _json(response: Any) -> dict[str, Any]:
    return _object(response.text or "")


class WiMUser(HttpUser):
    """Asks one question per task run, at `--wim-rate` task runs per second (Locust's
    constant_throughput: the wait after a task is what remains of 1/rate, none if the task took
    longer, so a slow service lowers the achieved rate)."""

    abstract = True

    def wait_time(self) -> float:
        # constant_throughput keeps its state on the user: a new function each time paces alike.
        return constant_throughput(self.environment.parsed_options.wim_rate)(self)

    def on_start(self) -> None:
        try:
            require_loopback(self.host)
        except NotLoopbackError as refused:
            quit_run(self.environment, str(refused))
            raise StopUser() from None
        self.client.headers.update(_auth(self.environment))

    def post(self, path: str, body: dict[str, Any], name: str, stream: bool = False) -> Any:
        """POST `body` as JSON; the caller decides success (Locust's catch_response)."""
        return self.client.post(
            path,
            json=body,
            name=name,
            timeout=REQUEST_TIMEOUT_S,
            stream=stream,
            catch_response=True,
        )

    def ask(self, request: dict[str, Any], name: str) -> None:
        """POST /wim streamed. The whole request is one entry; the time to its first margin
        event another (type TTFM). It fails on an error event or without a done event."""
        sent = time.perf_counter()
        with self.post("/wim", {**request, "stream": True}, name, stream=True) as response:
            if response.status_code != 200:
                response.failure(_describe(response))
                return
            try:
                outcome = self._read_events(response, name, sent)
            except requests.RequestException as exc:
                outcome = f"stream broken: {exc!r}"
            # Locust timed the response's headers only: the whole stream is the request.
            response.request_meta["response_time"] = (time.perf_counter() - sent) * 1000
            if outcome:
                response.failure(outcome)

    def _read_events(self, response: Any, name: str, sent: float) -> str:
        """Reads the stream to its end; returns why it failed, or "" if it ended with done."""
        event, seen = "", set[str]()
        for line in response.iter_lines(decode_unicode=True):
            if line.startswith("event:"):
                event = line.partition(":")[2].strip()
                if event == "margin" and event not in seen:
                    self.environment.events.request.fire(
                        request_type=TTFM,
                        name=name,
                        response_time=(time.perf_counter() - sent) * 1000,
                        response_length=0,
                        exception=None,
                        context={},
                    )
                seen.add(event)
            elif line.startswith("data:") and event == "error":
                code = _object(line.partition(":")[2]).get("code", "?")
                # A job refused after its stream began (its first event later than the
                # service's heartbeat) is the designed refusal its status would have named.
                return REFUSALS.get(status_of(code)) or f"error event: {code}"
        return "" if "done" in seen else "stream ended without a done event"


class OneShotUser(WiMUser):
    """Sends the whole document with each question: POST /wim."""

    weight = WEIGHTS["OneShotUser"]

    @task
    def one_shot(self) -> None:
        request = {"context": DOCUMENT, "query": random.choice(QUESTIONS)}
        self.ask(request, QUESTION_NAMES["OneShotUser"])


class SessionUser(WiMUser):
    """Uploads the document (POST /documents), asks two to five questions on it, one per task
    run, then deletes it; again and again."""

    weight = WEIGHTS["SessionUser"]
    document_id: str | None = None
    questions: list[str]

    @task
    def question(self) -> None:
        if self.document_id is None and not self._open():
            return
        request = {"document_id": self.document_id, "query": self.questions.pop()}
        self.ask(request, QUESTION_NAMES["SessionUser"])
        if not self.questions:
            self._close()

    def on_stop(self) -> None:
        self._close()

    def _open(self) -> bool:
        with self.post("/documents", {"context": DOCUMENT}, "/documents") as response:
            self.document_id = _json(response).get("document_id")
            if self.document_id is None:
                response.failure(_describe(response))
                return False
        self.questions = random.sample(QUESTIONS, random.randint(*QUERIES_PER_SESSION))
        return True

    def _close(self) -> None:
        if self.document_id is not None:
            document_id, self.document_id = self.document_id, None
            self.client.delete(f"/documents/{document_id}", name="/documents/[id]")


class OpenAIUser(WiMUser):
    """Speaks the OpenAI API: POST /v1/chat/completions with the document as the first user
    turn and the question as the last (docs/openai.md), not streamed."""

    weight = WEIGHTS["OpenAIUser"]
    model = ""

    def on_start(self) -> None:
        super().on_start()
        with self.client.get("/v1/models", catch_response=True) as response:
            models = _json(response).get("data") or [{}]
            self.model = models[0].get("id", "")
            if not self.model:
                response.failure(_describe(response))

    @task
    def chat(self) -> None:
        body = {
            "model": self.model,
            "messages": [
                {"role": "user", "content": DOCUMENT},
                {"role": "user", "content": random.choice(QUESTIONS)},
            ],
            "max_tokens": ANSWER_TOKENS,
        }
        with self.post("/v1/chat/completions", body, QUESTION_NAMES["OpenAIUser"]) as response:
            if response.status_code != 200:
                response.failure(_describe(response))
                return
            reply = _json(response)
            choices = reply.get("choices") or [{}]
            content = choices[0].get("message", {}).get("content")
            usage = reply.get("usage") or {}
            if not isinstance(content, str):
                response.failure("no choices[0].message.content")
            elif not usage.get("prompt_tokens") or not isinstance(
                usage.get("completion_tokens"), int
            ):
                response.failure(f"no usage: {usage}")
