"""Document sessions as the router keeps them: the text (to rebuild a session anywhere), the
options fixed when it was read, and its expiry."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from wim_service.serving.api import DocumentResponse
from wim_service.serving.errors import HTTPFailure, ServiceCode
from wim_service.wim.options import WiMOptions

# Options that shape a document's KV: fixed when the document is read.
DOCUMENT_FIELDS = ("segment_tokens", "max_segment_tokens")
DOCUMENT_PROMPTS = ("system", "document")


@dataclass
class DocumentRecord:
    """A document session: enough to rebuild it on any replica."""

    document_id: str
    text: str
    options: WiMOptions
    ttl_s: float
    tenant: str = ""
    context_tokens: int = 0
    segments: int = 0
    last_used: float = field(default_factory=time.time)
    # Held while the session is (re)bound to a replica, so that two failing-over requests do
    # not rebuild it twice.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def expires_at(self) -> float:
        return self.last_used + self.ttl_s

    def touch(self) -> None:
        self.last_used = time.time()

    def expired(self, now: float) -> bool:
        return self.expires_at < now

    def response(self, replica: str) -> DocumentResponse:
        return DocumentResponse(
            document_id=self.document_id,
            context_tokens=self.context_tokens,
            segments=self.segments,
            expires_at=self.expires_at,
            replica=replica,
        )


def check_document_options(fixed: WiMOptions, asked: WiMOptions) -> None:
    """A query may change per-query options only; those that shaped the KV are refused."""
    changed = [
        f
        for f in DOCUMENT_FIELDS
        if f in asked.model_fields_set and getattr(asked, f) != getattr(fixed, f)
    ]
    if "prompts" in asked.model_fields_set:
        changed += [
            f"prompts.{p}"
            for p in DOCUMENT_PROMPTS
            if getattr(asked.prompts, p) != getattr(fixed.prompts, p)
        ]
    if changed:
        raise HTTPFailure(
            ServiceCode.OPTIONS_FIXED,
            f"{', '.join(changed)} were fixed when the document was read; "
            "upload the document again to change them",
        )


class DocumentTable:
    """The router's document sessions, in this process."""

    def __init__(self) -> None:
        self._records: dict[str, DocumentRecord] = {}

    def add(self, record: DocumentRecord) -> None:
        self._records[record.document_id] = record

    def get(self, document_id: str) -> DocumentRecord | None:
        """The live session, or None if unknown or expired."""
        record = self._records.get(document_id)
        if record is None or record.expired(time.time()):
            return None
        return record

    def remove(self, document_id: str) -> None:
        self._records.pop(document_id, None)

    def count(self, tenant: str) -> int:
        return sum(1 for r in self._records.values() if r.tenant == tenant)

    def expired(self, now: float) -> list[DocumentRecord]:
        return [r for r in self._records.values() if r.expired(now)]
