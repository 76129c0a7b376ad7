"""Who a stored document's KV belongs to, and the keys that seal it.

One master key (env `WIM_KV_MASTER_KEY`: base64 of 32 random bytes, from a Secret) derives,
by HKDF-SHA256, one AES-256-GCM key per tenant and one key that names documents in the store.
Every stored object is sealed with its tenant's key and a fresh 96-bit nonce; its associated
data names the tenant, the document, the object (a block's index) and the engine signature, so
an object copied under another tenant, document, index or engine does not open: a failed tag
is a miss (`SealError`), never KV. Store paths carry an HMAC of (tenant, document), not the
ids themselves: a store listing shows neither.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from functools import lru_cache

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

# Named by the algorithm's backend protocol (a context opened for one saves its document).
from wim_service.wim.backend import StoredDocument

MASTER_KEY_ENV = "WIM_KV_MASTER_KEY"
_NONCE_BYTES = 12
_FORMAT = b"wim-kv/1"


class SealError(Exception):
    """A stored object that does not open: tampered, misplaced or sealed under another key."""


def master_key_from_env() -> bytes | None:
    """`WIM_KV_MASTER_KEY` decoded; None when unset. A malformed key is an error."""
    value = os.environ.get(MASTER_KEY_ENV, "").strip()
    if not value:
        return None
    try:
        key = base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{MASTER_KEY_ENV} must be base64 of 32 bytes: {exc}") from exc
    if len(key) != 32:
        raise ValueError(f"{MASTER_KEY_ENV} must be 32 bytes, not {len(key)}")
    return key


def _derive(master: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_FORMAT, info=info).derive(master)


class KVCipher:
    """Seals and opens stored KV objects under per-tenant keys derived from one master key."""

    def __init__(self, master: bytes) -> None:
        if len(master) != 32:
            raise ValueError(f"the KV master key must be 32 bytes, not {len(master)}")
        self._master = master
        self._names = _derive(master, b"document names")
        self._aead = lru_cache(maxsize=256)(self._tenant_aead)

    def _tenant_aead(self, tenant: str) -> AESGCM:
        return AESGCM(_derive(self._master, b"tenant:" + tenant.encode()))

    def storage_id(self, doc: StoredDocument) -> str:
        """The document's name in the store: an HMAC, so the store shows no ids."""
        message = b"\x00".join((doc.tenant.encode(), doc.document.encode()))
        return hmac.new(self._names, message, hashlib.sha256).hexdigest()[:40]

    @staticmethod
    def _aad(doc: StoredDocument, name: str, signature: str) -> bytes:
        parts = (_FORMAT, doc.tenant.encode(), doc.document.encode(), name.encode())
        return b"\x00".join((*parts, signature.encode()))

    def seal(self, doc: StoredDocument, name: str, signature: str, data: bytes) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        aad = self._aad(doc, name, signature)
        return nonce + self._aead(doc.tenant).encrypt(nonce, data, aad)

    def open(self, doc: StoredDocument, name: str, signature: str, sealed: bytes) -> bytes:
        nonce, body = sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:]
        try:
            return self._aead(doc.tenant).decrypt(nonce, body, self._aad(doc, name, signature))
        except (InvalidTag, ValueError) as exc:
            raise SealError(f"stored object {name} does not open") from exc
