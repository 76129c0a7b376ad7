"""The engine replica's remote interface: the methods the router calls on one replica.

`EngineReplica` implements `ReplicaProtocol` (mypy checks it, `replica/deployment.py`), and so
do the tests' fake replicas. The router reaches a replica through `ReplicaClient.replica(name)`,
which answers a `ReplicaProtocol` for that one replica: every call is a typed method.

Underneath, a Serve handle takes a method's name (`handle.options(method_name=...)`), pinned to
the replica by `replica/pinning.py`: `NamedReplica` is the one place that turns a typed call
into a call by name (`ByName.call` / `ByName.stream`), each method sending its own name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, cast, runtime_checkable

from wim_service.serving.replica.contracts import OpenResult, ReplicaLoad
from wim_service.serving.replica.plain import PlainParams
from wim_service.wim.events import WiMEvent
from wim_service.wim.options import WiMOptions


@runtime_checkable
class ReplicaProtocol(Protocol):
    """What one engine replica answers. The streamed methods are async generators: the
    caller going away cancels the replica's job."""

    async def load(self) -> ReplicaLoad:
        """What the router places sessions by (answered from memory, promptly)."""
        ...

    async def claim(self, document_ids: list[str], orphan_timeout_s: float) -> int:
        """A router holds these sessions; the replica reaps the ones nobody claims."""
        ...

    async def metrics_text(self) -> str:
        """The engine's `vllm:*` metrics and the replica's own, as Prometheus text."""
        ...

    def run(self, document: str, query: str, options: WiMOptions) -> AsyncIterator[WiMEvent]:
        """A one-shot WiM job."""
        ...

    def complete(self, prompt_ids: list[int], params: PlainParams) -> AsyncIterator[WiMEvent]:
        """A plain request (no WiM): answer deltas, then `done`."""
        ...

    async def open_document(
        self,
        document_id: str,
        document: str,
        options: WiMOptions,
        tenant: str = "",
        restore: bool = False,
    ) -> OpenResult:
        """Read a document into a pinned context: its size, or why not. With a KV store, its
        KV is saved under (`tenant`, `document_id`) as it is read; `restore` loads it from
        there instead when it was saved (a rebuild or a copy: a new document has none)."""
        ...

    def query_document(
        self, document_id: str, query: str, options: WiMOptions
    ) -> AsyncIterator[WiMEvent]:
        """A query on a pinned document (`not_found` if it is not on this replica)."""
        ...

    async def close_document(self, document_id: str) -> bool:
        """Close a pinned document; False if it was not here."""
        ...


class ByName(Protocol):
    """Calls to one named replica by method name (what a Serve handle takes)."""

    async def call(self, replica: str, method: str, *args: Any) -> Any: ...

    def stream(self, replica: str, method: str, *args: Any) -> AsyncIterator[WiMEvent]: ...


class NamedReplica:
    """`ReplicaProtocol` for the replica `name`, over calls by name."""

    def __init__(self, calls: ByName, name: str) -> None:
        self.calls, self.name = calls, name

    async def load(self) -> ReplicaLoad:
        return cast(ReplicaLoad, await self.calls.call(self.name, "load"))

    async def claim(self, document_ids: list[str], orphan_timeout_s: float) -> int:
        return cast(int, await self.calls.call(self.name, "claim", document_ids, orphan_timeout_s))

    async def metrics_text(self) -> str:
        return cast(str, await self.calls.call(self.name, "metrics_text"))

    def run(self, document: str, query: str, options: WiMOptions) -> AsyncIterator[WiMEvent]:
        return self.calls.stream(self.name, "run", document, query, options)

    def complete(self, prompt_ids: list[int], params: PlainParams) -> AsyncIterator[WiMEvent]:
        return self.calls.stream(self.name, "complete", prompt_ids, params)

    async def open_document(
        self,
        document_id: str,
        document: str,
        options: WiMOptions,
        tenant: str = "",
        restore: bool = False,
    ) -> OpenResult:
        result = await self.calls.call(
            self.name, "open_document", document_id, document, options, tenant, restore
        )
        return cast(OpenResult, result)

    def query_document(
        self, document_id: str, query: str, options: WiMOptions
    ) -> AsyncIterator[WiMEvent]:
        return self.calls.stream(self.name, "query_document", document_id, query, options)

    async def close_document(self, document_id: str) -> bool:
        return cast(bool, await self.calls.call(self.name, "close_document", document_id))


class CallsByName(ByName, Protocol):
    """Base of a replica client whose calls go by name: `replica(name)` types them."""

    def replica(self, name: str) -> ReplicaProtocol:
        return NamedReplica(self, name)


def _checked(replica: NamedReplica) -> ReplicaProtocol:
    return replica  # mypy: NamedReplica implements every method of the protocol
