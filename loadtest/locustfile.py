"""Locust load test for wim_service: one-shot WiM requests and document sessions.

Run it from the repository root (see loadtest/README.md):

    .venv/bin/locust --config loadtest/locust.conf

It only ever targets loopback (the process exits when the host is anything else) and stops by
itself: after --run-time (5 minutes in locust.conf), and in any case after MAX_RUN_SECONDS or
MAX_REQUESTS, whichever comes first.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import gevent
from locust import HttpUser, between, events, task
from locust.env import Environment
from locust.exception import StopUser
from loopback import NotLoopbackError, require_loopback

# Hard caps, whatever the command line says; the environment may only lower them.
MAX_RUN_SECONDS = min(1800, int(os.environ.get("WIM_LOADTEST_MAX_SECONDS", 1800)))
MAX_REQUESTS = min(5000, int(os.environ.get("WIM_LOADTEST_MAX_REQUESTS", 5000)))
# A WiM request prefills a whole document and writes a margin per segment: slow on CPU.
REQUEST_TIMEOUT_S = 600
QUERIES_PER_SESSION = (2, 5)

DOCUMENT = (Path(__file__).resolve().parent.parent / "examples" / "harbor_report.txt").read_text()
QUESTIONS = (
    "What is the access code for the night gate?",
    "How many people does the port employ directly?",
    "How many passengers did the ferry to the islands carry?",
    "Why was spending on maintenance higher than planned?",
    "When is the harbour office open?",
    "How many apprentices trained at the port this year?",
)

log = logging.getLogger(__name__)


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

    def on_request(self, **_: Any) -> None:
        self.requests += 1
        if self.requests == MAX_REQUESTS:
            self.stop(f"the {MAX_REQUESTS} request cap")

    def stop(self, reason: str) -> None:
        quit_run(self.environment, reason)


@events.init.add_listener
def _install_guard(environment: Environment, **_: Any) -> None:
    # An exception in an init listener makes Locust exit before any user starts.
    if environment.host is not None:
        require_loopback(environment.host)
    guard = _Guard(environment)
    environment.events.test_start.add_listener(guard.on_test_start)
    environment.events.request.add_listener(guard.on_request)


def _describe(response: Any) -> str:
    return f"{response.status_code}: {response.error or response.text[:200]}"


def _json(response: Any) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class WiMUser(HttpUser):
    abstract = True
    wait_time = between(1, 5)

    def on_start(self) -> None:
        try:
            require_loopback(self.host)
        except NotLoopbackError as refused:
            quit_run(self.environment, str(refused))
            raise StopUser() from None

    def ask(self, request: dict[str, Any], name: str) -> None:
        """POST /wim; a reply without an answer counts as a failure (429s under their own name)."""
        with self.client.post(
            "/wim", json=request, name=name, timeout=REQUEST_TIMEOUT_S, catch_response=True
        ) as response:
            if response.status_code == 429:
                response.failure("429 overloaded")
            elif response.status_code != 200 or "answer" not in _json(response):
                response.failure(_describe(response))


class OneShotUser(WiMUser):
    """Sends the whole document with each question: POST /wim."""

    weight = 1

    @task
    def one_shot(self) -> None:
        self.ask({"context": DOCUMENT, "query": random.choice(QUESTIONS)}, "/wim one-shot")


class SessionUser(WiMUser):
    """Uploads the document once, asks several questions on it, then deletes it."""

    weight = 2

    @task
    def session(self) -> None:
        with self.client.post(
            "/documents",
            json={"context": DOCUMENT},
            timeout=REQUEST_TIMEOUT_S,
            catch_response=True,
        ) as response:
            document_id = _json(response).get("document_id")
            if document_id is None:
                response.failure(_describe(response))
                return
        try:
            for question in random.sample(QUESTIONS, random.randint(*QUERIES_PER_SESSION)):
                self.ask({"document_id": document_id, "query": question}, "/wim session")
        finally:
            self.client.delete(f"/documents/{document_id}", name="/documents/[id]")
