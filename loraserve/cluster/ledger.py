"""The cluster's ledger: one Ray actor that every replica asks before a request starts, so that quotas and tenants'
shares hold for the whole cluster. It keeps each key's token buckets (server/quotas.py: a key limited to 60 requests
a minute gets 60 from all replicas together) and the fair order of starts across replicas (fair_turns.py).

In the replicas rather than the ingress: a replica authenticates the request and knows what it cost in tokens when it
ends; the ingress sees bytes. The decision is still one for the cluster, taken in one place.

If the ledger cannot be asked (restarting, or its node gone), quotas fail closed by default (--quota-failure: a key
with a quota gets 503 quota_unavailable, keys without one go on) and fair shares fall back to each replica's own
scheduler. A restarted ledger starts with full buckets and even counters: at most one extra minute's allowance.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import ray

from loraserve.cluster.board import NAMESPACE
from loraserve.cluster.fair_turns import FairTurns, Ticket
from loraserve.engine.fair_share import Tenant
from loraserve.errors import QuotaExceededError, QuotaUnavailableError
from loraserve.server.accounts import Turn
from loraserve.server.quotas import Quota, Quotas

logger = logging.getLogger(__name__)

ASK_SECONDS = 2.0  # a quota question unanswered this long counts as the ledger being away
REMEMBERED_ENDS = 4096  # ends that overtook their start (a client leaving at once), so the start is not queued


@ray.remote(num_cpus=0, max_restarts=-1)
class ClusterLedger:
    """Named, detached: found by every replica of the application, outliving any of them."""

    def __init__(self) -> None:
        self._quotas = Quotas()
        self._turns = FairTurns()
        self._startable: dict[str, asyncio.Event] = {}  # the waiting starts' wake-ups, by ticket
        self._early_ends: deque[str] = deque(maxlen=REMEMBERED_ENDS)

    async def admit(self, owner: str, requests_per_minute: int | None, tokens_per_minute: int | None) -> Any:
        """None if `owner` may start a request, else the refusal (quota name, message, seconds until room)."""
        try:
            self._quotas.admit(owner, Quota(requests_per_minute, tokens_per_minute))
        except QuotaExceededError as error:
            return error.field, str(error), error.retry_after
        return None

    async def charge(
        self, owner: str, requests_per_minute: int | None, tokens_per_minute: int | None, tokens: int
    ) -> None:
        self._quotas.charge_tokens(owner, Quota(requests_per_minute, tokens_per_minute), tokens)

    async def forget(self, owner: str) -> None:
        self._quotas.forget(owner)

    async def join(self, replica: str, places: int) -> None:
        """A replica's heartbeat, with its running places (its --max-num-seqs)."""
        self._wake(self._turns.join(replica, places))

    async def start(self, ticket_id: str, replica: str, tenant: str, weight: float) -> None:
        """Returns when the ticket's request may start: at once while places are free, else in fair order."""
        if ticket_id in self._early_ends:
            return
        startable = self._startable[ticket_id] = asyncio.Event()
        try:
            self._wake(self._turns.ask(Ticket(ticket_id, replica, tenant, weight)))
            await startable.wait()
        finally:
            del self._startable[ticket_id]

    async def end(self, ticket_id: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """The ticket's request ended, or its client left while it waited."""
        if not self._turns.knows(ticket_id):
            self._early_ends.append(ticket_id)  # harmless if it was dropped with a silent replica: ids are not reused
            return
        self._wake(self._turns.end(ticket_id, prompt_tokens, output_tokens))
        if (waiting := self._startable.get(ticket_id)) is not None:
            waiting.set()

    async def counters(self) -> dict[str, float]:
        """Each tenant's weighted service (for views and tests)."""
        return {tenant: self._turns.counter(tenant) for tenant in self._turns.tenants}

    def _wake(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            if (startable := self._startable.get(ticket.id)) is not None:
                startable.set()


def ledger(app_name: str) -> Any:
    """The ledger of the Serve application `app_name`, created by whoever asks first."""
    options = {"name": f"ledger-{app_name}", "namespace": NAMESPACE, "get_if_exists": True, "lifetime": "detached"}
    return ClusterLedger.options(**options).remote()  # type: ignore[attr-defined]


@dataclass
class LedgerAccounts:
    """A replica's Accounts (server/accounts.py): quotas and turns asked of the cluster's ledger."""

    ledger: Any  # the ClusterLedger actor's handle
    replica: str
    fail_closed: bool = True

    async def admit(self, owner: str, quota: Quota) -> None:
        if quota.requests_per_minute is None and quota.tokens_per_minute is None:
            return
        try:
            ask = self.ledger.admit.remote(owner, quota.requests_per_minute, quota.tokens_per_minute)
            refused = await asyncio.wait_for(ask, ASK_SECONDS)
        except Exception as error:  # the actor away (restarting, its node gone) or too slow to answer
            if self.fail_closed:
                raise QuotaUnavailableError(f"the cluster's quota ledger cannot be asked now: {error}") from error
            logger.warning("quota of %s not counted: the ledger cannot be asked (%s)", owner, error)
            return
        if refused is not None:
            raise QuotaExceededError(*refused)

    def charge(self, owner: str, quota: Quota, tokens: int) -> None:
        if quota.tokens_per_minute is not None:
            self.ledger.charge.remote(owner, quota.requests_per_minute, quota.tokens_per_minute, tokens)

    def forget(self, owner: str) -> None:
        self.ledger.forget.remote(owner)

    @asynccontextmanager
    async def turn(self, tenant: Tenant) -> AsyncIterator[Turn]:
        ticket, turn = uuid.uuid4().hex, Turn()
        try:
            await self.ledger.start.remote(ticket, self.replica, tenant.name, tenant.weight)
        except asyncio.CancelledError:  # the client left while it waited
            self.ledger.end.remote(ticket)
            raise
        except Exception as error:  # the ledger away: this replica's scheduler alone shares it out
            logger.warning("request started outside the cluster's fair order: the ledger cannot be asked (%s)", error)
        try:
            yield turn
        finally:
            self.ledger.end.remote(ticket, turn.prompt_tokens, turn.output_tokens)
