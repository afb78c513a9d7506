"""The times refused non-streamed requests are told to come back: one after another as the queue drains."""

from __future__ import annotations

import math

import pytest

from loraserve.engine.retry_schedule import RetrySchedule

TARGET = 10.0  # seconds of queue a request may wait


def admitted(schedule: RetrySchedule, now: float, wait: float) -> bool:
    """Admission's rule (admission.py): within the target, and keeping every promise."""
    return wait <= TARGET + min(0.0, schedule.room(now))


def test_the_refused_are_told_successive_times_as_far_apart_as_their_requests_take():
    # The module's example: 25 requests of 1 s at once into an empty queue of a 10 s target.
    schedule, queue, told = RetrySchedule(), 0.0, []
    for _ in range(25):
        if admitted(schedule, 0.0, queue + 1.0):
            queue += 1.0
        else:
            told.append(schedule.promise(0.0, queue + 1.0, 1.0, TARGET))
    assert queue == 10.0
    assert told == pytest.approx([float(k) for k in range(1, 16)])


def test_a_client_back_at_its_time_is_admitted_and_one_new_then_is_sent_after_the_last():
    schedule = RetrySchedule()
    retry_afters = [schedule.promise(0.0, 11.0, 1.0, TARGET) for _ in range(5)]  # a 10 s queue, 5 refused
    assert retry_afters == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0])
    # At 1 s the queue has drained to 9 s: the first comes back to a 10 s wait, its promise due now.
    assert admitted(schedule, 1.0, 10.0)
    # Its request is queued: a newcomer at the same moment waits 11 s and would break the others' promises.
    assert not admitted(schedule, 1.0, 11.0)
    assert schedule.promise(1.0, 11.0, 1.0, TARGET) == pytest.approx(5.0), "after the four still promised, at 6 s"
    for k in range(2, 6):  # each of the others back on time finds its room
        assert admitted(schedule, float(k), 10.0)


def test_a_queue_that_drains_slower_than_foreseen_is_absorbed_by_the_return_headroom():
    schedule = RetrySchedule()
    retry_after = schedule.promise(0.0, 12.0, 1.0, 0.9 * TARGET)  # told to come when its wait will be 9 s
    assert retry_after == pytest.approx(3.0)
    assert admitted(schedule, retry_after, 9.0 + 0.9), "back to a queue that drained 10% slower: still in"


def test_a_time_past_the_most_a_client_honours_is_said_as_that_and_promised_nothing():
    schedule = RetrySchedule(max_retry_after=60.0)
    assert schedule.promise(0.0, 100.0, 1.0, TARGET) == 60.0
    assert schedule.room(0.0) == math.inf, "no promise holds anyone back"
    assert schedule.promise(0.0, 50.0, 1.0, TARGET) == pytest.approx(40.0)
    assert len(schedule.promises) == 1


def test_promises_past_due_are_forgotten():
    schedule = RetrySchedule()
    schedule.promise(0.0, 12.0, 1.0, TARGET)
    assert schedule.room(1.0) < math.inf
    assert schedule.room(2.0) == math.inf, "its client is back or gone"
    assert not schedule.promises
