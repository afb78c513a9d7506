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

from collections.abc import Iterable
from dataclasses import dataclass, field

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
