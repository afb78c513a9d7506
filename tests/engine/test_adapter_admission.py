"""Whether a sequence's adapter may join the step, on a real adapter manager without a model: a waiting
adapter with no free slot gets one drained for it, so a hot adapter cannot starve a cold one."""

from __future__ import annotations

from loraserve.engine.adapter_admission import AdapterAdmission
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.sequence import Request, Sequence
from loraserve.lora.manager import AdapterManager
from loraserve.lora.residency import NO_ADAPTER, Acquired
from tests.lora.tiny_adapters import register_tiny, tiny_adapter_manager


def sequence_of(adapter: str) -> Sequence:
    request = Request(adapter, None, [1, 2, 3], SamplingParams(), arrival_time=0.0, adapter=adapter)
    return Sequence(0, request, 0, [1, 2, 3], num_prompt_tokens=3)


def acquired(admission: AdapterAdmission, manager: AdapterManager, seq: Sequence) -> Acquired:
    """What `seq` gets once its adapter is read and, if it has a slot, loaded (until then: LOADING)."""
    answer = admission.acquire(seq)
    while answer is Acquired.LOADING:
        assert manager.wait_idle()
        answer = admission.acquire(seq)
    return answer


def test_a_hot_adapter_drains_for_a_cold_one_and_admits_nothing_new_meanwhile():
    manager = tiny_adapter_manager(num_slots=1)
    register_tiny(manager, "hot", seed=0)
    register_tiny(manager, "cold", seed=1)
    admission = AdapterAdmission(manager)
    running = sequence_of("hot")
    assert acquired(admission, manager, running) is Acquired.ON_DEVICE and running.lora_slot != NO_ADAPTER
    cold = sequence_of("cold")
    assert acquired(admission, manager, cold) is Acquired.NO_SLOT and admission.draining == "hot"
    assert admission.acquire(sequence_of("hot")) is Acquired.NO_SLOT, "draining: no new sequence of it"
    admission.end_drain([running])
    assert admission.draining == "hot", "still running"
    admission.release(running)
    admission.end_drain([])
    assert admission.draining is None
    assert acquired(admission, manager, cold) is Acquired.ON_DEVICE, "the idle slot goes to the waiting adapter"
    assert admission.can_start_now("cold")
    assert not admission.can_start_now("hot")


def test_a_failed_adapter_ends_its_request_with_the_reason():
    def unreadable(path):
        raise OSError("no such file")

    manager = tiny_adapter_manager(num_slots=1, read=unreadable)
    register_tiny(manager, "broken", seed=0)
    admission = AdapterAdmission(manager)
    seq = sequence_of("broken")
    assert acquired(admission, manager, seq) is Acquired.FAILED
    assert "no such file" in admission.failure(seq)
