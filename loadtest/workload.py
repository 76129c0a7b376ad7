"""What the Locust users send, and in what mix: shared by the locustfile and by measure.py.

Kept free of Locust (which patches the standard library with gevent on import), so that
measure.py and the tests can read it.
"""

from __future__ import annotations

from pathlib import Path

DOCUMENT = (Path(__file__).resolve().parent.parent / "examples" / "harbor_report.txt").read_text()
QUESTIONS = (
    "What is the access code for the night gate?",
    "How many people does the port employ directly?",
    "How many passengers did the ferry to the islands carry?",
    "Why was spending on maintenance higher than planned?",
    "When is the harbour office open?",
    "How many apprentices trained at the port this year?",
)
QUERIES_PER_SESSION = (2, 5)
# Each task run of a user asks one question; these are the Locust request names of the
# questions, by user class. Locust spreads the users over the classes by weight.
QUESTION_NAMES = {
    "OneShotUser": "/wim one-shot",
    "SessionUser": "/wim session",
    "OpenAIUser": "/v1/chat/completions",
}
WEIGHTS = {"OneShotUser": 1, "SessionUser": 2, "OpenAIUser": 1}
DEFAULT_RATE = 0.05  # questions per second per user (`--wim-rate`)
MAX_RATE = 100
# Refusals the service gives by design under load, each a failure under its own name.
REFUSALS = {429: "429 overloaded", 503: "503 unavailable"}
