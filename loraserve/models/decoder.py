"""The one decoder: Llama's forward, with the departures a DecoderSpec names (decoder_spec.py) for
the other families (families/). It reads like the architecture.

Tokens of the whole step are flattened to `[T, hidden]`; only attention knows about
sequences, through `AttentionMetadata`. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.models.attention import AttentionMetadata, paged_attention
from loraserve.models.decoder_spec import GLOBAL_ROPE, DecoderSpec
from loraserve.models.layer_ops import LayerOps
from loraserve.models.linear import HeldWeight, Linear, empty_param
from loraserve.models.rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, Hkv, D] each
TORCH_OPS = LayerOps()  # where the platform has no fused ops for the dtype


class LoraDelta(Protocol):
    """What the model needs of LoRA: add each row's adapter delta at a projection (lora/batch.py),
    started before the projection's own product so that it may run beside it."""

    def start(self, layer: int, projections: tuple[str, ...], x: torch.Tensor) -> object: ...

    def add(
        self, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor, started: object = None
    ) -> None: ...


def project(
    linear: Linear, x: torch.Tensor, lora: LoraDelta | None, layer: int, projections: tuple[str, ...]
) -> torch.Tensor:
    """linear(x), plus each row's adapter delta at these projections (fused in `linear` in this order)."""
    started = lora.start(layer, projections, x) if lora is not None else None
    out = linear(x)
    if lora is not None:
        lora.add(layer, projections, x, out, started)
    return out


class RMSNorm(nn.Module):
    """The norm of the residual stream, fused with the add that updates the stream (as vLLM does)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)
        self.eps = eps
        self.layer_ops = TORCH_OPS  # the platform's, set by use_layer_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum written into `residual`; without one (norm(x), x)."""
        return self.layer_ops.add_rms_norm(x, residual, self.weight, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_index: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, spec.hidden_size, spec.o_bias, dtype, device)
        self.scale, self.softcap = spec.scale, spec.attention_softcap
        self.window, self.rope = spec.window(layer_index), spec.rope(layer_index)
        if spec.qk_norm is not None:
            q_width, k_width = (spec.head_dim,) * 2 if spec.qk_norm == "head" else (self.q_size, self.kv_size)
            self.q_norm = RMSNorm(q_width, spec.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(k_width, spec.rms_norm_eps, dtype, device)
        self.layer_ops = TORCH_OPS

    def forward(
        self,
        x: torch.Tensor,
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],  # each table's (cos, sin) of the step's tokens
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        lora: LoraDelta | None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = project(self.qkv_proj, x, lora, self.layer_index, ("q_proj", "k_proj", "v_proj"))  # [T, (Hq + 2 Hkv) * D]
        if hasattr(self, "q_norm"):
            self._norm_q_and_k(qkv)
        k_cache, v_cache = kv_cache
        slots = (metadata.slot_blocks, metadata.slot_offsets)
        cos, sin = rotary[self.rope]
        rotary_ops = self.layer_ops if cos.shape[1] == self.head_dim else TORCH_OPS  # kernels rotate whole heads
        rotary_ops.rotary_store_kv(qkv, cos, sin, self.num_heads, k_cache, v_cache, *slots)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)  # rotated in place
        attended = paged_attention(q, k_cache, v_cache, metadata, self.scale, self.window, self.softcap)
        attended = attended.reshape(num_tokens, self.q_size)
        return project(self.o_proj, attended, lora, self.layer_index, ("o_proj",))

    def _norm_q_and_k(self, qkv: torch.Tensor) -> None:
        """q and k RMS-normalized in place, before the rotary: per head, or over all heads at once."""
        num_tokens = qkv.shape[0]
        for norm, columns in ((self.q_norm, slice(0, self.q_size)), (self.k_norm, self.k_columns)):
            rows = qkv[:, columns].reshape(-1, norm.weight.shape[0]).contiguous()  # [T * heads, D] or [T, heads * D]
            qkv[:, columns] = norm(rows, None)[0].view(num_tokens, -1)

    @property
    def k_columns(self) -> slice:
        return slice(self.q_size, self.q_size + self.kv_size)


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_index: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, spec.mlp_bias, dtype, device)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, spec.mlp_bias, dtype, device)
        self.activation = spec.activation
        self.layer_ops = TORCH_OPS

    def forward(self, x: torch.Tensor, lora: LoraDelta | None) -> torch.Tensor:
        gate_up = project(self.gate_up_proj, x, lora, self.layer_index, ("gate_proj", "up_proj"))  # [T, 2I]
        if self.activation == "silu":
            hidden = self.layer_ops.silu_mul(gate_up)  # [T, I]
        else:
            hidden = self.layer_ops.gelu_tanh_mul(gate_up)
        return project(self.down_proj, hidden, lora, self.layer_index, ("down_proj",))


