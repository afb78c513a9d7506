"""Fair share of the engine between tenants: S-LoRA's Virtual Token Counter (VTC), weighted.

Each tenant's counter adds up the service it got over its weight: a prompt token counts 1, a
generated token 2 (VTC's costs). The scheduler admits next the waiting request whose tenant has the
lowest counter (within a priority): a tenant sending 10x its share waits behind its own requests. A
tenant coming back after having nothing queued or running starts at the lowest counter of those
active (no one banks service it did not ask for). With one tenant: first come, first served.
Example, weights A 2 and B 1, both always waiting: after A's 100-token prompt its counter is 50,
after B's B's is 100; A is admitted again first, so A gets about twice B's tokens.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraserve.engine.sequence import Sequence

PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0


@dataclass(frozen=True)
class Tenant:
    """Who a request is for: an API key's tenant, or everyone without one."""

    name: str = ""
    weight: float = 1.0


UNKEYED = Tenant()


@dataclass
class FairShare:
    """Owned by the scheduler: the counters, charged as requests are admitted and tokens sampled."""

    _served: dict[str, float] = field(default_factory=dict)

    def counter(self, tenant: Tenant) -> float:
        return self._served.get(tenant.name, 0.0)

    def activate(self, tenant: Tenant, active: Iterable[Tenant]) -> None:
        """`tenant` had nothing queued or running: lift it to the lowest counter of the `active` ones."""
        floor = min((self.counter(other) for other in active if other.name != tenant.name), default=None)
        if floor is not None:
            self._served[tenant.name] = max(self.counter(tenant), floor)

    def charge(self, tenant: Tenant, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        cost = PROMPT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens
        self._served[tenant.name] = self.counter(tenant) + cost / tenant.weight

    def admission_order(self, waiting: Iterable[Sequence], running: Iterable[Sequence]) -> Iterator[Sequence]:
        """The waiting sequences in the order to admit them: by priority, then the tenant with the lowest
        counter (charged as they are admitted; a tie, as a newcomer has, goes to the one with fewer
        running); in each tenant's queue, its preempted ones first (they held their place), then first
        come, first served."""
        queues: dict[Tenant, deque[Sequence]] = {}
        for seq in waiting:  # each tenant's own queue keeps the waiting order
            queues.setdefault(seq.request.tenant, deque()).append(seq)
        running_count = Counter(seq.request.tenant for seq in running)

        def head_key(tenant: Tenant) -> tuple[int, float, int]:
            return queues[tenant][0].request.priority, self.counter(tenant), running_count[tenant]

        while queues:
            tenant = min(queues, key=head_key)
            seq = queues[tenant].popleft()
            if not queues[tenant]:
                del queues[tenant]
            yield seq

    def slots_to_move(
        self, running: Counter[Tenant], startable: Counter[Tenant], slots: int
    ) -> Iterator[tuple[Tenant, Tenant]]:
        """With all `slots` taken (`running`, by tenant), the moves (taker, holder) that bring tenants
        with `startable` sequences waiting up to their share of the slots (by weight, among the tenants
        running or waiting), lowest counter first, each from the tenant furthest over its share; none
        that would put the taker past its share, or take from a tenant not a whole slot over. Updates
        `running` as it goes."""
        total_weight = sum(tenant.weight for tenant in running.keys() | startable.keys())

        def excess(tenant: Tenant) -> float:
            return running[tenant] - slots * tenant.weight / total_weight

        for tenant in sorted(startable, key=self.counter):
            for _ in range(startable[tenant]):
                holder = max(running, key=excess)
                if excess(tenant) + 1 > 0 or excess(holder) < 1:
                    break
                running[holder] -= 1
                running[tenant] += 1
                yield tenant, holder
