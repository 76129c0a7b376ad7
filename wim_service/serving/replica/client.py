"""Calls from the router to named engine replicas.

`ReplicaClient` is what the router's logic needs: the live replica set, one named replica as a
typed `ReplicaProtocol` (`replica(name)`), and `ReplicaLost` when that replica has gone. The
Serve implementation sends each call by name through the engine deployment's handle, pinned
with `PinnedReplicaRouter`; tests inject fakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any, Protocol

from pydantic import TypeAdapter

from wim_service.serving.replica.protocol import CallsByName, ReplicaProtocol
from wim_service.wim.errors import ErrorCode, WiMError
from wim_service.wim.events import WiMEvent

ENGINE_DEPLOYMENT = "EngineReplica"
# Retry-After for a replica whose request queue is full.
RETRY_AFTER_S = 5.0
_EVENT: TypeAdapter[WiMEvent] = TypeAdapter(WiMEvent)


class ReplicaLost(RuntimeError):
    """The replica a call went to died, left, or could not be reached.

    `transient`: it could not be reached just now but may well be alive (Ray's
    ActorUnavailableError): worth a retry before the replica is given up.
    """

    def __init__(self, replica: str, cause: BaseException, *, transient: bool = False) -> None:
        super().__init__(f"engine replica {replica} was lost: {type(cause).__name__}")
        self.replica = replica
        self.transient = transient


class ReplicaClient(Protocol):
    # replica -> calls this router has open on it (a leaving replica with calls is draining)
    in_flight: dict[str, int]

    async def live_replicas(self) -> frozenset[str]: ...

    def replica(self, name: str) -> ReplicaProtocol:
        """The replica `name`; its calls raise `ReplicaLost` once it has gone."""
        ...


class ServeReplicaClient(CallsByName):
    """`ReplicaClient` over the engine deployment's Serve handle."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # DeploymentHandle of EngineReplica
        self.in_flight: dict[str, int] = {}

    async def live_replicas(self) -> frozenset[str]:
        from wim_service.serving.replica.pinning import live_replicas

        replicas = live_replicas(ENGINE_DEPLOYMENT)
        if not replicas:
            # The pinning router learns the replica set on the handle's first call.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await self.engine.load.remote()
            replicas = live_replicas(ENGINE_DEPLOYMENT)
        return replicas

    def _remote(self, replica: str, method: str, args: tuple[Any, ...], stream: bool) -> Any:
        """Send one call pinned to `replica`, under an internal request id of its own.

        Serve gives a handle call the internal request id of the request it is made in, and its
        request router matches the replica it picked back to the pending call *by that id*.
        Concurrent calls from one request (load polls of every replica, claims, metrics) then
        share one id: a replica chosen for one call could be handed to another, and calls sat
        unanswered for minutes although their replica was idle. A fresh id per call keeps each
        pinned call and its replica together.
        """
        from ray.serve._private.utils import generate_request_id
        from ray.serve.context import _get_serve_request_context, _serve_request_context

        from wim_service.serving.replica.pinning import target_key

        handle = self.engine.options(
            method_name=method, stream=stream, session_id=target_key(replica)
        )
        own = dataclasses.replace(
            _get_serve_request_context(), _internal_request_id=generate_request_id()
        )
        token = _serve_request_context.set(own)  # type: ignore[arg-type]  # (typed None in Ray)
        try:
            return handle.remote(*args)
        finally:
            _serve_request_context.reset(token)

    async def call(self, replica: str, method: str, *args: Any) -> Any:
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
        response = self._remote(replica, method, args, stream=False)
        try:
            return await response
        except asyncio.CancelledError:
            # Serve cancels an assigned call only when asked: without this, a document read
            # whose client went away ran on to its end and held its KV for nobody.
            with contextlib.suppress(Exception):
                response.cancel()
            raise
        except _lost_errors() as exc:
            raise _lost(replica, exc) from exc
        except _backpressure() as exc:
            raise _full(replica) from exc
        finally:
            self.in_flight[replica] -= 1

    async def stream(self, replica: str, method: str, *args: Any) -> AsyncIterator[WiMEvent]:
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
        response = self._remote(replica, method, args, stream=True)
        try:
            async for item in response:
                yield _EVENT.validate_python(item)
        except _lost_errors() as exc:
            raise _lost(replica, exc) from exc
        except _backpressure() as exc:
            raise _full(replica) from exc
        finally:
            # A client gone mid-stream cancels the replica's job: it closes its context. On a
            # call that failed, Serve's cancel raises that failure again (a replica gone
            # before the call was sent), which would replace the ReplicaLost raised above:
            # the job then failed as an engine error instead of failing over.
            with contextlib.suppress(Exception):
                response.cancel()
            self.in_flight[replica] -= 1


def _lost_errors() -> tuple[type[BaseException], ...]:
    """Failures that mean "the replica is gone", not "the job is bad": the session moves."""
    from ray.exceptions import RayActorError

    from wim_service.serving.replica.contracts import EngineDead
    from wim_service.serving.replica.pinning import ReplicaGone

    # RayActorError covers ActorDiedError and ActorUnavailableError; Ray re-raises the
    # replica's EngineDead as an instance of EngineDead.
    return (ReplicaGone, RayActorError, EngineDead)


def _backpressure() -> type[BaseException]:
    from ray.serve.exceptions import BackPressureError

    return BackPressureError


def _full(replica: str) -> WiMError:
    """The replica's request queue is full (`max_queued_requests`): overloaded, retry."""
    return WiMError(
        ErrorCode.OVERLOADED,
        f"engine replica {replica} has too many queued requests; retry later",
        retry_after_s=RETRY_AFTER_S,
    )


def _lost(replica: str, exc: BaseException) -> ReplicaLost:
    from ray.exceptions import ActorUnavailableError

    from wim_service.serving.replica.pinning import ReplicaUnreachable

    unreachable = isinstance(exc, (ActorUnavailableError, ReplicaUnreachable))
    return ReplicaLost(replica, exc, transient=unreachable)
