"""One adapter's life in the engine: a record per adapter, its state, and the moves between states.

    REGISTERED --prefetch--> READING --read--> ON_HOST --acquire/pin--> LOADING --copied--> ON_DEVICE
        |  ^                    |                 |  ^                  |  |                    |
        |  +--- the host cache drops it ----------+  +- read, no room ---+  |      evicted: ON_HOST,
        +--acquire/pin (size unknown: read first)--> LOADING               |      or REGISTERED if the
                              +------ unreadable, hash mismatch ----> FAILED       host cache dropped it

Any state -> DELETED (unregistered; the record leaves the table). `draining` is a flag over
these states, not one of them: a removed adapter's queued requests may still need it
loaded, so it keeps moving between tiers until its last request ends. Everything the
engine knows about one adapter is in its record (the server keeps its own data); the
manager's lock guards it.

Outside the engine: `acquire` answers in these words (or NO_SLOT), the API's `residency` is DEVICE, HOST
or DISK (residency.py); the registry keeps only ready or failed (AdapterStatus), set by AdapterCatalog.mark_failed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from loraserve.lora.mix_spec import MixSpec
from loraserve.lora.residency import NO_ADAPTER


class AdapterState(enum.Enum):
    REGISTERED = "registered"  # offered; its weights only on disk
    READING = "reading"  # a prefetch reads it into the host cache
    ON_HOST = "on host"  # read and checked, in the host cache
    LOADING = "loading"  # wanted on the device: being read, or copied into a reserved slot
    ON_DEVICE = "on device"  # in a slot: the kernels may use it
    FAILED = "failed"  # unreadable or changed on disk: its requests end with `failure`
    DELETED = "deleted"  # unregistered


S = AdapterState
TRANSITIONS: dict[AdapterState, frozenset[AdapterState]] = {
    S.REGISTERED: frozenset({S.READING, S.LOADING, S.DELETED}),
    S.READING: frozenset({S.ON_HOST, S.LOADING, S.FAILED, S.DELETED}),
    S.ON_HOST: frozenset({S.REGISTERED, S.LOADING, S.DELETED}),
    S.LOADING: frozenset({S.ON_DEVICE, S.ON_HOST, S.FAILED, S.DELETED}),
    S.ON_DEVICE: frozenset({S.ON_HOST, S.REGISTERED, S.DELETED}),
    S.FAILED: frozenset({S.DELETED}),
    S.DELETED: frozenset(),
}


class IllegalTransitionError(RuntimeError):
    """A bug: some code moved an adapter along an edge the diagram does not have."""


@dataclass(frozen=True)
class AdapterSource:
    path: Path | None  # a PEFT directory; None for a mix
    sha256: str | None  # the content hash the files (or a mix's spec and parts) must have; None: not checked
    mix: MixSpec | None = None  # a mix of `parts` (merge.py), materialised from them whenever it is read
    parts: tuple[tuple[str, AdapterSource], ...] = ()  # (name, source) of each adapter a mix mixes


@dataclass
class AdapterRecord:
    name: str
    source: AdapterSource
    state: AdapterState = AdapterState.REGISTERED
    draining: bool = False  # removed: no new requests; it goes once its running and queued ones end
    failure: str | None = None  # why it is FAILED
    rank: int = 0  # known once read (0 before)
    num_bytes: int = 0  # its files' size, known once read
    pages_needed: int | None = None  # pool pages its rows fill, known once read
    slot: int = NO_ADAPTER  # LOADING (once reserved) and ON_DEVICE: the slot the kernels index by
    content_hash: str = ""  # ON_DEVICE: the sha256 of the weights in the slot (keys its prefix cache)
    running: int = 0  # running sequences: never evicted while > 0
    pinned: bool = False
    last_used: int = -1  # a clock tick: least recently used leave first

    def move(self, to: AdapterState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransitionError(f"adapter {self.name!r}: {self.state.value} -> {to.value}")
        self.state = to

    @property
    def reserved(self) -> bool:
        """A slot and pages are held for a load in flight."""
        return self.state is AdapterState.LOADING and self.slot != NO_ADAPTER
