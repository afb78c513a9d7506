"""Where an adapter is, in the words of its states (adapter_state.py); torch-free: the scheduler side imports it."""

from __future__ import annotations

import enum


class Acquired(enum.Enum):
    """What `AdapterManager.acquire` answers the scheduler: "may this adapter join this step?"."""

    ON_DEVICE = "on device"  # in a slot: the sequence may run
    LOADING = "loading"  # a slot is reserved and its weights are on the way
    NO_SLOT = "no slot"  # every slot (or the pages it needs) is held by running or pinned adapters
    FAILED = "failed"  # the adapter could not be read: its requests end with an error


class Residency(enum.StrEnum):
    """Where an adapter's weights are, as the API shows it (`residency` of /admin/adapters)."""

    DEVICE = "device"  # in a slot of the pool
    HOST = "host"  # in the host cache (CPU memory)
    DISK = "disk"  # in the registry's files only


NO_ADAPTER = -1  # the slot of a base-model row
