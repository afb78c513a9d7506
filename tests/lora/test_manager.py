"""Adapter residency: slots are loaded on use, idle ones evicted least recently used first."""

from __future__ import annotations

import pytest
import torch

from loraserve.errors import AdapterError, UnknownAdapterError
from tests.lora.tiny_adapters import tiny_adapter, tiny_adapter_manager


def test_acquire_loads_into_a_slot_with_the_adapters_weights():
    manager = tiny_adapter_manager(num_slots=2)
    adapter = tiny_adapter(seed=1)
    manager.register("a", adapter)
    assert manager.residency("a") == "host"
    assert manager.acquire("a")
    slot = manager.slots.slot_of("a")
    q = manager.slots.layers[1]["q_proj"]
    assert torch.equal(q.lora_a[slot, :2], adapter.weights[(1, "q_proj")].a)
    assert (int(q.ranks[slot]), float(q.scales[slot])) == (2, 2.0)
    assert manager.residency("a") == "device"
    assert manager.stats.loads == 1


def test_busy_adapters_are_never_evicted_and_idle_ones_go_least_recently_used_first():
    manager = tiny_adapter_manager(num_slots=2)
    for seed, name in enumerate("abc"):
        manager.register(name, tiny_adapter(seed))
    assert manager.acquire("a") and manager.acquire("b")
    assert not manager.acquire("c"), "both slots have running sequences"
    manager.release("a")
    manager.release("b")
    assert manager.acquire("c")
    assert set(manager.slots.names) == {"b", "c"}, "a was used least recently"
    assert manager.stats.evictions == 1


def test_pinned_adapter_stays_and_one_slot_always_stays_unpinned():
    manager = tiny_adapter_manager(num_slots=2)
    for seed, name in enumerate("abc"):
        manager.register(name, tiny_adapter(seed))
    manager.pin("a")
    assert manager.residency("a") == "device", "pinning loads at once"
    with pytest.raises(AdapterError, match="pinned"):
        manager.pin("b")
    assert manager.acquire("b")
    manager.release("b")
    assert manager.acquire("c")
    assert set(manager.slots.names) == {"a", "c"}, "b was evicted, the pinned a stayed"


def test_unregister_frees_the_slot_and_the_name():
    manager = tiny_adapter_manager(num_slots=1)
    manager.register("a", tiny_adapter(0))
    assert manager.acquire("a")
    manager.release("a")
    manager.unregister("a")
    assert "a" not in manager and manager.slots.names == []
    with pytest.raises(UnknownAdapterError):
        manager.unregister("a")
    manager.register("a", tiny_adapter(1))  # the name can be reused


def test_lora_disabled_refuses_adapters_by_name():
    with pytest.raises(AdapterError, match="max_loras"):
        tiny_adapter_manager(num_slots=0).register("a", tiny_adapter(0))
