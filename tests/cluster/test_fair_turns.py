"""The cluster's fair order of starts (cluster/fair_turns.py), without Ray: places from the replicas, tickets started
in weighted fair order, real costs charged at the end, silent replicas dropped."""

from __future__ import annotations

import itertools

from loraserve.cluster.fair_turns import STALE_SECONDS, FairTurns, Ticket


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


ids = (str(n) for n in itertools.count())


def ticket(tenant: str, weight: float = 1.0, replica: str = "r1") -> Ticket:
    return Ticket(next(ids), replica, tenant, weight)


def test_weights_hold_across_replicas_when_starts_are_rationed():
    """A (weight 2) floods replica r1 alone and B (weight 1) r2: each replica alone would serve its one tenant, 1:1;
    the cluster's order gives A two starts for each of B's."""
    turns = FairTurns()
    turns.join("r1", 2)
    turns.join("r2", 2)
    started: list[Ticket] = []
    for _ in range(50):
        started += turns.ask(ticket("A", 2, "r1"))
        started += turns.ask(ticket("B", 1, "r2"))
    assert len(started) == 4 and turns.num_started == 4
    served = {"A": 0, "B": 0}
    for _ in range(60):  # each start runs to its end, costing 10 prompt and 10 generated tokens: 30
        done = started.pop(0)
        served[done.tenant] += 1
        started += turns.end(done.id, prompt_tokens=10, output_tokens=10)
        assert turns.num_started <= 4
    assert 1.8 <= served["A"] / served["B"] <= 2.2, served


def test_a_free_place_starts_at_once_and_a_waiting_ticket_can_leave():
    turns = FairTurns()
    turns.join("r1", 1)
    first, second, third = ticket("A"), ticket("A"), ticket("B")
    assert turns.ask(first) == [first] and first.started
    assert turns.ask(second) == [] and turns.ask(third) == []
    assert turns.end(second.id) == []  # its client left while it waited: nothing starts, no place was held
    assert turns.end(first.id, 5, 5) == [third]
    assert turns.end("unknown") == [] and turns.end(first.id) == []


def test_a_tenant_coming_back_starts_at_the_lowest_active_counter_and_does_not_bank_idle_time():
    turns = FairTurns()
    turns.join("r1", 1)
    for _ in range(10):  # A alone for a while
        (only,) = turns.ask(ticket("A"))
        turns.end(only.id, 10, 0)
    running = ticket("A")
    turns.ask(running)
    waiting_a, newcomer = ticket("A"), ticket("B")
    turns.ask(waiting_a)
    turns.ask(newcomer)
    assert turns.counter("B") >= turns.counter("A") - 10  # lifted to A's level, not 0: it cannot take 10 turns
    started = turns.end(running.id, 10, 0)
    assert started in ([waiting_a], [newcomer])


def test_a_silent_replica_loses_its_places_and_its_tickets():
    clock = Clock()
    turns = FairTurns(clock)
    turns.join("r1", 1)
    turns.join("r2", 1)
    on_r2, waiting_on_r2 = ticket("A", replica="r2"), ticket("A", replica="r2")
    on_r1, waiting_on_r1 = ticket("B"), ticket("B")
    assert turns.ask(on_r2) == [on_r2] and turns.ask(on_r1) == [on_r1]
    assert turns.ask(waiting_on_r2) == [] and turns.ask(waiting_on_r1) == []
    clock.now = STALE_SECONDS / 2
    turns.join("r1", 1)
    clock.now = STALE_SECONDS + 1  # r2 was last heard at 0: killed
    released = turns.join("r1", 1)
    assert released == [waiting_on_r2]  # let go, so whatever awaited it is not left hanging
    assert turns.num_places == 1 and not turns.knows(on_r2.id) and turns.knows(on_r1.id)
    assert turns.end(on_r1.id, 1, 1) == [waiting_on_r1]
