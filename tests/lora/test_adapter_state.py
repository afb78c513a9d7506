"""Every move of adapter_state.py's diagram, the failure ones too, made by the manager as users cause
it (a request queued, a load, an eviction, a broken file, a delete), and the moves it must refuse."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from loraserve.errors import AdapterError, AdapterRetiringError
from loraserve.lora.adapter import LoraAdapter
from loraserve.lora.adapter_state import TRANSITIONS, AdapterRecord, AdapterSource, AdapterState, IllegalTransitionError
from loraserve.lora.host_cache import host_bytes
from loraserve.lora.manager import AdapterManager
from loraserve.lora.residency import NO_ADAPTER, Acquired
from tests.lora.tiny_adapters import read_tiny, register_tiny, tiny_adapter, tiny_adapter_manager

S = AdapterState


class Disk:
    """The tiny adapters' disk with a gate: while closed, reads wait (a load in flight stays in flight)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.broken: set[str] = set()  # seeds whose files do not parse

    def read(self, path: Path) -> LoraAdapter:
        assert self.open.wait(timeout=30)
        if path.name in self.broken:
            raise AdapterError("adapter_model.safetensors", "truncated")
        return read_tiny(path)


Scenario = Callable[[AdapterManager, Disk], None]
SCENARIOS: dict[tuple[AdapterState, AdapterState], Scenario] = {}


def moves(source: AdapterState, target: AdapterState) -> Callable[[Scenario], Scenario]:
    def keep(scenario: Scenario) -> Scenario:
        SCENARIOS[(source, target)] = scenario
        return scenario

    return keep


def state(manager: AdapterManager, name: str) -> AdapterState:
    record = manager.record(name)
    assert record is not None
    return record.state


def load(manager: AdapterManager, name: str) -> None:
    for _ in range(3):  # read, then (if the read found no free room) reserve and copy
        if manager.acquire(name) is Acquired.ON_DEVICE:
            return
        assert manager.wait_idle()
    raise AssertionError(f"{name} not loaded")


@moves(S.REGISTERED, S.READING)
@moves(S.READING, S.ON_HOST)
def prefetch(manager: AdapterManager, disk: Disk) -> None:
    register_tiny(manager, "a", seed=0)
    disk.open.clear()
    manager.prefetch("a")
    assert state(manager, "a") is S.READING
    disk.open.set()
    assert manager.wait_idle() and state(manager, "a") is S.ON_HOST


@moves(S.REGISTERED, S.LOADING)
@moves(S.LOADING, S.ON_DEVICE)
def first_request(manager: AdapterManager, disk: Disk) -> None:
    register_tiny(manager, "a", seed=0)
    assert manager.acquire("a") is Acquired.LOADING and state(manager, "a") is S.LOADING
    assert manager.wait_idle() and state(manager, "a") is S.ON_DEVICE
    record = manager.record("a")
    assert record is not None and record.slot != NO_ADAPTER and record.content_hash == tiny_adapter(0).sha256


@moves(S.READING, S.LOADING)
def request_during_prefetch(manager: AdapterManager, disk: Disk) -> None:
    register_tiny(manager, "a", seed=0)
    disk.open.clear()
    manager.prefetch("a")
    assert manager.acquire("a") is Acquired.LOADING and state(manager, "a") is S.LOADING
    disk.open.set()
    assert manager.wait_idle() and state(manager, "a") is S.ON_DEVICE, "the prefetch's read went on to the slot"


@moves(S.READING, S.FAILED)
def prefetch_of_a_broken_file(manager: AdapterManager, disk: Disk) -> None:
    disk.broken.add("0")
    register_tiny(manager, "a", seed=0)
    manager.prefetch("a")
    assert manager.wait_idle() and state(manager, "a") is S.FAILED
    assert "truncated" in manager.record("a").failure
    assert manager.acquire("a") is Acquired.FAILED


@moves(S.LOADING, S.FAILED)
def load_of_a_changed_file(manager: AdapterManager, disk: Disk) -> None:
    manager.register("a", AdapterSource(Path("tiny/0"), sha256="f" * 64))
    manager.acquire("a")
    assert manager.wait_idle() and state(manager, "a") is S.FAILED
    assert "changed on disk" in manager.record("a").failure
    assert manager.slots.num_free == 2, "its reserved slot went back"


@moves(S.ON_HOST, S.LOADING)
@moves(S.ON_DEVICE, S.ON_HOST)
def eviction_and_return(manager: AdapterManager, disk: Disk) -> None:
    for seed, name in enumerate("abc"):
        register_tiny(manager, name, seed)
    load(manager, "a")
    load(manager, "b")
    manager.release("a")
    manager.release("b")
    load(manager, "c")  # two slots: a, used least recently, leaves
    assert state(manager, "a") is S.ON_HOST and manager.stats.evictions == 1
    assert manager.acquire("a") is Acquired.LOADING and state(manager, "a") is S.LOADING, "size known: reserved"
    assert manager.wait_idle() and state(manager, "a") is S.ON_DEVICE


