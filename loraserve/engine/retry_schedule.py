"""When to tell a refused non-streamed request to come back: when the queue will have room for it, each
refused client its own time, so that they return one after another as the queue drains, not all at once
(a herd refused again, until its clients' few retries are spent: the `openai` client makes two).

A refusal is a promise: "come back at `due` and the queue will be short enough for you". Its request
will add `seconds` to the wait of those queued behind it. The predicted wait drains about a second a
second, so a promise due at d_j stays kept while

    wait_now + (seconds of the promises due up to d_j, its own included) - (d_j - now) <= target

where wait_now is the predicted wait of a request arriving now (`room` says what is left of it). A
request admitted now adds to wait_now, so it is admitted only where that holds for every promise; its
client's own promise, once due, is dropped first (the client is back, or gone). The server cannot tell
a returning client from a new one, and need not: at its due time the left-hand side is the target.

Running example, a target of 10 s and requests of 1 s each, 25 at once: 10 are admitted; the 11th is
told 1 s, the 12th 2 s, ...; at 1 s the 11th comes back to a 9 s queue and is admitted, while one new
at that moment would break the 12th's promise and is told to come after the 25th.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# The most a Retry-After may say: the `openai` client honours up to 60 s (1.x) or 120 s (2.x and later)
# and past that makes no retry at all. A client due later is told this much and promised nothing.
MAX_RETRY_AFTER = 60.0


@dataclass(frozen=True)
class Promise:
    due: float  # monotonic time its client was told to come back at
    seconds: float  # what its request adds to the predicted wait of those behind it


@dataclass
class RetrySchedule:
    """Owned by the admission policy (admission.py), which asks `room` before admitting a non-streamed request
    and `promise` when refusing one."""

    max_retry_after: float = MAX_RETRY_AFTER
    promises: deque[Promise] = field(default_factory=deque)  # by due time

    def room(self, now: float) -> float:
        """How much longer than now the predicted wait of a request arriving now may be while keeping every
        promise, beside the target (negative: promises are late already); inf with none pending."""
        while self.promises and self.promises[0].due <= now:
            self.promises.popleft()
        room, promised = math.inf, 0.0
        for promise in self.promises:
            promised += promise.seconds
            room = min(room, promise.due - now - promised)
        return room

    def promise(self, now: float, wait: float, seconds: float, target: float) -> float:
        """Seconds from `now` to tell a refused request to come back after: when, with the promises before it
        come back, its predicted `wait` will have drained to `target`. Promised only within `max_retry_after`."""
        promised = sum(promise.seconds for promise in self.promises)
        due = max(now + wait + promised - target, self.promises[-1].due if self.promises else now)
        if due - now > self.max_retry_after:
            return self.max_retry_after
        self.promises.append(Promise(due, seconds))
        return due - now
