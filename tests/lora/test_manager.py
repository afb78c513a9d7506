"""Adapter tiers: disk -> host -> device slots, loaded off the caller's thread, evicted LRU among idle ones."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from loraserve.errors import AdapterError, UnknownAdapterError
from loraserve.lora.host_cache import host_bytes
from loraserve.lora.residency import Acquired
from sgmv_kernels import gather_rows
from tests.lora.tiny_adapters import device_names, read_tiny, register_tiny, tiny_adapter, tiny_adapter_manager


def acquire_when_loaded(manager, name: str) -> Acquired:
    """Acquire as the scheduler does, step after step, until the answer is not LOADING."""
    for _ in range(3):  # read, then (if the read found no free room) reserve and copy
        acquired = manager.acquire(name)
        if acquired is not Acquired.LOADING:
            return acquired
        assert manager.wait_idle()
    raise AssertionError(f"{name} still loading")


def test_a_load_reads_from_disk_then_copies_into_a_slot():
    manager = tiny_adapter_manager(num_slots=2)
    register_tiny(manager, "a", seed=1)
    assert manager.residency("a") == "disk"
    assert manager.acquire("a") is Acquired.LOADING
    assert manager.wait_idle()
    assert manager.residency("a") == "device"
    assert manager.acquire("a") is Acquired.ON_DEVICE
    slot = manager.record("a").slot
    q = manager.slots.layers[1]["q_proj"]
    weights = tiny_adapter(1).weights[(1, "q_proj")]
    assert torch.equal(gather_rows(q.pool, q.a_rows[slot, :2], 8), weights.a), "A's rows, where the table says"
    assert torch.equal(gather_rows(q.pool, q.b_rows[slot, :2], 8), weights.b.T)
    assert (int(q.ranks[slot]), float(q.scales[slot])) == (2, 2.0)
    assert (manager.stats.loads, manager.stats.disk_reads) == (1, 1)


def test_busy_adapters_are_never_evicted_and_idle_ones_go_least_recently_used_first():
    manager = tiny_adapter_manager(num_slots=2)
    for seed, name in enumerate("abc"):
        register_tiny(manager, name, seed)
    assert acquire_when_loaded(manager, "a") is Acquired.ON_DEVICE
    assert acquire_when_loaded(manager, "b") is Acquired.ON_DEVICE
    assert manager.acquire("c") is Acquired.LOADING, "read first: its size says how many pages it needs"
    assert manager.wait_idle()
    assert manager.residency("c") == "host", "read, but no room on the device"
    assert manager.acquire("c") is Acquired.NO_SLOT, "both slots have running sequences"
    manager.release("a")
    manager.release("b")
    assert acquire_when_loaded(manager, "c") is Acquired.ON_DEVICE
    assert set(device_names(manager)) == {"b", "c"}, "a was used least recently"
    assert manager.stats.evictions == 1
    assert manager.residency("a") == "host", "evicted from the device, still in the host cache"


def test_prefetch_reads_into_the_host_cache_and_the_host_cache_keeps_its_budget():
    one = host_bytes(tiny_adapter(0))
    manager = tiny_adapter_manager(num_slots=1, host_cache_bytes=2 * one)
    for seed, name in enumerate("abc"):
        register_tiny(manager, name, seed)
        manager.prefetch(name)
        assert manager.wait_idle()
    assert manager.host.names == ["b", "c"], "a left first"
    assert manager.host.num_bytes == 2 * one
    assert [manager.residency(n) for n in "abc"] == ["disk", "host", "host"]


def test_a_slow_load_does_not_block_the_caller():
    release = threading.Event()

    def slow_read(path: Path):
        release.wait(timeout=30)
        return read_tiny(path)

    manager = tiny_adapter_manager(num_slots=2, read=slow_read)
    register_tiny(manager, "slow", seed=3)
    assert manager.acquire("slow") is Acquired.LOADING  # returns at once: the worker reads
    assert manager.acquire("slow") is Acquired.LOADING
    release.set()
    assert manager.wait_idle()
    assert manager.acquire("slow") is Acquired.ON_DEVICE


def test_an_unreadable_adapter_fails_with_its_reason_and_frees_its_slot():
    def broken_read(path: Path):
        raise AdapterError("adapter_model.safetensors", "truncated")

    manager = tiny_adapter_manager(num_slots=1, read=broken_read)
    register_tiny(manager, "broken", seed=0)
    manager.acquire("broken")
    assert manager.wait_idle()
    assert manager.acquire("broken") is Acquired.FAILED
    assert "truncated" in manager.record("broken").failure
    assert manager.slots.num_free == 1


def test_a_changed_file_fails_the_hash_check():
    from loraserve.lora.manager import AdapterSource

    manager = tiny_adapter_manager(num_slots=1)
    manager.register("a", AdapterSource(Path("tiny/1"), sha256="0" * 64))
    manager.acquire("a")
    assert manager.wait_idle()
    assert manager.acquire("a") is Acquired.FAILED
    assert "changed on disk" in manager.record("a").failure


def test_pinned_adapter_stays_and_one_slot_always_stays_unpinned():
    manager = tiny_adapter_manager(num_slots=2)
    for seed, name in enumerate("abc"):
        register_tiny(manager, name, seed)
    manager.set_pinned("a", True)
    assert manager.wait_idle()
    assert manager.residency("a") == "device", "pinning loads at once"
    with pytest.raises(AdapterError, match="pinned"):
        manager.set_pinned("b", True)
    assert acquire_when_loaded(manager, "b") is Acquired.ON_DEVICE
    manager.release("b")
    assert acquire_when_loaded(manager, "c") is Acquired.ON_DEVICE
    assert set(device_names(manager)) == {"a", "c"}, "b was evicted, the pinned a stayed"


def test_pinning_an_unread_adapter_takes_an_idle_slot_when_none_is_free():
    manager = tiny_adapter_manager(num_slots=3)
    for seed, name in enumerate("abc"):
        register_tiny(manager, name, seed)
    for name in "ab":
        assert acquire_when_loaded(manager, name) is Acquired.ON_DEVICE
        manager.release(name)
    assert manager.slots.num_free == 1
    assert acquire_when_loaded(manager, "c") is Acquired.ON_DEVICE  # every slot taken, all idle once c is released
    manager.release("c")
    register_tiny(manager, "d", seed=3)
    manager.set_pinned("d", True)  # never read: its size is known only after the read, off this thread
    assert manager.wait_idle()
    assert manager.residency("d") == "device", "no request follows a pin: it evicts an idle adapter itself"
    assert set(device_names(manager)) == {"b", "c", "d"}, "a was used least recently"


def test_unregister_frees_the_slot_and_the_name():
    manager = tiny_adapter_manager(num_slots=1)
    register_tiny(manager, "a", seed=0)
    assert acquire_when_loaded(manager, "a") is Acquired.ON_DEVICE
    manager.release("a")
    manager.unregister("a")
    assert "a" not in manager and manager.slots.num_free == 1 and manager.host.names == []
    with pytest.raises(UnknownAdapterError):
        manager.unregister("a")
    register_tiny(manager, "a", seed=1)  # the name can be reused


def test_lora_disabled_refuses_adapters_by_name():
    with pytest.raises(AdapterError, match="max_loras"):
        register_tiny(tiny_adapter_manager(num_slots=0), "a", seed=0)
