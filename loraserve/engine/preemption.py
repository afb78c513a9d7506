"""Preemption by recompute: who gives up their KV blocks and goes back to waiting, to be computed again
later (a prompt's full blocks mostly stay in the prefix cache). These functions name the sequences; the
scheduler preempts them, as it alone changes a sequence's status. Plain Python.

- Out of blocks: a running sequence that cannot get a block takes those of the most recently admitted
  sequences not yet scheduled this step, newest first, and gives way itself when none is left.
- Fair share: with the batch full, a tenant below its share of the slots takes one at once from the
  tenant furthest over its share (FairShare.slots_to_move), whose newest sequence yields. Otherwise a
  newcomer waits for a sequence to end: a whole generation when a flood filled the batch at once. Only
  sequences that can start at once (no adapter to load first) take a slot so.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator

from loraserve.engine.block_manager import BlockManager
from loraserve.engine.fair_share import FairShare
from loraserve.engine.sequence import Sequence


def block_victims(
    block_manager: BlockManager, seq: Sequence, num_new: int, queue: deque[Sequence]
) -> Iterator[Sequence]:
    """The sequences to preempt, one at a time, until `seq` can have the blocks for `num_new` tokens: the newest
    of `queue` (taken off it), then `seq` itself. Preempt each before asking for the next: that frees its blocks."""
    while not block_manager.make_room(seq, num_new) and queue:
        yield queue.pop()
    if not block_manager.make_room(seq, num_new):
        yield seq


def fair_share_victims(
    fair_share: FairShare,
    running: list[Sequence],
    waiting: deque[Sequence],
    max_running: int,
    can_start_now: Callable[[Sequence], bool],
) -> list[Sequence]:
    """With `max_running` sequences running (in admission order), those to yield their slots to tenants under
    their share with sequences waiting that can start now: for each slot moved, its holder's newest sequence."""
    if len(running) < max_running:
        return []
    startable = Counter(seq.request.tenant for seq in waiting if can_start_now(seq))
    kept, victims = list(running), []
    for _taker, holder in fair_share.slots_to_move(
        Counter(seq.request.tenant for seq in running), startable, max_running
    ):
        victim = next(seq for seq in reversed(kept) if seq.request.tenant == holder)
        kept.remove(victim)
        victims.append(victim)
    return victims
