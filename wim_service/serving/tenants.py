"""Who is calling: API keys mapped to tenants, and each tenant's limits.

Keys are configured hashed (`sha256:<hex>` of the key), from a JSON file named by
`WIM_API_KEYS_FILE` (a mounted Kubernetes Secret) or the JSON itself in `WIM_API_KEYS`:

    {"tenants": {"acme": {"keys": ["sha256:…"], "limits": {"concurrent_jobs": 8}}}}

A request names its key as `Authorization: Bearer <key>`. Without any key configured the
service runs *open* (one anonymous tenant), which it allows only when its HTTP server listens
on loopback, or when `WIM_ALLOW_OPEN=1` says so explicitly (logged loudly).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from wim_service.serving.errors import ServiceCode, ServiceError

logger = logging.getLogger(__name__)

KEYS_FILE_ENV = "WIM_API_KEYS_FILE"
KEYS_ENV = "WIM_API_KEYS"
ALLOW_OPEN_ENV = "WIM_ALLOW_OPEN"


class Capability(StrEnum):
    JOBS = "jobs"  # one-shot jobs (POST /wim with a context, the OpenAI API)
    DOCUMENTS = "documents"  # document sessions (POST /documents and their queries)


class TenantLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrent_jobs: int = Field(8, ge=1, description="Jobs (queries) running at once.")
    open_documents: int = Field(32, ge=0, description="Document sessions open at once.")
    document_bytes: int = Field(2_000_000, ge=1, description="Largest document, UTF-8 bytes.")
    requests_per_minute: int = Field(600, ge=1)
    open_requests: int = Field(
        64,
        ge=1,
        description="Requests open at once on one router, from their headers to the last byte "
        "of the answer (bodies still arriving and streamed answers included).",
    )


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[str] = Field(..., min_length=1, description="`sha256:<hex>` of each API key.")
    limits: TenantLimits = Field(default_factory=TenantLimits)
    allow: frozenset[Capability] = frozenset(Capability)

    @field_validator("keys")
    @classmethod
    def _hashed(cls, keys: list[str]) -> list[str]:
        for key in keys:
            algorithm, _, digest = key.partition(":")
            if algorithm != "sha256" or len(digest) != 64:
                raise ValueError("keys are configured hashed: 'sha256:' + 64 hex digits")
            int(digest, 16)
        return [key.lower() for key in keys]


class KeysConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: dict[str, TenantConfig]


@dataclass(frozen=True)
class Tenant:
    name: str  # "" for the anonymous tenant of open mode
    limits: TenantLimits
    allow: frozenset[Capability] = frozenset(Capability)

    @property
    def cache_salt(self) -> str:
        """The engine cache salt of the tenant's requests that have no context of their own
        (plain requests): vLLM's prefix cache hits only requests of the same salt. Not a
        secret (a client cannot choose a salt), and not `SALT_PREFIX`'s: nothing purges it."""
        return "tenant:" + hashlib.sha256(self.name.encode()).hexdigest()[:32]

    def salt_for(self, user: str | None) -> str:
        """The cache salt of a plain request on behalf of `user` (OpenAI's `user` field: an
        end user of the tenant's application): one of its own, so that one end user's
        `cached_tokens` cannot tell what another sent; the tenant's without one. A hash of
        the tenant and the user: the user's id is in no salt (salts may be logged)."""
        if not user:
            return self.cache_salt
        named = json.dumps([self.name, user]).encode()
        return "user:" + hashlib.sha256(named).hexdigest()[:32]

    def require(self, capability: Capability) -> None:
        if capability not in self.allow:
            raise ServiceError(ServiceCode.FORBIDDEN, f"this API key may not use {capability}")


OPEN_TENANT = Tenant(
    "",
    TenantLimits(
        concurrent_jobs=1_000_000,
        open_documents=1_000_000,
        document_bytes=2**40,
        requests_per_minute=1_000_000,
    ),
)


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """The configured keys; `None` config means open mode."""

    def __init__(self, config: KeysConfig | None) -> None:
        self._by_hash: dict[str, Tenant] = {}
        for name, tenant in (config.tenants if config else {}).items():
            for key in tenant.keys:
                self._by_hash[key] = Tenant(name, tenant.limits, tenant.allow)

    @property
    def open(self) -> bool:
        return not self._by_hash

    @property
    def document_tenants(self) -> frozenset[str]:
        """The tenants that may open document sessions (those a fair share is shared by): a
        tenant allowed none (`open_documents` 0) takes no share from the others."""
        return frozenset(
            t.name
            for t in self._by_hash.values()
            if Capability.DOCUMENTS in t.allow and t.limits.open_documents > 0
        )

    @property
    def limits(self) -> dict[str, TenantLimits]:
        """Each configured tenant's limits, by name."""
        return {t.name: t.limits for t in self._by_hash.values()}

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ApiKeys:
        if env.get(KEYS_FILE_ENV):
            text = Path(env[KEYS_FILE_ENV]).read_text()
        elif env.get(KEYS_ENV):
            text = env[KEYS_ENV]
        else:
            return cls(None)
        return cls(KeysConfig.model_validate(json.loads(text)))

    def tenant(self, authorization: str | None) -> Tenant:
        if self.open:
            return OPEN_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ServiceError(
                ServiceCode.UNAUTHORIZED, "send your API key as 'Authorization: Bearer <key>'"
            )
        tenant = self._by_hash.get(hash_key(key.strip()))
        if tenant is None:
            raise ServiceError(ServiceCode.UNAUTHORIZED, "unknown API key")
        return tenant


def check_open_mode(keys: ApiKeys, http_host: str, env: Mapping[str, str] = os.environ) -> None:
    """Refuse to serve without keys on an address other hosts can reach."""
    if not keys.open or _is_loopback(http_host):
        return
    if env.get(ALLOW_OPEN_ENV) == "1":
        logger.warning(
            "NO AUTHENTICATION: the service listens on %s without API keys because %s=1; "
            "anyone who reaches it can read and delete every document session",
            http_host,
            ALLOW_OPEN_ENV,
        )
        return
    raise RuntimeError(
        f"the HTTP server listens on {http_host!r} but no API keys are configured: set "
        f"{KEYS_FILE_ENV} or {KEYS_ENV} (see docs/security.md), or {ALLOW_OPEN_ENV}=1 to run "
        "without authentication on purpose"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
