"""Runs one scheduled batch: the platform's fused decode step where it serves the batch, else the
model over the step's tensors, built once; then samples.

Token layout of a step (T tokens): the decodes' single tokens first, then each prefill chunk's tokens in order.
Example with block_size 4: a decode at position 9 of table [7, 2, 5] writes block 5 at offset 1; a chunk of
positions 0..5 of table [3, 8] writes blocks 3, 3, 3, 3, 8, 8 at offsets 0, 1, 2, 3, 0, 1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loraserve.engine.batch import ScheduledBatch, ScheduledSequence, StepOutput
from loraserve.engine.block_manager import BlockCopy
from loraserve.engine.faults import FaultInjector
from loraserve.engine.sampler import Sampler
from loraserve.engine.token_masks import TokenMasks
from loraserve.lora.backends import choose_backend
from loraserve.lora.batch import LoraBatch
from loraserve.lora.slots import AdapterSlots
from loraserve.memory.page_allocator import PageUse
from loraserve.memory.pool import MemoryPool
from loraserve.models import LoadedModel
from loraserve.models.attention import AttentionGroup, AttentionMetadata
from loraserve.models.platform import DecodeRows, GraphSettings, StepPlan

logger = logging.getLogger(__name__)


@dataclass
class ModelInputs:
    """The step's tensors, shared by every layer."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attention: AttentionMetadata
    logits_index: torch.Tensor  # [S] int64 token whose hidden state gives sampling row i
    lora: LoraBatch | None  # None: no row uses an adapter this step


