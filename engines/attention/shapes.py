"""Attention geometries the primitive is exercised with, and their wire sizes.

MLA in its *absorbed* form attends query rows of width ``d_qk = kv_lora_rank + rope_dim`` (512 + 64
= 576 for DeepSeek-V2-Lite and V3/R1) against one shared latent per token (a single "KV head"); the
value is the first ``kv_lora_rank`` (512) dims of that same latent. Plain GQA groups ``n_q_heads``
query heads over ``n_kv_heads`` KV heads with separate K and V of ``head_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuhit.errors import ConfigError


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One attention geometry. ``latent`` means K and V are the same per-token vector (absorbed MLA)."""

    name: str
    n_q_heads: int
    n_kv_heads: int
    d_qk: int
    d_v: int
    latent: bool = False
    n_layers: int = 1

    def __post_init__(self) -> None:
        if min(self.n_q_heads, self.n_kv_heads, self.d_qk, self.d_v, self.n_layers) <= 0:
            raise ConfigError(f"attention shape {self.name!r}: all sizes must be positive")
        if self.n_q_heads % self.n_kv_heads:
            raise ConfigError(
                f"attention shape {self.name!r}: n_q_heads {self.n_q_heads} is not a multiple of "
                f"n_kv_heads {self.n_kv_heads}"
            )
        if self.latent and (self.n_kv_heads != 1 or self.d_v > self.d_qk):
            raise ConfigError(f"attention shape {self.name!r}: a latent (MLA) shape has one KV head and d_v <= d_qk")

    @property
    def group(self) -> int:
        return self.n_q_heads // self.n_kv_heads

    def query_row_bytes(self, elem_bytes: int = 2) -> int:
        """Bytes of one routed query row per head, as *Move the Query, Not the Cache* counts it (q = d_qk x 2 B for MLA)."""
        return self.d_qk * elem_bytes

    def partial_row_bytes(self, elem_bytes: int = 2) -> int:
        """Bytes of one returned partial row per head: o (d_v x elem) plus m and l in fp32."""
        return self.d_v * elem_bytes + 2 * 4

    def kv_bytes_per_token(self, elem_bytes: int = 2) -> int:
        """Resident KV bytes per token per layer (the latent once for MLA; K and V per KV head for GQA)."""
        if self.latent:
            return self.d_qk * elem_bytes
        return self.n_kv_heads * (self.d_qk + self.d_v) * elem_bytes


# DeepSeek-V2-Lite: 16 heads, kv_lora_rank 512 + qk_rope_head_dim 64, 27 layers (the instance *Move the Query, Not the Cache* measured).
MLA_DSV2_LITE = AttentionShape("mla-dsv2-lite", 16, 1, 576, 512, latent=True, n_layers=27)
# Frontier MLA (DeepSeek-V3/R1): 128 heads, same latent width, 61 layers.
MLA_FRONTIER = AttentionShape("mla-128h", 128, 1, 576, 512, latent=True, n_layers=61)
# Plain GQA, Llama-3-8B-like: 32 query heads over 8 KV heads of 128.
GQA_LLAMA8B = AttentionShape("gqa-32q8kv", 32, 8, 128, 128, n_layers=32)
