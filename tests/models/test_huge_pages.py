"""The weights a decode step streams lie in transparent huge pages wherever the kernel lends them
(importing loraserve.models asks torch for them before torch allocates), unless the user says no."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ROOT = Path(__file__).resolve().parents[2]  # the probe imports this file as tests.models.test_huge_pages

# Loads the default model with bfloat16 weights and prints the huge-page kB of the mapping that
# holds the lm_head's packed panels (the largest weight a step reads).
PROBE = """
import loraserve
from loraserve.config import ModelConfig
from loraserve.models.loader import load_model
from tests.models.test_huge_pages import resident_and_huge_kilobytes

loaded = load_model(ModelConfig(dtype="float32", weights="bfloat16"))
print(resident_and_huge_kilobytes(loaded.model.lm_head.held.bfloat16.packed.data_ptr())[1])
"""


def huge_page_kilobytes(environment: dict[str, str]) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=environment, cwd=ROOT, capture_output=True, text=True, timeout=300,
        check=True,
    )  # fmt: skip
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(
    not THP_MODE.exists() or "[never]" in THP_MODE.read_text(), reason="this kernel lends no transparent huge pages"
)
def test_packed_weights_lie_in_huge_pages_unless_turned_off():
    environment = {name: value for name, value in os.environ.items() if name != "THP_MEM_ALLOC_ENABLE"}
    assert huge_page_kilobytes(environment) >= 2048 * 10  # the lm_head's 57 MB: most of it, not a stray page
    if "[madvise]" in THP_MODE.read_text():  # with [always] every large mapping takes them anyway
        assert huge_page_kilobytes({**environment, "THP_MEM_ALLOC_ENABLE": "0"}) == 0


def resident_and_huge_kilobytes(address: int) -> tuple[int, int]:
    """(Rss, AnonHugePages) in kB of this process's mapping that holds `address`."""
    mapping, found = False, {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            start, end = (int(part, 16) for part in fields[0].split("-"))
            mapping = start <= address < end
        elif mapping and fields[0] in ("Rss:", "AnonHugePages:"):
            found[fields[0]] = int(fields[1])
    return found["Rss:"], found["AnonHugePages:"]


def resident_kilobytes(address: int, size: int) -> int:
    """kB of [address, address + size) in memory, from /proc/self/pagemap's present bit per page: exact for the range,
    where the smaps of the mapping holding it also count a neighbour that the kernel merged into it."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, count = address // page, -(-(address + size) // page) - address // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = struct.unpack(f"{count}Q", pagemap.read(count * 8))
    return sum(1 for entry in entries if entry >> 63) * page // 1024


def test_a_new_pool_is_zeros_that_take_memory_only_where_used():
    """A server's start does not write its whole pool (2 GiB by default): pages come in on first use,
    in huge pages where the kernel lends them."""
    from loraserve.memory.pool import MemoryPool, page_bytes
    from tests.lora.tiny_adapters import TINY_SPEC

    spec = dataclasses.replace(TINY_SPEC, head_dim=1024)  # pages of 64 KiB
    pool = MemoryPool(spec, 16, num_pages=(256 << 20) // page_bytes(spec, 16, torch.float32), dtype=torch.float32,
                      device="cpu")  # fmt: skip
    address, size = pool.buffer.data_ptr(), pool.buffer.numel() * pool.buffer.element_size()
    assert resident_kilobytes(address, size) < 1024, "nothing resident before use"
    pool.buffer[: 8 << 20].fill_(1.0)  # 32 MB of KV written
    assert 32 << 10 <= resident_kilobytes(address, size) < 64 << 10
    huge = resident_and_huge_kilobytes(address)[1]
    # Read last: reading an untouched page maps the kernel's zero page in, which the range would then count.
    assert not pool.buffer[8 << 20 :: 1 << 20].any() and not pool.buffer[pool.zero_offset :].any()
    if THP_MODE.exists() and "[never]" not in THP_MODE.read_text():
        assert huge >= 16 << 10, "most of it in huge pages"