@moves(S.LOADING, S.ON_HOST)
def read_but_no_room(manager: AdapterManager, disk: Disk) -> None:
    for seed, name in enumerate("abc"):
        register_tiny(manager, name, seed)
    load(manager, "a")
    load(manager, "b")  # both running: neither may leave
    assert manager.acquire("c") is Acquired.LOADING
    assert manager.wait_idle() and state(manager, "c") is S.ON_HOST
    assert manager.acquire("c") is Acquired.NO_SLOT and state(manager, "c") is S.ON_HOST


@moves(S.ON_HOST, S.REGISTERED)
@moves(S.ON_DEVICE, S.REGISTERED)
def host_cache_pushes_out(manager: AdapterManager, disk: Disk) -> None:
    manager.host.capacity_bytes = host_bytes(tiny_adapter(0))  # room for one adapter in CPU memory
    for seed, name in enumerate("abc"):
        register_tiny(manager, name, seed)
    manager.prefetch("a")
    assert manager.wait_idle() and state(manager, "a") is S.ON_HOST
    manager.prefetch("b")
    assert manager.wait_idle() and state(manager, "a") is S.REGISTERED and manager.residency("a") == "disk"
    load(manager, "b")
    load(manager, "a")  # a's read pushes b out of the host cache; b stays on the device
    manager.release("a")
    manager.release("b")
    assert state(manager, "b") is S.ON_DEVICE and "b" not in manager.host
    load(manager, "c")  # b, used least recently, leaves the device: nothing of it left in memory
    assert state(manager, "b") is S.REGISTERED


def unregistered_from(source: AdapterState) -> Scenario:
    def scenario(manager: AdapterManager, disk: Disk) -> None:
        changed = "f" * 64 if source is S.FAILED else None  # the stored file's hash no longer matches
        manager.register("a", AdapterSource(Path("tiny/0"), changed))
        in_flight = source in (S.READING, S.LOADING)
        if in_flight:
            disk.open.clear()
        if source in (S.READING, S.ON_HOST):
            manager.prefetch("a")
        elif source is not S.REGISTERED:
            load(manager, "a") if source is S.ON_DEVICE else manager.acquire("a")
        if source is S.ON_DEVICE:
            manager.release("a")
        assert manager.wait_idle(timeout=0.5) != in_flight
        assert state(manager, "a") is source
        manager.unregister("a")
        disk.open.set()
        assert manager.wait_idle() and manager.record("a") is None and "a" not in manager
        assert manager.slots.num_free == 2 and manager.slots.pool.pages.num_free == manager.slots.pool.num_pages
        assert manager.host.names == []

    return scenario


for source in (S.REGISTERED, S.READING, S.ON_HOST, S.LOADING, S.ON_DEVICE, S.FAILED):
    moves(source, S.DELETED)(unregistered_from(source))


def test_every_move_of_the_diagram_has_a_scenario():
    edges = {(source, target) for source, targets in TRANSITIONS.items() for target in targets}
    assert set(SCENARIOS) == edges


@pytest.mark.parametrize("edge", sorted(SCENARIOS, key=str), ids=lambda edge: f"{edge[0].value}->{edge[1].value}")
def test_the_manager_makes_the_move(edge, monkeypatch):
    seen: list[tuple[AdapterState, AdapterState]] = []
    real_move = AdapterRecord.move

    def move(record: AdapterRecord, to: AdapterState) -> None:
        seen.append((record.state, to))
        real_move(record, to)

    monkeypatch.setattr(AdapterRecord, "move", move)
    disk = Disk()
    manager = tiny_adapter_manager(num_slots=2, read=disk.read)
    try:
        SCENARIOS[edge](manager, disk)
    finally:
        disk.open.set()
        manager.close()
    assert edge in seen


def test_a_move_off_the_diagram_is_refused():
    record = AdapterRecord("a", AdapterSource(Path("tiny/0"), None), state=S.FAILED)
    with pytest.raises(IllegalTransitionError, match="failed -> loading"):
        record.move(S.LOADING)
    assert record.state is S.FAILED


def test_a_draining_adapter_keeps_loading_for_its_queued_requests_and_its_name_is_taken():
    manager = tiny_adapter_manager(num_slots=2)
    register_tiny(manager, "a", seed=0)
    manager.drain("a")
    load(manager, "a")  # a request queued before the delete still runs with it
    with pytest.raises(AdapterRetiringError):
        register_tiny(manager, "a", seed=1)
    manager.release("a")
    manager.unregister("a")
    register_tiny(manager, "a", seed=1)
    assert state(manager, "a") is S.REGISTERED and not manager.record("a").draining  # type: ignore[union-attr]
