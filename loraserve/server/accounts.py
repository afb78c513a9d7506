"""Where a key's quotas are counted and a tenant's turn to start is decided: this process alone (LocalAccounts, a
single server) or the cluster's ledger, which every replica asks (cluster/ledger.py), so that a key's requests and
tokens per minute and the tenants' weighted shares hold for the whole cluster, not per replica.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

from loraserve.engine.fair_share import Tenant
from loraserve.server.quotas import Quota, Quotas


@dataclass
class Turn:
    """A started request's place in the shared fair order; what it consumed is charged as it ends."""

    prompt_tokens: int = 0
    output_tokens: int = 0


class Accounts(Protocol):
    async def admit(self, owner: str, quota: Quota) -> None:
        """Take one request from `owner`'s allowance: QuotaExceededError (429) if spent, QuotaUnavailableError (503)
        if the counting place cannot be asked and quotas fail closed."""

    def charge(self, owner: str, quota: Quota, tokens: int) -> None:
        """Count the tokens of an ended request of `owner`."""

    def forget(self, owner: str) -> None:
        """Drop a revoked key's counts."""

    def turn(self, tenant: Tenant) -> AbstractAsyncContextManager[Turn]:
        """Wait for `tenant`'s turn to start a request (by weighted share where starts are rationed), held until it
        ends; the Turn's tokens, set before leaving, are charged to the tenant's share."""


@dataclass
class LocalAccounts:
    """One server: quotas in this process's buckets; the engine's own scheduler shares it between tenants."""

    quotas: Quotas

    async def admit(self, owner: str, quota: Quota) -> None:
        self.quotas.admit(owner, quota)

    def charge(self, owner: str, quota: Quota, tokens: int) -> None:
        self.quotas.charge_tokens(owner, quota, tokens)

    def forget(self, owner: str) -> None:
        self.quotas.forget(owner)

    @asynccontextmanager
    async def turn(self, tenant: Tenant) -> AsyncIterator[Turn]:
        yield Turn()
