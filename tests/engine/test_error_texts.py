"""Failures reach clients as fixed messages, never as an exception's text (paths, tracebacks,
library internals): an engine failure inside a WiM context, over a stub `AsyncLLM` that fails
(no engine). The orchestrator's and the router's failures are tested in
`tests/wim/test_orchestrator.py`, `tests/serving/routing/test_router_plain.py` and
`tests/serving/routing/test_router_logic.py`."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from wim_service.engine.admission import KVAdmission
from wim_service.engine.vllm_context import VLLMContext
from wim_service.wim.backend import EngineLimits
from wim_service.wim.errors import ErrorCode, WiMError

MARKER = 'Traceback (most recent call last):\n  File "/srv/vllm/engine/core.py", line 9'


class FailingEngine:
    """An `AsyncLLM` whose every request fails with `MARKER`."""

    def generate(self, *_: Any, **__: Any) -> AsyncIterator[Any]:
        async def outputs() -> AsyncIterator[Any]:
            raise RuntimeError(MARKER)
            yield  # an async generator, like AsyncLLM.generate

        return outputs()


async def test_a_failing_push_tells_the_client_no_exception_text(caplog) -> None:
    backend = SimpleNamespace(
        engine=FailingEngine(),
        limits=EngineLimits(max_model_len=4096, block_size=32, concurrent_branches=True),
        timeline=deque(),
        next_request_id=lambda salt, kind: f"{salt}-{kind}",
        admission=KVAdmission(100, 4, 1.0),
        healthy=False,  # nothing to purge in a stub engine
    )
    await backend.admission.acquire(10)
    context = VLLMContext(backend, 10)  # type: ignore[arg-type]
    with pytest.raises(WiMError) as failed:
        await context.extend([1, 2, 3])
    await context.close()
    assert failed.value.code is ErrorCode.ENGINE_ERROR
    message = failed.value.message
    assert message.startswith("the engine failed while it held this document (incident ")
    assert "Traceback" not in message and "/srv/" not in message
    incident = message.removesuffix(" in the server log)").rsplit(" ", 1)[1]
    logged = [r for r in caplog.records if incident in r.getMessage()]
    assert len(logged) == 1 and str(logged[0].exc_info[1]) == MARKER
    assert backend.admission.load().reserved_blocks == 0
