"""Document text and a session's options (its prompts may quote customers' words) as they are
written to a shared store: AES-GCM encrypted when a key is set.

The key is base64 of 32 random bytes (env `WIM_STORE_ENCRYPTION_KEY`, from a Secret). Each
write gets a fresh random 96-bit nonce; the session id is the associated data, so a stored text
copied under another session's key does not decrypt. One leading byte says how a value was
written, so that a store read without the key it was written with fails loudly.
"""

from __future__ import annotations

import base64
import binascii
import os

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

ENCRYPTION_KEY_ENV = "WIM_STORE_ENCRYPTION_KEY"
_PLAIN, _AES_GCM = b"\x00", b"\x01"
_NONCE_BYTES = 12
# A field sealed by `seal_field` starts so (a field in clear here is JSON: it starts with `{`).
SEALED_FIELD = "sealed:"


class DocumentCipher:
    def __init__(self, key: bytes | None) -> None:
        if key is not None and len(key) != 32:
            raise ValueError(f"the document encryption key must be 32 bytes, not {len(key)}")
        self._aead = AESGCM(key) if key is not None else None

    @classmethod
    def from_env(cls) -> DocumentCipher:
        """From `WIM_STORE_ENCRYPTION_KEY` (base64 of 32 bytes); plain text when unset."""
        value = os.environ.get(ENCRYPTION_KEY_ENV, "").strip()
        if not value:
            return cls(None)
        try:
            return cls(base64.b64decode(value, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{ENCRYPTION_KEY_ENV} must be base64 of 32 bytes: {exc}") from exc

    def seal(self, session_id: str, text: str) -> bytes:
        data = text.encode()
        if self._aead is None:
            return _PLAIN + data
        nonce = os.urandom(_NONCE_BYTES)
        return _AES_GCM + nonce + self._aead.encrypt(nonce, data, session_id.encode())

    def seal_field(self, aad: str, text: str) -> str:
        """`text` sealed for a field that stays text (a Redis hash read as UTF-8): with a key,
        `SEALED_FIELD` and base64 of `seal(aad, text)`; without one, `text` as it is (what
        every field was before fields were sealed)."""
        if self._aead is None:
            return text
        return SEALED_FIELD + base64.b64encode(self.seal(aad, text)).decode()

    def open_field(self, aad: str, value: str) -> str:
        """What `seal_field` sealed; a field in clear passes as it is."""
        if not value.startswith(SEALED_FIELD):
            return value
        return self.open(aad, base64.b64decode(value.removeprefix(SEALED_FIELD)))

    def open(self, session_id: str, value: bytes) -> str:
        kind, body = value[:1], value[1:]
        if kind == _PLAIN:
            return body.decode()
        if self._aead is None:
            raise ValueError(f"the stored document is encrypted; set {ENCRYPTION_KEY_ENV}")
        nonce, sealed = body[:_NONCE_BYTES], body[_NONCE_BYTES:]
        return self._aead.decrypt(nonce, sealed, session_id.encode()).decode()
