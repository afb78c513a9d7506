"""Decode steps replayed as CUDA graphs, so the GPU does not wait on Python's ~400 launches a step:
the CUDA platform's fused step.

A decode-only step of B rows runs the graph captured for the smallest bucket >= B (1, 2, 4, then multiples of 8 up
to --max-num-seqs), its rows padded. Every tensor a step reads lives in static device buffers sized for the largest
bucket and updated in place before each replay: token ids, positions, the KV slots written, block tables, context
lengths and the rows' adapter segments (rows are sorted by adapter, a run of one adapter is one segment, so the
LoRA kernels read each adapter once; the output comes back in the step's order). The adapters' own tables (row
offsets, ranks, scales in lora/slots.py) are static too, written in place by a load, so adapters come and go
without a new capture. Padding rows have context 0
(the attention kernel gives zeros), no adapter, and write their K and V to a scratch block no sequence owns.

Each bucket is captured with LoRA (a program row per possible segment; unused ones are empty, slot -1, and return
at once) and without, so a base-model batch pays nothing for LoRA. Prefills, chunks and batches past the largest
bucket or the static block tables run eagerly; `--enforce-eager` turns graphs off.

Example: 5 decodes of slots [-1, 3, 3, 3, 7] -> bucket 8; rows 5-7 get token 0 at position 0, context 0, and write
to the scratch block; segments end at [1, 4, 5, 5, 5, 5, 5, 5] with slots [-1, 3, 7, -1, ...]; the graph's output
rows 0-4 are the step's hidden states.
"""

from __future__ import annotations

import enum
import logging
from bisect import bisect_left

import torch

from loraserve.lora.backends import TritonLora
from loraserve.lora.batch import NO_ADAPTER, LoraBatch, adapter_runs
from loraserve.lora.dora_rows import PooledDoraRows
from loraserve.lora.slots import AdapterSlots
from loraserve.models.attention import AttentionGroup, AttentionMetadata, DecodeAttention
from loraserve.models.decoder import DecoderForCausalLM, KVCache
from loraserve.models.platform import DecodeRows
from sgmv_kernels.expand import DECODE_SEGMENT_ROWS

logger = logging.getLogger(__name__)

# A graph's kernels give each segment one program per column chunk, which loops over its rows: a
# longer run of one adapter is cut into segments of the expand's decode row tile, so 64 rows of
# one adapter keep sixteen programs busy (reading the adapter from L2), not one looping.
SEGMENT_ROWS = DECODE_SEGMENT_ROWS


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to the first bucket >= max_rows."""
    buckets = [1, 2, 4]
    while buckets[-1] < max_rows:
        buckets.append(8 * (len(buckets) - 2))
    return buckets[: bisect_left(buckets, max_rows) + 1]


class StaticDecodeInputs:
    """The device buffers every captured graph reads, at the largest bucket's size."""

    def __init__(self, max_rows: int, max_blocks: int, scratch_block: int, device: str) -> None:
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.slot_blocks = torch.full((max_rows,), scratch_block, dtype=torch.long, device=device)
        self.slot_offsets = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.segment_bounds = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.segment_slots = torch.full((max_rows,), NO_ADAPTER, dtype=torch.int32, device=device)
        # Staged on the host in one pinned tensor, copied to the device in one transfer.
        self._host = torch.zeros(max_rows, 7 + max_blocks, dtype=torch.long, pin_memory=device == "cuda")
        self._device = torch.zeros_like(self._host, device=device)

    def fill(self, rows: DecodeRows, bucket: int) -> None:
        """Write `rows` into the first rows of the buffers and padding up to `bucket`."""
        n = len(rows)
        host = self._host[:bucket]
        host.zero_()
        host[n:, 2] = self.scratch_block
        columns = (rows.input_ids, rows.positions, rows.slot_blocks, rows.slot_offsets, rows.context_lens)
        for column, values in enumerate(columns):
            host[:n, column] = torch.tensor(values, dtype=torch.long)
        ends, slots = adapter_runs([1] * n, rows.lora_slots, longest=SEGMENT_ROWS)
        host[:, 5] = n
        host[: len(ends), 5] = torch.tensor(ends, dtype=torch.long)
        host[:, 6] = NO_ADAPTER
        host[: len(slots), 6] = torch.tensor(slots, dtype=torch.long)
        for row, table in enumerate(rows.block_tables):
            host[row, 7 : 7 + len(table)] = torch.tensor(table, dtype=torch.long)
        staged = self._device[:bucket]
        staged.copy_(host, non_blocking=True)
        buffers = (self.input_ids, self.positions, self.slot_blocks, self.slot_offsets, self.context_lens)
        for column, buffer in enumerate(buffers):
            buffer[:bucket].copy_(staged[:, column])
        self.segment_bounds[1 : bucket + 1].copy_(staged[:, 5])
        self.segment_slots[:bucket].copy_(staged[:, 6])
        self.block_tables[:bucket].copy_(staged[:, 7:])


