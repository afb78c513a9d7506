"""Our Llama-family forward (Llama, Mistral, Qwen2, SmolLM): reads like the architecture.

Tokens of the whole step are flattened to `[T, hidden]`; only attention knows about
sequences, through `AttentionMetadata`. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from loraserve.models.attention import AttentionMetadata, paged_attention
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


@dataclass(frozen=True)
class LlamaSpec:
    """The shapes of a Llama-family model, read from its HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> LlamaSpec:
        num_heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            max_positions=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama and Mistral say so in attention_bias.
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


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


class LlamaAttention(nn.Module):
    def __init__(self, spec: LlamaSpec, layer_index: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, spec.hidden_size, False, dtype, device)
        self.scale = spec.head_dim**-0.5
        self.layer_ops = TORCH_OPS

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        lora: LoraDelta | None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = project(self.qkv_proj, x, lora, self.layer_index, ("q_proj", "k_proj", "v_proj"))  # [T, (Hq + 2 Hkv) * D]
        k_cache, v_cache = kv_cache
        slots = (metadata.slot_blocks, metadata.slot_offsets)
        self.layer_ops.rotary_store_kv(qkv, cos, sin, self.num_heads, k_cache, v_cache, *slots)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)  # rotated in place
        attended = paged_attention(q, k_cache, v_cache, metadata, self.scale)
        attended = attended.reshape(num_tokens, self.q_size)
        return project(self.o_proj, attended, lora, self.layer_index, ("o_proj",))


class LlamaMLP(nn.Module):
    def __init__(self, spec: LlamaSpec, layer_index: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, False, dtype, device)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, False, dtype, device)
        self.layer_ops = TORCH_OPS

    def forward(self, x: torch.Tensor, lora: LoraDelta | None) -> torch.Tensor:
        gate_up = project(self.gate_up_proj, x, lora, self.layer_index, ("gate_proj", "up_proj"))  # [T, 2I]
        hidden = self.layer_ops.silu_mul(gate_up)  # [T, I]
        return project(self.down_proj, hidden, lora, self.layer_index, ("down_proj",))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, layer_index: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(spec, layer_index, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(spec, layer_index, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,  # the residual stream before x is added; None in the first layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        lora: LoraDelta | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, the residual stream it adds to)
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, metadata, lora)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, lora), residual


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and (tied or separate) LM head."""

    def __init__(self, spec: LlamaSpec, rope: RotaryEmbedding, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.spec, self.rope, self.dtype = spec, rope, dtype
        self.embed_tokens = empty_param(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, i, dtype, device) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, False, dtype, device)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        metadata: AttentionMetadata,
        kv_caches: list[KVCache],  # one per layer
        lora: LoraDelta | None = None,  # None: no row of the step uses an adapter
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        cos, sin = self.rope.cos[positions], self.rope.sin[positions]  # [T, head_dim] each
        x, residual = F.embedding(input_ids, self.embed_tokens).to(self.dtype), None
        for layer, kv_cache in zip(self.decoder_layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, metadata, lora)
        return self.norm(x, residual)[0]

    @property
    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return cast(list[LlamaDecoderLayer], list(self.layers))

    def use_layer_ops(self, layer_ops: LayerOps | None) -> None:
        """Run norms, rotary + K/V writes and SiLU through the platform's ops; None: torch's."""
        for module in self.modules():
            if isinstance(module, RMSNorm | LlamaAttention | LlamaMLP):
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
        """Every HF checkpoint tensor name this model needs -> (parameter, rows it fills)."""
        whole = slice(None)
        targets: dict[str, tuple[torch.Tensor, slice]] = {
            "model.embed_tokens.weight": (self.embed_tokens, whole),
            "model.norm.weight": (self.norm.weight, whole),
        }
        if not self.spec.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head.weight, whole)
        for i, layer in enumerate(self.decoder_layers):
            prefix = f"model.layers.{i}."
            for name, (block, linear, rows) in self._projections(i).items():
                targets[f"{prefix}{block}.{name}.weight"] = (linear.weight, rows)
                if linear.bias is not None:
                    targets[f"{prefix}{block}.{name}.bias"] = (linear.bias, rows)
            targets[f"{prefix}input_layernorm.weight"] = (layer.input_layernorm.weight, whole)
            targets[f"{prefix}post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, whole)
        return targets
