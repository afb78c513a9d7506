"""Only the step thread computes in parallel: other threads are kept to one OpenMP thread."""

from __future__ import annotations

import threading

import pytest
import torch

from loraserve.openmp import _libgomp, in_passing_thread, keep_serial

pytestmark = pytest.mark.serial  # threads as users have them: make test runs the rest on one each


@pytest.mark.skipif(_libgomp() is None, reason="torch here does not use GNU OpenMP")
def test_keep_serial_limits_only_the_calling_thread():
    before = torch.get_num_threads()
    seen: list[int] = []

    def worker() -> None:
        keep_serial()
        torch.ones(1 << 20).add_(1)  # large enough to be split across threads if it could be
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [1]
    assert torch.get_num_threads() == before, "the calling thread keeps every core"


def test_in_passing_thread_returns_the_result_and_reraises_errors():
    assert in_passing_thread(lambda: 6 * 7) == 42
    with pytest.raises(ValueError, match="invalid literal"):
        in_passing_thread(lambda: int("not a number"))