class GraphLora(enum.Enum):
    """What a captured step computes of LoRA: a graph per kind, so a step without DoRA (or without any
    adapter) launches none of its kernels."""

    NONE = "none"
    LORA = "lora"
    DORA = "dora"  # LoRA, then DoRA's output scales

    @classmethod
    def of(cls, lora_slots: list[int], has_dora: list[bool]) -> GraphLora:
        used = [slot for slot in lora_slots if slot != NO_ADAPTER]
        if not used:
            return cls.NONE
        return cls.DORA if any(has_dora[slot] for slot in used) else cls.LORA


class DecodeGraphs:
    """Captures the decode step per bucket at start; `run` replays one, or says None (run eagerly)."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_caches: list[KVCache],
        adapter_slots: AdapterSlots,
        decode_kernel: DecodeAttention,
        max_rows: int,
        max_blocks: int,
        scratch_block: int,
    ) -> None:
        self.model, self.kv_caches, self.adapter_slots = model, kv_caches, adapter_slots
        self.decode_kernel = decode_kernel
        device = str(model.embed_tokens.device)
        self.buckets = batch_buckets(max_rows)
        self.inputs = StaticDecodeInputs(self.buckets[-1], max_blocks, scratch_block, device)
        self._graphs: dict[tuple[int, GraphLora], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._memory_pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None  # shared

    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool)."""
        free_before = torch.cuda.mem_get_info()[0]
        for bucket in reversed(self.buckets):
            for lora in GraphLora:
                self._graphs[(bucket, lora)] = self._capture_one(bucket, lora)
        torch.cuda.synchronize()
        memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.info(
            "captured decode CUDA graphs for batch sizes %s (no LoRA, LoRA, DoRA): %.0f MiB of GPU memory",
            self.buckets, memory_bytes / 2**20,
        )  # fmt: skip

    def run(self, rows: DecodeRows) -> torch.Tensor | None:
        """The step's hidden states [len(rows), hidden] in the rows' order, or None when the step does
        not fit a captured graph."""
        index = bisect_left(self.buckets, len(rows))
        max_blocks = self.inputs.block_tables.shape[1]
        if index == len(self.buckets) or any(len(table) > max_blocks for table in rows.block_tables):
            return None
        bucket = self.buckets[index]
        lora = GraphLora.of(rows.lora_slots, self.adapter_slots.has_dora)
        # Rows of one adapter side by side: the LoRA kernels' programs that read its weights then
        # run together, and all but the first find them in L2.
        order = sorted(range(len(rows)), key=rows.lora_slots.__getitem__)
        self.inputs.fill(rows.reordered(order), bucket)
        captured = self._graphs.get((bucket, lora))
        if captured is None:  # not captured (no CUDA): the same step over the same buffers, eagerly
            output = self.forward(bucket, lora)
        else:
            graph, output = captured
            graph.replay()
        if order == list(range(len(rows))):
            return output[: len(rows)]  # valid until the next replay
        place = [0] * len(order)  # the output row of each of the step's rows
        for output_row, row in enumerate(order):
            place[row] = output_row
        return output.index_select(0, torch.tensor(place, device=output.device))

    def forward(self, bucket: int, kind: GraphLora) -> torch.Tensor:
        """The decode step over the static buffers' first `bucket` rows: what is captured."""
        inputs = self.inputs
        group = AttentionGroup(
            token_start=0,
            token_end=bucket,
            max_query_len=1,
            block_tables=inputs.block_tables[:bucket],
            attend_bias=inputs.block_tables.new_empty(0),  # the decode kernel masks by context length
            window_tables=None,  # graphs serve Llama's forward alone (model_runner.py)
            window_bias=None,
            padded_index=None,
            context_lens=inputs.context_lens[:bucket],
        )
        metadata = AttentionMetadata(
            slot_blocks=inputs.slot_blocks[:bucket],
            slot_offsets=inputs.slot_offsets[:bucket],
            groups=[group],
            decode_kernel=self.decode_kernel,
        )
        lora = None
        if kind is not GraphLora.NONE:
            bounds, slots = inputs.segment_bounds[: bucket + 1], inputs.segment_slots[:bucket]
            busy = min(bucket, self.adapter_slots.num_slots)  # segments: about one per adapter running
            dora = PooledDoraRows(self.adapter_slots, bounds, slots) if kind is GraphLora.DORA else None
            lora = LoraBatch(self.adapter_slots, bounds, slots, TritonLora(), busy_segments=busy, dora=dora)
        return self.model(inputs.input_ids[:bucket], inputs.positions[:bucket], metadata, self.kv_caches, lora)

    def _capture_one(self, bucket: int, lora: GraphLora) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (Triton compiles, cuBLAS picks its kernels), as torch advises.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(bucket, lora)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory_pool):
            output = self.forward(bucket, lora)
        return graph, output
