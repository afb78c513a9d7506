"""Our Llama-family forward (Llama, Mistral, Qwen2, SmolLM): reads like the architecture.

Tokens of the whole step are flattened to `[T, hidden]`; only attention knows about
sequences, through `AttentionMetadata`. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from loraserve.models.attention import AttentionMetadata, paged_attention
from loraserve.models.rope import RotaryEmbedding, apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, Hkv, D] each


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


def _empty_param(*shape: int, dtype: torch.dtype, device: str) -> nn.Parameter:
    # Weights are filled by the loader; skipping random init saves seconds at start.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.weight = _empty_param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers computes it: normalize in float32, scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_weight = _empty_param(self.q_size + 2 * self.kv_size, spec.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = (
            _empty_param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device) if spec.qkv_bias else None
        )
        self.o_weight = _empty_param(spec.hidden_size, self.q_size, dtype=dtype, device=device)
        self.scale = spec.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        attended = paged_attention(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        return F.linear(attended.view(num_tokens, self.q_size), self.o_weight)


class LlamaMLP(nn.Module):
    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_weight = _empty_param(2 * spec.intermediate_size, spec.hidden_size, dtype=dtype, device=device)
        self.down_weight = _empty_param(spec.hidden_size, spec.intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(spec, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(spec, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and (tied or separate) LM head."""

    def __init__(self, spec: LlamaSpec, rope: RotaryEmbedding, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.spec, self.rope, self.dtype = spec, rope, dtype
        self.embed_tokens = _empty_param(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, dtype, device) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.lm_head = (
            self.embed_tokens
            if spec.tie_word_embeddings
            else _empty_param(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        metadata: AttentionMetadata,
        kv_caches: list[KVCache],  # one per layer
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        cos, sin = self.rope.lookup(positions)
        x = F.embedding(input_ids, self.embed_tokens)
        for layer, kv_cache in zip(self.decoder_layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, metadata)
        return self.norm(x)

    @property
    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        return cast(list[LlamaDecoderLayer], list(self.layers))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] -> logits [S, vocab] float32."""
        return F.linear(hidden, self.lm_head).float()

    def hf_weight_targets(self) -> dict[str, tuple[torch.Tensor, slice]]:
        """Every HF checkpoint tensor name this model needs -> (parameter, rows it fills)."""
        whole = slice(None)
        targets: dict[str, tuple[torch.Tensor, slice]] = {
            "model.embed_tokens.weight": (self.embed_tokens, whole),
            "model.norm.weight": (self.norm.weight, whole),
        }
        if not self.spec.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head, whole)
        for i, layer in enumerate(self.decoder_layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv_rows = {
                "q_proj": slice(0, attn.q_size),
                "k_proj": slice(attn.q_size, attn.q_size + attn.kv_size),
                "v_proj": slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size),
            }
            for name, rows in qkv_rows.items():
                targets[f"{prefix}self_attn.{name}.weight"] = (attn.qkv_weight, rows)
                if attn.qkv_bias is not None:
                    targets[f"{prefix}self_attn.{name}.bias"] = (attn.qkv_bias, rows)
            targets[f"{prefix}self_attn.o_proj.weight"] = (attn.o_weight, whole)
            targets[f"{prefix}mlp.gate_proj.weight"] = (mlp.gate_up_weight, slice(0, mlp.intermediate_size))
            targets[f"{prefix}mlp.up_proj.weight"] = (mlp.gate_up_weight, slice(mlp.intermediate_size, None))
            targets[f"{prefix}mlp.down_proj.weight"] = (mlp.down_weight, whole)
            targets[f"{prefix}input_layernorm.weight"] = (layer.input_layernorm.weight, whole)
            targets[f"{prefix}post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, whole)
        return targets
