"""A replica's quotas and turns when the cluster's ledger cannot be asked: quotas fail closed (503) by default, open
with --quota-failure open; turns start anyway (each replica's scheduler shares them out). The ledger actor is stood in
for by an object that fails as a dead Ray actor's handle does: Ray itself is outside what these tests check."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray", reason="the cluster's ledger needs Ray: pip install 'loraserve[ray]'")

from ray.exceptions import RayActorError

from loraserve.cluster.ledger import LedgerAccounts
from loraserve.engine.fair_share import Tenant
from loraserve.errors import QuotaExceededError, QuotaUnavailableError
from loraserve.server.quotas import Quota


class Method:
    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.calls: list[tuple[object, ...]] = []

    def remote(self, *args: object) -> asyncio.Future[object]:
        self.calls.append(args)
        future = asyncio.get_running_loop().create_future()
        if isinstance(self.answer, BaseException):
            future.set_exception(self.answer)
        else:
            future.set_result(self.answer)
        return future


class Ledger:
    def __init__(self, answer: object) -> None:
        self.admit, self.start, self.end = Method(answer), Method(answer), Method(None)


LIMITED = Quota(requests_per_minute=60)


def test_quotas_fail_closed_while_the_ledger_is_away_and_unlimited_keys_go_on():
    accounts = LedgerAccounts(Ledger(RayActorError()), "r1")
    with pytest.raises(QuotaUnavailableError):
        asyncio.run(accounts.admit("key 1", LIMITED))
    asyncio.run(accounts.admit("key 2", Quota()))  # nothing to count: not asked


def test_quotas_fail_open_when_told_so():
    asyncio.run(LedgerAccounts(Ledger(RayActorError()), "r1", fail_closed=False).admit("key 1", LIMITED))


def test_the_ledgers_refusal_is_a_429_with_when_to_retry():
    accounts = LedgerAccounts(Ledger(("requests_per_minute", "spent", 12.5)), "r1")
    with pytest.raises(QuotaExceededError) as refused:
        asyncio.run(accounts.admit("key 1", LIMITED))
    assert (refused.value.field, refused.value.retry_after) == ("requests_per_minute", 12.5)


def test_a_turn_starts_without_the_ledger_and_its_end_is_still_told():
    ledger = Ledger(RayActorError())
    accounts = LedgerAccounts(ledger, "r1")

    async def serve_one() -> None:
        async with accounts.turn(Tenant("acme", 2.0)) as turn:
            turn.prompt_tokens, turn.output_tokens = 5, 7

    asyncio.run(serve_one())
    ((ticket, replica, tenant, weight),) = ledger.start.calls
    assert (replica, tenant, weight) == ("r1", "acme", 2.0)
    assert ledger.end.calls == [(ticket, 5, 7)]
