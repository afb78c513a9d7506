"""Who sends each inference request: the tenant of its API key, with its weight and quotas.

Keys come from `--api-key` on the command line (a tenant each, named "key-" + a hash of the key, weight 1, no quotas)
and from the admin API (stored hashed in the registry, api_keys.py; a tenant may hold several, with one weight, each key
with its own quotas). All are kept in memory, so authenticating never touches the database: inference goes on while the
registry is down. The registry's inference-auth mode (registry/settings.py) says whether inference needs a key (or the
admin token): `keys` from the first key on, and for good (revoking every key leaves only the admin token), or `open`.
Requests with the admin token, or without a key while open, are the one unkeyed tenant. Keys and the mode are read
again every REFRESH_SECONDS, so a change made through another server sharing the database takes effect here too.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from loraserve.engine.fair_share import UNKEYED, Tenant
from loraserve.errors import LoraserveError, ModelNotAllowedError, TenantWeightError
from loraserve.registry import ApiKeyInfo, InferenceAuth, KeySpec, Registry, hash_key
from loraserve.server.accounts import Accounts, LocalAccounts, Turn
from loraserve.server.quotas import Quota, Quotas
from loraserve.server.registry_calls import RegistryCalls

logger = logging.getLogger(__name__)

REFRESH_SECONDS = 2.0  # a key revoked (or the mode closed) elsewhere holds here this long at most
NO_QUOTA = Quota()


@dataclass(frozen=True)
class TenantKey:
    """What one key grants: the tenant it serves, its quota and the models it may use (None: all)."""

    tenant: Tenant
    quota: Quota = NO_QUOTA
    allowed_models: frozenset[str] | None = None
    record: ApiKeyInfo | None = None  # None for --api-key keys

    @classmethod
    def of(cls, record: ApiKeyInfo) -> TenantKey:
        quota = Quota(record.requests_per_minute, record.tokens_per_minute)
        allowed = None if record.allowed_models is None else frozenset(record.allowed_models)
        return cls(Tenant(record.tenant, record.weight), quota, allowed, record)

    @property
    def quota_owner(self) -> str:
        """Whose buckets the quotas fill: each stored key its own."""
        return f"key {self.record.id}" if self.record else self.tenant.name

    def may_use(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


UNKEYED_ACCESS = TenantKey(UNKEYED)


class Tenants:
    """Every key, by hash, and the accounts their quotas are counted in. Changed only on the server's event loop."""

    def __init__(
        self,
        registry: Registry,
        calls: RegistryCalls,
        command_line_keys: frozenset[str],
        require_keys: bool = False,
        accounts: Accounts | None = None,
    ) -> None:
        self._registry = registry
        self._calls = calls
        self._command_line = {
            digest: TenantKey(Tenant("key-" + digest[:12])) for digest in map(hash_key, command_line_keys)
        }
        self._stored: dict[str, TenantKey] = {}  # by key hash: the admin API's keys
        self._closes_at_start = require_keys or bool(command_line_keys)
        self.auth = InferenceAuth.KEYS  # until load() reads the registry's: closed is the safe side
        self._changes = 0  # bumped by each change made here, so a refresh read before it is not applied
        self.accounts = accounts or LocalAccounts(Quotas())  # where quotas are counted: here, or a cluster's ledger

    @property
    def keys_required(self) -> bool:
        return self.auth == InferenceAuth.KEYS

    def load(self) -> None:
        """Read the stored keys and the mode, closing it for `--api-key` / `--require-api-key` (at start, before
        serving; RegistryError if the database fails)."""
        if self._closes_at_start:
            self._registry.settings.set_auth(InferenceAuth.KEYS)
        self.auth = self._registry.settings.auth()
        self._replace(self._registry.keys.list())

    async def set_auth(self, mode: InferenceAuth) -> None:
        """The admin's explicit choice, for every server sharing the registry; the one way back to `open`."""
        await self._calls(f"set the inference-auth mode to {mode.value}", self._registry.settings.set_auth, mode)
        self.auth = mode
        self._changes += 1
        logger.warning("inference-auth mode set to %r by the admin", mode.value)

    def key_of(self, key: str) -> TenantKey | None:
        """The grant of bearer `key`, or None for an unknown key."""
        digest = hash_key(key)
        return self._command_line.get(digest) or self._stored.get(digest)

    def records(self) -> list[ApiKeyInfo]:
        """The stored keys (without the keys), by tenant, as this server knows them: no database needed."""
        records = (grant.record for grant in self._stored.values() if grant.record)
        return sorted(records, key=lambda r: (r.tenant, r.id))

    async def create(self, spec: KeySpec) -> tuple[ApiKeyInfo, str]:
        """A new key; 409 if the tenant's other keys have another weight (a tenant has one share): the registry's
        state refuses it, not the request's shape."""
        if weights := {r.weight for r in self.records() if r.tenant == spec.tenant} - {spec.weight}:
            raise TenantWeightError(spec.tenant, weights.pop())
        record, key = await self._calls(f"create an API key of {spec.tenant!r}", self._registry.keys.create, spec)
        self._stored[record.key_hash] = TenantKey.of(record)
        self.auth = InferenceAuth.KEYS  # as the registry recorded with the key
        self._changes += 1
        return record, key

    async def revoke(self, key_id: int) -> ApiKeyInfo:
        """Delete the key: from now on it is refused (requests it started run to their end)."""
        record = await self._calls(f"revoke API key {key_id}", self._registry.keys.delete, key_id)
        if (grant := self._stored.pop(record.key_hash, None)) is not None:
            self.accounts.forget(grant.quota_owner)
        self._changes += 1
        return record

    async def admit(self, grant: TenantKey, models: list[str]) -> None:
        """Before a request starts: 403 for a model the key may not use (a mix: each part), 429 past its quota."""
        for model in models:
            if not grant.may_use(model):
                raise ModelNotAllowedError(f"this API key may not use model {model!r}")
        await self.accounts.admit(grant.quota_owner, grant.quota)

    def turn(self, grant: TenantKey) -> AbstractAsyncContextManager[Turn]:
        """Wait for the tenant's turn to start (a cluster's fair order; at once on one server), held until it ends."""
        return self.accounts.turn(grant.tenant)

    def charge(self, grant: TenantKey, tokens: int) -> None:
        self.accounts.charge(grant.quota_owner, grant.quota, tokens)

    async def refresh_forever(self, seconds: float = REFRESH_SECONDS) -> None:
        """Pick up keys made or revoked by other replicas; a failed read keeps what is known. While the registry is away
        nothing is read (each read would hold a registry thread until it answers)."""
        while True:
            await asyncio.sleep(seconds)
            if not self._calls.is_available:
                continue
            changes = self._changes
            try:
                records = await self._calls("list API keys", self._registry.keys.list)
                auth = await self._calls("read the inference-auth mode", self._registry.settings.auth)
            except LoraserveError as error:
                logger.debug("API keys not refreshed: %s", error)
                continue
            if changes == self._changes:  # else a change made meanwhile might be missing from `records`
                if auth != self.auth:
                    logger.warning("inference-auth mode is now %r (set through another server)", auth.value)
                self.auth = auth
                self._replace(records)

    def _replace(self, records: list[ApiKeyInfo]) -> None:
        stored = {record.key_hash: TenantKey.of(record) for record in records}
        for gone in self._stored.keys() - stored.keys():
            self.accounts.forget(self._stored[gone].quota_owner)
        self._stored = stored
