"""Whose request starts next in the whole cluster: S-LoRA's Virtual Token Counter (engine/fair_share.py) over every
replica's starts, so tenants' weights hold across replicas and not only within each.

The cluster has as many running places as its live replicas' batches together (each replica joins with its
`--max-num-seqs`, and again every few seconds: a replica silent for STALE_SECONDS is dropped with its tickets). A
request asks for a ticket; while every place is taken, tickets wait, each tenant's in arrival order, and a freed place
goes to the waiting tenant with the lowest counter. A ticket is charged at its start the tenant's mean request cost
so far (so a burst of starts is shared out before any ends), and at its end what it really cost instead: a prompt
token 1, a generated token 2, over the tenant's weight. A tenant that comes back after having nothing waiting or
running starts at the lowest counter of those active (no one banks service it did not ask for).
Example: A (weight 2) and B (weight 1) each keep more requests waiting than there are places, all costing 30: A's
counter grows 15 a start, B's 30, so A starts two for each of B's and gets two thirds of the tokens.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.engine.fair_share import OUTPUT_TOKEN_COST, PROMPT_TOKEN_COST

STALE_SECONDS = 10.0
FIRST_COST_ESTIMATE = 1.0  # a tenant's first request, before any has ended
COST_MEMORY = 0.2  # weight of the latest request in a tenant's mean cost (an exponential moving average)


@dataclass
class Ticket:
    id: str
    replica: str
    tenant: str
    weight: float
    charged: float = 0.0  # the cost charged at its start, before its own is known
    started: bool = False


@dataclass
class FairTurns:
    """Owned by the cluster's ledger (ledger.py): every replica's places, tickets and the tenants' counters."""

    clock: Callable[[], float] = time.monotonic
    _places: dict[str, tuple[int, float]] = field(default_factory=dict)  # replica -> (places, when last heard)
    _counters: dict[str, float] = field(default_factory=dict)  # tenant -> weighted service
    _mean_cost: dict[str, float] = field(default_factory=dict)  # tenant -> a request's cost, recently
    _waiting: dict[str, deque[Ticket]] = field(default_factory=dict)  # tenant -> its tickets in arrival order
    _tickets: dict[str, Ticket] = field(default_factory=dict)  # by id, waiting or started

    def join(self, replica: str, places: int) -> list[Ticket]:
        """A replica is alive with `places` running places; returns the tickets that may start now."""
        self._places[replica] = (places, self.clock())
        return self._start_what_fits()

    def ask(self, ticket: Ticket) -> list[Ticket]:
        """Queue `ticket`; returns the tickets that may start now (it among them, if a place is free and it is next)."""
        if not any(t.tenant == ticket.tenant for t in self._tickets.values()):
            active = {t.tenant for t in self._tickets.values()}
            floor = min((self.counter(tenant) for tenant in active), default=None)
            if floor is not None:
                self._counters[ticket.tenant] = max(self.counter(ticket.tenant), floor)
        self._tickets[ticket.id] = ticket
        self._waiting.setdefault(ticket.tenant, deque()).append(ticket)
        return self._start_what_fits()

    def end(self, ticket_id: str, prompt_tokens: int = 0, output_tokens: int = 0) -> list[Ticket]:
        """A ticket's request ended (or its client left while it waited): its place is freed and its real cost
        charged; returns the tickets that may start now. An unknown id (ended already, or dropped) changes nothing."""
        ticket = self._tickets.pop(ticket_id, None)
        if ticket is None:
            return []
        if not ticket.started:
            self._waiting[ticket.tenant].remove(ticket)
            if not self._waiting[ticket.tenant]:
                del self._waiting[ticket.tenant]
            return self._start_what_fits()
        cost = PROMPT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens
        if cost > 0:  # a request that ended unanswered keeps its estimate
            self._counters[ticket.tenant] += (cost - ticket.charged * ticket.weight) / ticket.weight
            mean = self._mean_cost.get(ticket.tenant, cost)
            self._mean_cost[ticket.tenant] = (1 - COST_MEMORY) * mean + COST_MEMORY * cost
        return self._start_what_fits()

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def knows(self, ticket_id: str) -> bool:
        return ticket_id in self._tickets

    @property
    def tenants(self) -> list[str]:
        return sorted(self._counters)

    @property
    def num_places(self) -> int:
        return sum(places for places, _ in self._places.values())

    @property
    def num_started(self) -> int:
        return sum(ticket.started for ticket in self._tickets.values())

    def _start_what_fits(self) -> list[Ticket]:
        started: list[Ticket] = self._drop_silent_replicas()
        while self._waiting and self.num_started < self.num_places:
            tenant = min(self._waiting, key=self.counter)
            ticket = self._waiting[tenant].popleft()
            if not self._waiting[tenant]:
                del self._waiting[tenant]
            ticket.started = True
            ticket.charged = self._mean_cost.get(tenant, FIRST_COST_ESTIMATE) / ticket.weight
            self._counters[tenant] = self.counter(tenant) + ticket.charged
            started.append(ticket)
        return started

    def _drop_silent_replicas(self) -> list[Ticket]:
        """Forget replicas not heard from for STALE_SECONDS (killed), their places and tickets; returns their waiting
        tickets, so that whatever still awaits them is let go."""
        now = self.clock()
        silent = {replica for replica, (_, heard) in self._places.items() if now - heard > STALE_SECONDS}
        for replica in silent:
            del self._places[replica]
        dropped = [ticket for ticket in self._tickets.values() if ticket.replica in silent]
        for ticket in dropped:
            del self._tickets[ticket.id]
            if not ticket.started:
                self._waiting[ticket.tenant].remove(ticket)
                if not self._waiting[ticket.tenant]:
                    del self._waiting[ticket.tenant]
        return [ticket for ticket in dropped if not ticket.started]
