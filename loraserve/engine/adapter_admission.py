"""May this sequence's adapter join the step? The scheduler's one LoRA question, and the adapter it drains.

A waiting sequence whose adapter is loading is passed over. When it waits because every adapter slot is
busy, one resident adapter is drained: none of its new sequences is admitted until its running ones end,
then its idle slot goes to the waiting adapter; a hot adapter cannot starve a cold one. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from loraserve.engine.sequence import Sequence
from loraserve.lora.adapter_state import AdapterRecord, AdapterState
from loraserve.lora.residency import Acquired


class AdapterResidency(Protocol):
    """What the scheduler needs from the adapter manager."""

    def acquire(self, name: str) -> Acquired: ...  # ON_DEVICE counts one more running sequence

    def release(self, name: str) -> None: ...

    def record(self, name: str) -> AdapterRecord | None: ...  # its slot, content hash, failure

    def drain_candidate(self) -> str | None: ...  # the resident adapter to free a slot from


@dataclass
class AdapterAdmission:
    """Owned by the scheduler, which asks it before admitting a sequence of an adapter."""

    adapters: AdapterResidency
    draining: str | None = None  # admits no new sequence until drained

    def acquire(self, seq: Sequence) -> Acquired:
        """May `seq` join with its adapter? READY: the adapter is in a slot, held for one more running sequence,
        and `seq` bound to its slot and content hash; otherwise `seq` waits (FAILED: it ends). The first NO_SLOT
        picks the adapter to drain, which itself answers NO_SLOT until drained."""
        adapter = seq.request.adapter
        assert adapter is not None, "the base model needs no slot"
        if adapter == self.draining:
            return Acquired.NO_SLOT
        acquired = self.adapters.acquire(adapter)
        if acquired is Acquired.NO_SLOT and self.draining is None:
            self.draining = self.adapters.drain_candidate()
        if acquired is Acquired.ON_DEVICE:
            try:
                record = self.record(adapter)
            except BaseException:
                self.adapters.release(adapter)  # undo the half-done admission
                raise
            seq.cache_salt, seq.lora_slot = record.content_hash.encode(), record.slot
        return acquired

    def fork(self, child: Sequence) -> None:
        """A sibling forked off a running sequence holds its adapter too (resident: the parent runs with it)."""
        if child.request.adapter is not None:
            self.adapters.acquire(child.request.adapter)

    def release(self, seq: Sequence) -> None:
        """`seq` stopped running: its hold on its adapter goes back."""
        if seq.request.adapter is not None:
            self.adapters.release(seq.request.adapter)

    def failure(self, seq: Sequence) -> str:
        """Why `seq`'s adapter FAILED."""
        assert seq.request.adapter is not None
        return self.record(seq.request.adapter).failure or "it could not be loaded"

    def end_drain(self, running: list[Sequence]) -> None:
        """Drained once none of its sequences runs: its idle slot goes to the first waiting request that needs one."""
        if self.draining is not None and not any(seq.request.adapter == self.draining for seq in running):
            self.draining = None

    def can_start_now(self, adapter: str | None) -> bool:
        """Whether a sequence of `adapter` could run at once: the base model, or an adapter in a slot."""
        return adapter is None or self.record(adapter).state is AdapterState.ON_DEVICE

    def record(self, adapter: str) -> AdapterRecord:
        record = self.adapters.record(adapter)
        assert record is not None, f"adapter {adapter!r} of a queued request is not registered"
        return record
