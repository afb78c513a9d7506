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
from loraserve.lora.residency import Residency


class AdapterResidency(Protocol):
    """What the scheduler needs from the adapter manager."""

    def acquire(self, name: str) -> Residency: ...  # READY counts one more running sequence

    def release(self, name: str) -> None: ...

    def record(self, name: str) -> AdapterRecord | None: ...  # its slot, content hash, failure

    def drain_candidate(self) -> str | None: ...  # the resident adapter to free a slot from


@dataclass
class AdapterAdmission:
    """Owned by the scheduler, which asks it before admitting a sequence of an adapter."""

    adapters: AdapterResidency
    draining: str | None = None  # admits no new sequence until drained

    def acquire(self, adapter: str) -> Residency:
        """READY: resident, and held for one more running sequence; otherwise the sequence waits (FAILED: ends).
        The first NO_SLOT picks the adapter to drain; the draining one answers NO_SLOT itself."""
        if adapter == self.draining:
            return Residency.NO_SLOT
        residency = self.adapters.acquire(adapter)
        if residency is Residency.NO_SLOT and self.draining is None:
            self.draining = self.adapters.drain_candidate()
        return residency

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
