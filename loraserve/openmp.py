"""One OpenMP team per process: only the thread that runs the steps computes in parallel.

libgomp gives every thread that runs a parallel region a team of worker threads of its own, kept until that thread
exits. Once all teams together hold more threads than there are CPUs, libgomp stops spinning between regions, and
every small op of the step thread then waits for a futex wake-up of its worker. Measured on 2 cores: a small op went
from 10 us to 144 us as soon as one other thread had run one parallel op; the LoRA decode step (seven small ops per
projection) took 2-3x longer. So every other thread that may touch torch calls `keep_serial()` first, and work that
wants all cores outside the step loop (loading the model for the server) runs in a thread that exits when done.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
_state = threading.local()


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libgomp.so.1")  # the copy torch loaded, found by its soname
    except OSError:  # torch built with another OpenMP, or none
        return None


def keep_serial() -> None:
    """From now on this thread's torch ops run on it alone and never start an OpenMP team."""
    if getattr(_state, "serial", False):
        return
    torch.get_num_threads()  # ATen sets each thread's OpenMP thread count on first use: let it happen first
    libgomp = _libgomp()
    if libgomp is not None:
        libgomp.omp_set_num_threads(1)
    _state.serial = True


def in_passing_thread(work: Callable[[], T]) -> T:
    """Run `work` with every core in a thread that then exits, taking its OpenMP team with it."""
    # Leaving the block joins the thread; its result, or its error, comes back to the caller's thread.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraserve-setup") as executor:
        return executor.submit(work).result()
