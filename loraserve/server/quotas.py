"""Per-tenant quotas: requests and tokens per minute, as token buckets.

Each bucket holds up to one minute's allowance and refills continuously, so a tenant may
burst a minute's worth and then runs at its rate. A request takes one from the request
bucket when it starts. Tokens (prompt and generated) are charged when it ends, since only
then are they known: the bucket may go below zero, and the tenant's next request waits
until it is above zero again; one request overdraws by at most its own size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.errors import QuotaExceededError


@dataclass
class Bucket:
    per_minute: float
    level: float
    updated: float  # clock seconds of `level`

    @classmethod
    def full(cls, per_minute: float, now: float) -> Bucket:
        return cls(per_minute, per_minute, now)

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.updated) * self.per_minute / 60)
        self.updated = now

    def seconds_until(self, level: float) -> float:
        return max(0.0, level - self.level) * 60 / self.per_minute


@dataclass(frozen=True)
class Quota:
    """One tenant's limits; None: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass
class Quotas:
    """The buckets of every key with a quota, by owner (the key's name for it)."""

    clock: Callable[[], float] = time.monotonic
    _requests: dict[str, Bucket] = field(default_factory=dict)
    _tokens: dict[str, Bucket] = field(default_factory=dict)

    def admit(self, owner: str, quota: Quota) -> None:
        """Take one request from `owner`'s allowance; QuotaExceededError (with when to retry) if none is left."""
        now = self.clock()
        tokens = self._bucket(self._tokens, owner, quota.tokens_per_minute, now)
        if tokens is not None and tokens.level <= 0:
            raise QuotaExceededError(
                "tokens_per_minute",
                f"this API key has used its {quota.tokens_per_minute} tokens per minute; retry later",
                retry_after=tokens.seconds_until(1),
            )
        requests = self._bucket(self._requests, owner, quota.requests_per_minute, now)
        if requests is not None:
            if requests.level < 1:
                raise QuotaExceededError(
                    "requests_per_minute",
                    f"this API key has used its {quota.requests_per_minute} requests per minute; retry later",
                    retry_after=requests.seconds_until(1),
                )
            requests.level -= 1

    def charge_tokens(self, owner: str, quota: Quota, tokens: int) -> None:
        """Count the prompt and generated tokens of a request of `owner` that ended."""
        bucket = self._bucket(self._tokens, owner, quota.tokens_per_minute, self.clock())
        if bucket is not None:
            bucket.level -= tokens

    def forget(self, owner: str) -> None:
        """Drop the buckets of a revoked key."""
        self._requests.pop(owner, None)
        self._tokens.pop(owner, None)

    @staticmethod
    def _bucket(buckets: dict[str, Bucket], owner: str, per_minute: int | None, now: float) -> Bucket | None:
        if per_minute is None:
            buckets.pop(owner, None)
            return None
        bucket = buckets.get(owner)
        if bucket is None:
            bucket = buckets[owner] = Bucket.full(per_minute, now)
        bucket.refill(now)
        return bucket
