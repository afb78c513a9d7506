"""The CUDA platform: Triton kernels for the per-layer ops and decode attention, weights as loaded
(in the compute dtype), and decode steps replayed as CUDA graphs."""

from __future__ import annotations

import torch

from loraserve.models.attention import DecodeAttention
from loraserve.models.cuda.attention import paged_decode_attention
from loraserve.models.cuda.graphs import DecodeGraphs
from loraserve.models.cuda.layer_ops import CudaLayerOps
from loraserve.models.layer_ops import LayerOps
from loraserve.models.platform import FusedStep, Platform, StepPlan


class CudaPlatform(Platform):
    def layer_ops(self, dtype: torch.dtype) -> LayerOps | None:
        return CudaLayerOps()  # float32, bfloat16 and float16: every --dtype

    def decode_attention(self, dtype: torch.dtype) -> DecodeAttention | None:
        return paged_decode_attention

    def fused_step(self, plan: StepPlan) -> FusedStep | None:
        """The decode steps captured as CUDA graphs, per batch size up to --max-num-seqs (graphs.py)."""
        if plan.graphs is None:
            return None
        graphs = DecodeGraphs(
            plan.model, plan.kv_caches, plan.adapter_slots, paged_decode_attention,
            max_rows=plan.graphs.max_num_seqs, max_blocks=-(-plan.graphs.max_model_len // plan.block_size),
            scratch_block=plan.take_scratch_block(),
        )  # fmt: skip
        with torch.inference_mode():
            graphs.capture()
        return graphs