class DecoderLayer(nn.Module):
    """Attention and MLP, each adding to the residual stream, with the family's norms around them
    (DecoderSpec.norms): each norm adds what it is given to the stream first, fused (RMSNorm)."""

    def __init__(self, spec: DecoderSpec, layer_index: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.norms, self.residual_scale = spec.norms, spec.residual_scale

        def norm() -> RMSNorm:
            return RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)

        # The checkpoint's names: what a norm of a name does depends on the placement (forward).
        if spec.norms != "post":
            self.input_layernorm = norm()
        self.self_attn = SelfAttention(spec, layer_index, dtype, device)
        self.post_attention_layernorm = norm()
        if spec.norms == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if spec.norms != "pre":
            self.post_feedforward_layernorm = norm()
        self.mlp = MLP(spec, layer_index, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,  # the residual stream before x is added; None in the first layer
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        lora: LoraDelta | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, the residual stream it adds to)
        def attend(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(h, rotary, kv_cache, metadata, lora)

        if self.norms == "pre":  # Llama
            x, residual = self.input_layernorm(x, residual)
            x, residual = self.post_attention_layernorm(self._scaled(attend(x)), residual)
            return self._scaled(self.mlp(x, lora)), residual
        if self.norms == "sandwich":  # Gemma
            x, residual = self.input_layernorm(x, residual)
            x = self.post_attention_layernorm(attend(x), None)[0]
            x, residual = self.pre_feedforward_layernorm(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x, lora), None)[0], residual
        # "post", OLMo 2: the blocks read the stream itself, their outputs are normalized.
        stream = x if residual is None else residual.add_(x)
        stream.add_(self.post_attention_layernorm(attend(stream), None)[0])
        return self.post_feedforward_layernorm(self.mlp(stream, lora), None)[0], stream

    def _scaled(self, block_output: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the stream (Granite's residual multiplier)."""
        return block_output if self.residual_scale == 1.0 else block_output * self.residual_scale


class DecoderForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and (tied or separate) LM head."""

    def __init__(self, spec: DecoderSpec, ropes: dict[str, RotaryEmbedding], dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.spec, self.ropes, self.dtype = spec, ropes, dtype
        self.embed_tokens = empty_param(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        # As transformers scales it: the factor in the model dtype.
        self.embedding_scale = torch.tensor(spec.embedding_scale, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype, device) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, False, dtype, device)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens

    @property
    def rope(self) -> RotaryEmbedding:
        """The rotary table every layer reads (not Gemma 3's, which has two)."""
        return self.ropes[GLOBAL_ROPE]

    def departures(self) -> list[str]:
        """How this model's forward departs from Llama's, in words (DecoderSpec.departures and the rotary's)."""
        ropes = self.ropes.values()
        return [
            *self.spec.departures(),
            *(["LongRoPE"] if any(rope.long_after is not None for rope in ropes) else []),
            *(["partial rotary"] if any(rope.rotary_dim != self.spec.head_dim for rope in ropes) else []),
        ]

    @property
    def reads_row_ends(self) -> bool:
        """Whether the rotary needs each row's end in the step (LongRoPE, rope.py)."""
        return any(rope.long_after is not None for rope in self.ropes.values())

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        metadata: AttentionMetadata,
        kv_caches: list[KVCache],  # one per layer
        lora: LoraDelta | None = None,  # None: no row of the step uses an adapter
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        rotary = {name: rope.lookup(positions, metadata.row_ends) for name, rope in self.ropes.items()}
        x, residual = F.embedding(input_ids, self.embed_tokens).to(self.dtype), None
        if self.spec.embedding_scale != 1.0:
            x = x * self.embedding_scale
        for layer, kv_cache in zip(self.decoder_layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rotary, kv_cache, metadata, lora)
        return self.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] after the final norm -> [S, vocab]: the LM head, then Granite's divisor and
        Gemma 2's soft-capping where the family has them."""
        logits = self.lm_head(hidden)
        if self.spec.logit_divisor != 1.0:
            logits = logits / self.spec.logit_divisor
        if self.spec.logit_softcap is not None:
            logits = torch.tanh(logits / self.spec.logit_softcap) * self.spec.logit_softcap
        return logits

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))

    def use_layer_ops(self, layer_ops: LayerOps | None) -> None:
        """Run norms, rotary + K/V writes and SiLU through the platform's ops; None: torch's."""
        for module in self.modules():
            if isinstance(module, RMSNorm | SelfAttention | MLP):
                module.layer_ops = layer_ops or TORCH_OPS

    def hold_weights(self, held: Callable[[str, torch.Tensor], HeldWeight], embedding_dtype: torch.dtype) -> None:
        """After loading: every matmul weight held only as `held(module name, weight)`, the platform's
        form (cpu/platform.py), and the embedding table, only looked up a row at a time, in `embedding_dtype`."""
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.hold(held(name, module.weight.data))
        self.embed_tokens = nn.Parameter(self.embed_tokens.data.to(embedding_dtype), requires_grad=False)

    def projection(self, layer: int, projection: str) -> tuple[Linear, slice]:
        """The matmul computing a LoRA target projection ("q_proj", ...) of a layer, and its output columns."""
        return self._projections(layer)[projection][1:]

    def _projections(self, layer: int) -> dict[str, tuple[str, Linear, slice]]:
        """Each projection of the HF layer -> (its block, the fused matmul computing it, its output columns)."""
        attn, mlp = self.decoder_layers[layer].self_attn, self.decoder_layers[layer].mlp
        q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
        return {
            "q_proj": ("self_attn", attn.qkv_proj, slice(0, q)),
            "k_proj": ("self_attn", attn.qkv_proj, slice(q, q + kv)),
            "v_proj": ("self_attn", attn.qkv_proj, slice(q + kv, q + 2 * kv)),
            "o_proj": ("self_attn", attn.o_proj, slice(None)),
            "gate_proj": ("mlp", mlp.gate_up_proj, slice(0, inter)),
            "up_proj": ("mlp", mlp.gate_up_proj, slice(inter, None)),
            "down_proj": ("mlp", mlp.down_proj, slice(None)),
        }

    def hf_weight_targets(self) -> dict[str, tuple[torch.Tensor, slice]]:
        """Every HF checkpoint tensor name this model needs -> (parameter, rows it fills). Each module of
        the checkpoint (one projection, or several fused: DecoderSpec.fused_projections) fills its rows."""
        whole = slice(None)
        targets: dict[str, tuple[torch.Tensor, slice]] = {
            "model.embed_tokens.weight": (self.embed_tokens, whole),
            "model.norm.weight": (self.norm.weight, whole),
        }
        if not self.spec.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head.weight, whole)
        for i, layer in enumerate(self.decoder_layers):
            prefix = f"model.layers.{i}."
            projections = self._projections(i)
            for module, held in self.spec.module_projections().items():
                block, linear, first = projections[held[0]]
                rows = slice(first.start, projections[held[-1]][2].stop)
                targets[f"{prefix}{block}.{module}.weight"] = (linear.weight, rows)
                if linear.bias is not None:
                    targets[f"{prefix}{block}.{module}.bias"] = (linear.bias, rows)
            for name, norm in layer.named_modules():
                if isinstance(norm, RMSNorm):
                    targets[f"{prefix}{name}.weight"] = (norm.weight, whole)
        return targets
