"""Quotas as token buckets, on a clock the test moves: a minute's burst, then the rate; tokens overdraw once."""

from __future__ import annotations

import pytest

from loraserve.errors import QuotaExceededError
from loraserve.server.quotas import Quota, Quotas


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_allow_a_burst_then_the_rate() -> None:
    clock = Clock()
    quotas, quota = Quotas(clock), Quota(requests_per_minute=6)
    for _ in range(6):
        quotas.admit("acme", quota)
    with pytest.raises(QuotaExceededError) as refused:
        quotas.admit("acme", quota)
    assert (refused.value.field, refused.value.retry_after) == ("requests_per_minute", 10.0)
    clock.now = 10.0
    quotas.admit("acme", quota)  # one came back after 10 s
    with pytest.raises(QuotaExceededError):
        quotas.admit("acme", quota)
    quotas.admit("other", quota)  # each tenant has its own bucket


def test_tokens_are_charged_after_the_request_and_may_overdraw_once() -> None:
    clock = Clock()
    quotas, quota = Quotas(clock), Quota(tokens_per_minute=600)
    quotas.admit("acme", quota)
    quotas.charge_tokens("acme", quota, 900)  # 300 below zero
    with pytest.raises(QuotaExceededError) as refused:
        quotas.admit("acme", quota)
    assert refused.value.field == "tokens_per_minute" and refused.value.retry_after == pytest.approx(30.1)
    clock.now = 31.0
    quotas.admit("acme", quota)


def test_no_quota_keeps_no_bucket_and_forget_starts_afresh() -> None:
    quotas = Quotas(Clock())
    for _ in range(1000):
        quotas.admit("free", Quota())
    quota = Quota(requests_per_minute=1)
    quotas.admit("acme", quota)
    quotas.forget("acme")  # revoked, then a new key of that name: a full bucket
    quotas.admit("acme", quota)
