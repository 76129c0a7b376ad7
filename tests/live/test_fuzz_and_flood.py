"""Schema fuzzing and a flood on the real stack (`tests/harness/live_stack.py`): schemathesis
finds no server error and no schema violation in the API, and a flood beyond capacity gets
only 2xx, 429 and 503, after which the service recovers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.harness.live_stack import (
    BASE,
    MAIN,
    OPTIONS,
    QUERY,
    auth,
    serve_log_failures,
)
from tests.live.test_hostile import (
    assert_recovered,
    client,  # noqa: F401
    problems_of,
)

pytestmark = [pytest.mark.serving, pytest.mark.timeout(1800)]
LIVE_APP = MAIN

# Examples per operation and generation mode, and a bound on the whole run (seconds).
FUZZ_EXAMPLES = 25


FUZZ_SECONDS = 900


# Positive examples run real jobs: keep their generation short (the options' upper bounds are
# covered by the matrix above).
FUZZ_MAX_TOKENS = 8


def tame(body: Any) -> None:
    """Cap what a valid generated body asks the engine to generate."""
    if not isinstance(body, dict):
        return
    options = body.get("options")
    for holder, names in (
        (options, ("margin_max_tokens", "answer_max_tokens")),
        (body, ("max_tokens", "max_completion_tokens")),
    ):
        if isinstance(holder, dict):
            for name in names:
                if isinstance(holder.get(name), int):
                    holder[name] = min(holder[name], FUZZ_MAX_TOKENS)


def test_schemathesis_finds_no_server_error_and_no_schema_violation(
    client: httpx.Client,  # noqa: F811
) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
    ]
    schemathesis.serializer.alias("application/pdf", "application/octet-stream")  # /extract/pdf
    schema = schemathesis.openapi.from_url(f"{BASE}/openapi.json")
    deadline = time.monotonic() + FUZZ_SECONDS
    failures: dict[str, str] = {}  # what failed (operation, status, check): an example
    statuses: Counter[int] = Counter()

    def run(case: Any, positive: bool) -> None:
        if time.monotonic() > deadline:
            return
        if positive:
            tame(case.body)
        response = case.call(base_url=BASE, headers=auth("alpha"), timeout=300)
        statuses[response.status_code] += 1
        if response.status_code == 201 and isinstance(response.json(), dict):
            document_id = response.json().get("document_id")
            if document_id:  # a generated session: close it, so that the next ones fit
                client.delete(f"/documents/{document_id}")
        try:
            case.validate_response(response, checks=checks, headers=auth("alpha"))
        except FailureGroup as group:
            for failure in group.exceptions:
                what = f"{case.operation.label} [{response.status_code}] {failure.title}"
                failures.setdefault(what, str(group)[:1500])

    bounded = settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )

    def fuzzer(operation: Any, mode: schemathesis.GenerationMode) -> Callable[[], None]:
        @bounded
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case: Any) -> None:
            run(case, positive=mode == schemathesis.GenerationMode.POSITIVE)

        return fuzz

    for result in schema.get_all_operations():
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            with contextlib.suppress(Unsatisfiable):  # nothing to make invalid: no parameters
                fuzzer(result.ok(), mode)()
    print(f"schemathesis statuses: {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= 50, statuses
    assert not failures, "\n".join(failures) + "\n\n" + "\n\n".join(failures.values())
    assert_recovered(client)


FLOOD_JOBS = 60


FLOOD_CLIENT_DEADLINE_S = 45


def test_a_flood_beyond_capacity_gets_only_2xx_429_503(
    client: httpx.Client,  # noqa: F811
    report: str,
) -> None:
    """60 concurrent one-shot jobs on the report (a replica holds 4 sessions): each is
    answered, refused for capacity (429) or for waiting too long (503), or given up by its
    client; nothing else, and nothing stays reserved."""

    async def flood() -> tuple[Counter[int], int]:
        body = {"context": report, "query": QUERY, "options": OPTIONS}
        async with httpx.AsyncClient(
            base_url=BASE, timeout=FLOOD_CLIENT_DEADLINE_S, headers=auth("alpha")
        ) as c:
            results = await asyncio.gather(
                *(c.post("/wim", json=body) for _ in range(FLOOD_JOBS)), return_exceptions=True
            )
        statuses = Counter(r.status_code for r in results if isinstance(r, httpx.Response))
        for r in results:
            if isinstance(r, httpx.Response) and r.status_code != 200:
                try:
                    code = r.json().get("code", "")
                except ValueError:
                    code = ""  # problems_of names a body that is not JSON
                problems = problems_of(r, r.status_code, code)
                assert not problems, f"{problems}\nServe's logs:\n{serve_log_failures()}"
        given_up = [r for r in results if isinstance(r, httpx.TimeoutException)]
        others = [r for r in results if isinstance(r, BaseException) and r not in given_up]
        assert not others, others[:3]
        return statuses, len(given_up)

    statuses, given_up = asyncio.run(flood())
    print(f"flood: statuses {dict(statuses)}, {given_up} given up by the client")
    assert set(statuses) <= {200, 429, 503}, statuses
    assert statuses[429] + statuses[503] > 0, "the flood never went past capacity"
    assert sum(statuses.values()) + given_up == FLOOD_JOBS
    assert_recovered(client)