class ModelRunner:
    """Owns the model and the sampler; runs steps on the engine's memory pool and adapter slots."""

    def __init__(
        self,
        loaded: LoadedModel,
        pool: MemoryPool,
        adapter_slots: AdapterSlots,
        seed: int,
        cache_dir: Path,
        graphs: GraphSettings | None = None,
    ) -> None:
        self.model, self.device, self.dtype = loaded.model, loaded.device, loaded.dtype
        self.pool, self.adapter_slots, self.block_size = pool, adapter_slots, pool.block_size
        self.sampler = Sampler(seed, self.device)
        self.token_masks = TokenMasks(self.model.spec.vocab_size, loaded.eos_token_ids)
        self.faults = FaultInjector()
        self.lora_backend = choose_backend(self.device, self.dtype, cache_dir / "kernels")
        platform = loaded.platform
        self.decode_kernel = platform.decode_attention(self.dtype)
        self.model.use_layer_ops(platform.layer_ops(self.dtype))
        plan = StepPlan(
            self.model, self.pool.kv_caches, self.adapter_slots, self.block_size, self._take_scratch_block, graphs
        )
        uncovered = [d for d in self.model.departures() if d not in platform.fused_step_covers]
        self.fused_step = None if uncovered else platform.fused_step(plan)  # decode steps in one call
        if uncovered:
            logger.info(
                "%s departs from Llama's forward (%s), which the fused decode step does not cover yet: decode "
                "steps run layer by layer, on the same kernels",
                self.model.spec.model_type,
                ", ".join(uncovered),
            )

    def _take_scratch_block(self) -> int:
        scratch = self.pool.pages.take(1, PageUse.KV)  # no sequence owns it
        assert scratch is not None
        return scratch[0]

    @torch.inference_mode()
    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """The step's copy-on-write block copies; before `run`, which may run the step again in parts."""
        if copies:
            sources, destinations = zip(*copies, strict=True)
            self.pool.copy_blocks(list(sources), list(destinations))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Forward and sample the batch; its block copies must be done (`copy_blocks`)."""
        masks = self.token_masks.start(batch.sampling_rows)  # computed while the forward pass runs
        hidden = None
        logits_index: torch.Tensor | None = None  # the rows of `hidden` to sample, in order; None: all of them
        if self.fused_step is not None and batch.decodes and not batch.prefills:
            hidden = self.fused_step.run(self.decode_rows(batch.decodes))
        if hidden is not None:
            samplers = [row for row, item in enumerate(batch.decodes) for _ in item.samplers]
            if samplers != list(range(hidden.shape[0])):  # most decode steps sample each row once
                logits_index = torch.tensor(samplers, dtype=torch.long, device=self.device)
        else:
            inputs = self.prepare_inputs(batch)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attention, self.pool.kv_caches, inputs.lora)
            logits_index = inputs.logits_index
        self.faults.check(batch)
        sampled_rows = hidden if logits_index is None else hidden.index_select(0, logits_index)
        logits = self.model.logits(sampled_rows).float()  # [S, vocab] float32
        return self.sampler(logits, batch.sampling_rows, None if masks is None else masks.result())

    def decode_rows(self, decodes: list[ScheduledSequence]) -> DecodeRows:
        """The decodes row by row: a fused step's inputs, or the first rows of the model's step."""
        bs = self.block_size
        rows = DecodeRows([], [], [], [], [], [], [])
        for item in decodes:
            seq, position = item.seq, item.start
            rows.input_ids.append(seq.token_ids[position])
            rows.positions.append(position)
            rows.slot_blocks.append(seq.block_table[position // bs])
            rows.slot_offsets.append(position % bs)
            rows.block_tables.append(seq.block_table)
            rows.context_lens.append(position + 1)
            rows.lora_slots.append(seq.lora_slot)
        return rows

    @staticmethod
    def is_unrecoverable(error: Exception) -> bool:
        """After a device fault (CUDA's illegal address, ...) neither the KV cache nor the adapters can be trusted."""
        return isinstance(error, torch.AcceleratorError) or "CUDA error" in str(error)

    def prepare_inputs(self, batch: ScheduledBatch) -> ModelInputs:
        decodes = self.decode_rows(batch.decodes)
        input_ids, positions = decodes.input_ids, decodes.positions
        blocks, offsets = decodes.slot_blocks, decodes.slot_offsets
        logits_index = [row for row, item in enumerate(batch.decodes) for _ in item.samplers]
        bs = self.block_size
        for item in batch.prefills:
            seq, start, end = item.seq, item.start, item.start + item.num_new_tokens
            chunk_positions = np.arange(start, end)
            table = np.asarray(seq.block_table)
            input_ids.extend(item.input_token_ids)
            positions.extend(chunk_positions.tolist())
            blocks.extend(table[chunk_positions // bs].tolist())
            offsets.extend((chunk_positions % bs).tolist())
            if item.drafts:  # logits at the pending token's row and every draft's
                logits_index.extend(range(len(input_ids) - item.num_new_tokens, len(input_ids)))
            else:
                logits_index.extend([len(input_ids) - 1] * len(item.samplers))
        scheduled = batch.scheduled
        lora = LoraBatch.build(
            self.adapter_slots,
            lengths=[item.num_new_tokens for item in scheduled],
            slot_ids=[item.seq.lora_slot for item in scheduled],
            backend=self.lora_backend,
        )
        parts = ((batch.decodes, 0), (batch.prefills, len(batch.decodes)))
        groups = [self._attention_group(items, token_start) for items, token_start in parts if items]
        device = self.device
        row_ends = None
        if self.model.reads_row_ends:
            ends = [item.start + item.num_new_tokens for item in batch.decodes + batch.prefills]
            lengths = [item.num_new_tokens for item in batch.decodes + batch.prefills]
            row_ends = torch.tensor(ends, device=device).repeat_interleave(torch.tensor(lengths, device=device))
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            attention=AttentionMetadata(
                slot_blocks=torch.tensor(blocks, dtype=torch.long, device=device),
                slot_offsets=torch.tensor(offsets, dtype=torch.long, device=device),
                groups=groups,
                decode_kernel=self.decode_kernel,
                row_ends=row_ends,
            ),
            logits_index=torch.tensor(logits_index, dtype=torch.long, device=device),
            lora=lora,
        )

    def _additive_mask(self, may_attend: torch.Tensor) -> torch.Tensor:
        """An additive mask in the model dtype (0 or -inf): SDPA would otherwise convert a bool mask in every layer."""
        bias = torch.zeros(may_attend.shape, dtype=self.dtype, device=self.device)
        return bias.masked_fill_(~may_attend, float("-inf"))

    def _attention_group(self, items: list[ScheduledSequence], token_start: int) -> AttentionGroup:
        """Pad the rows to one batch: queries to the longest chunk, keys to the longest context; and for
        the windowed layers, keys to the longest window's blocks."""
        query_lens = [item.num_new_tokens for item in items]
        starts = [item.start for item in items]
        max_query_len = max(query_lens)
        device = self.device
        # query_positions: [B, Lq]; a padded query row sits at its row's first position, among real keys.
        offsets = torch.arange(max_query_len, device=device).unsqueeze(0)
        lens = torch.tensor(query_lens, device=device).unsqueeze(1)
        first_positions = torch.tensor(starts, device=device).unsqueeze(1)
        query_positions = torch.where(offsets < lens, first_positions + offsets, first_positions)
        block_tables, attend_bias = self._keys(items, [0] * len(items), query_positions, None)
        window_tables = window_bias = None
        window = self.model.spec.sliding_window
        if window is not None:  # from the block of the first key the row's first query reaches
            first_blocks = [max(0, start - window + 1) // self.block_size for start in starts]
            window_tables, window_bias = self._keys(items, first_blocks, query_positions, window)
        padded_index = None
        if any(n != max_query_len for n in query_lens):
            padded_rows = [row * max_query_len + torch.arange(n, device=device) for row, n in enumerate(query_lens)]
            padded_index = torch.cat(padded_rows)
        return AttentionGroup(
            token_start=token_start,
            token_end=token_start + sum(query_lens),
            max_query_len=max_query_len,
            block_tables=block_tables,
            attend_bias=attend_bias,
            window_tables=window_tables,
            window_bias=window_bias,
            padded_index=padded_index,
            context_lens=torch.tensor([s + n for s, n in zip(starts, query_lens, strict=True)], device=device),
        )

    def _keys(
        self, items: list[ScheduledSequence], first_blocks: list[int], query_positions: torch.Tensor, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks each row reads, from its `first_blocks` entry to its last, padded to one width with
        block 0 (masked out), and the additive mask [B, 1, Lq, width * block_size] of the keys each query
        attends: those at or before it (and within `window` of it, where given)."""
        bs, device = self.block_size, self.device
        ends = [-(-(item.start + item.num_new_tokens) // bs) for item in items]
        width = max(end - first for end, first in zip(ends, first_blocks, strict=True))
        tables = [item.seq.block_table[first : first + width] for item, first in zip(items, first_blocks, strict=True)]
        tables = [table + [0] * (width - len(table)) for table in tables]
        keys = torch.tensor(first_blocks, device=device).unsqueeze(1) * bs + torch.arange(width * bs, device=device)
        keys, queries = keys.unsqueeze(1), query_positions.unsqueeze(2)  # [B, 1, L], [B, Lq, 1]
        may_attend = keys <= queries
        if window is not None:
            may_attend &= keys > queries - window
        return torch.tensor(tables, dtype=torch.long, device=device), self._additive_mask(may_attend.unsqueeze(1))
