"""Faults raised on purpose inside a step: how tests show what a failure ends and what goes on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraserve.engine.batch import ScheduledBatch


class InjectedFault(RuntimeError):
    """Raised by `FaultInjector` for a chosen request; never by anything else."""


@dataclass
class FaultInjector:
    """Owned by the model runner, which calls `check` after the forward pass of every step."""

    failing_request_ids: set[str] = field(default_factory=set)  # a step computing any of these raises
    device_failure: bool = False  # every step fails as a broken GPU does: the engine must stop

    def check(self, batch: ScheduledBatch) -> None:
        if self.device_failure:
            raise torch.AcceleratorError("fault injected: the device failed")
        for item in batch.scheduled:
            if item.seq.request.request_id in self.failing_request_ids:
                raise InjectedFault(f"fault injected for request {item.seq.request.request_id!r}")
