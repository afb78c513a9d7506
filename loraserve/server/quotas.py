"""Per-tenant quotas: requests and tokens per minute, as token buckets.

Each bucket holds up to one minute's allowance and refills continuously, so a tenant may burst a minute's worth, then
runs at its rate. A request takes one from the request bucket when it starts; its tokens (prompt and generated) are
charged when it ends, once known: the bucket may go below zero, and the tenant's next request waits until it is above
zero again (one request overdraws by at most its own size).
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
            raise _exceeded("tokens_per_minute", quota.tokens_per_minute, tokens)
        requests = self._bucket(self._requests, owner, quota.requests_per_minute, now)
        if requests is not None:
            if requests.level < 1:
                raise _exceeded("requests_per_minute", quota.requests_per_minute, requests)
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
        bucket = buckets.setdefault(owner, Bucket(per_minute, per_minute, now))
        bucket.refill(now)
        return bucket


def _exceeded(quota_name: str, per_minute: int | None, bucket: Bucket) -> QuotaExceededError:
    message = f"this API key has used its {per_minute} {quota_name.removesuffix('_per_minute')} per minute; retry later"
    return QuotaExceededError(quota_name, message, retry_after=bucket.seconds_until(1))
