"""What the adapter manager answers the scheduler (torch-free: the scheduler side imports it)."""

from __future__ import annotations

import enum


class Residency(enum.Enum):
    READY = "ready"  # in a slot: the sequence may run
    LOADING = "loading"  # a slot is reserved and its weights are on the way
    NO_SLOT = "no slot"  # every slot is busy with running or pinned adapters
    FAILED = "failed"  # the adapter could not be read: its requests end with an error


NO_ADAPTER = -1  # the slot of a base-model row
