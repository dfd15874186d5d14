"""TRITON_ATTN with eviction (vLLM 0.26 CUDA): vLLM's backend for the per-token-head quantized caches
(`--kv-cache-dtype int8_per_token_head`, `fp8_per_token_head`, `int4_per_token_head`), and for model-dtype
caches where a user picks it (`--attention-backend TRITON_ATTN`).

The cache is required in HND layout, as FLASH_ATTN's: [num_blocks, H_kv, N, 2*W] with K and V packed in the
last dim. For a model-dtype cache W = D and the adapter is cuda_backend's. A per-token-head cache stores
each (token, head) half as `[data | fp32 scale]`: W = D + 4 bytes for int8 / fp8 data, D/2 + 4 for int4
(two values a byte, even index in the low nibble; the scale's low 4 mantissa bits hold the zero point;
the data is the key or value after vLLM's fixed randomized Hadamard rotation). vLLM's attention reads the
scales through strided fp32 views over the same bytes, so a token's bytes carry its scale with them:
compaction moves W-byte halves unchanged (as 32-bit words, W being a multiple of 4), and scoring reads
them dequantized (`dequantize`): data x scale (int4: (nibble - zero point) x scale, rotated back), in the
model dtype. Queries reach attention unquantized on these caches, so the window queries are the layer's own.

Attention is vLLM's own (uniformly compacted requests are stock requests with shifted positions). The
per-head path that Ada-KV needs is not built on this backend: check_on_engine refuses Ada-KV here.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

from vllm_evict.engine.attention import EvictionAttentionMixin, EvictionMetadataBuilderMixin, decode_graph_tables
from vllm_evict.engine.hnd_cache import HndPagedCache, paged_cache

SCALE_BYTES = 4  # one fp32 scale after each (token, head)'s K data and after its V data


class PerTokenHeadPagedCache(HndPagedCache):
    """A per-token-head cache [num_blocks, H, N, 2*W] (int8 or uint8 bytes) seen as 32-bit words: compaction
    gathers and writes a token's [data | scale] halves (stored_dim words each) without reading them."""

    def __init__(self, kv_cache: torch.Tensor, head_size: int, kv_cache_dtype: str, model_dtype: torch.dtype):
        self.mode = get_kv_quant_mode(kv_cache_dtype)
        words = kv_cache.view(torch.int32)  # [B, H, N, 2*W/4]
        _, H, N, _ = words.shape
        self.kv_cache, self.num_heads, self.page_size, self.head_dim = words, H, N, head_size
        self.dtype, self.device, self.model_dtype = words.dtype, words.device, model_dtype

    @property
    def gathered_bytes(self) -> int:
        return 2 * (self.stored_dim * 4 + self.head_dim * self.model_dtype.itemsize)

    @staticmethod
    def dequantize(caches: list["PerTokenHeadPagedCache"], keys: torch.Tensor, values: torch.Tensor,
                   queries: torch.Tensor | None) -> tuple:
        """Scoring's view of gathered halves [..., W/4] (int32 words) of keys and values: [..., D] in the model
        dtype, as vLLM's attention computes with them. Queries are unchanged (never quantized here)."""
        first = caches[0]
        return (dequantize_halves(keys, first.mode, first.head_dim).to(first.model_dtype),
                dequantize_halves(values, first.mode, first.head_dim).to(first.model_dtype), queries)


def dequantize_halves(halves: torch.Tensor, mode: KVQuantMode, head_dim: int) -> torch.Tensor:
    """[..., W/4] int32 words of [data | fp32 scale] halves -> [..., head_dim] float32 values."""
    raw = halves.view(torch.uint8)
    data, scale = raw[..., : raw.shape[-1] - SCALE_BYTES], raw[..., raw.shape[-1] - SCALE_BYTES:]
    scale_bits = scale.contiguous().view(torch.int32)  # [..., 1]
    if mode == KVQuantMode.INT8_PER_TOKEN_HEAD:
        return data.view(torch.int8).float() * scale_bits.view(torch.float32)
    if mode == KVQuantMode.FP8_PER_TOKEN_HEAD:
        return data.view(torch.float8_e4m3fn).float() * scale_bits.view(torch.float32)
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        from vllm.v1.attention.ops.int4_per_token_head import single_rht

        zero_point = (scale_bits & 0xF).float()
        step = (scale_bits & -16).view(torch.float32)
        nibbles = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)[..., :head_dim]  # even index low
        rotated = (nibbles.float() - zero_point) * step
        return single_rht(rotated, inverse=True) / head_dim
    raise ValueError(f"not a per-token-head KV cache mode: {mode}")


class EvictTritonAttentionImpl(EvictionAttentionMixin, TritonAttentionImpl):
    backend_name = "TRITON_ATTN"

    def _paged_cache(self, layer, kv_cache) -> HndPagedCache:
        return paged_cache(kv_cache, self.head_size, self.kv_cache_dtype, self.model_dtype, layer._k_scale,
                           layer._v_scale, layer._q_scale)

    def _stock_attention(self, layer, query, key, value, kv_cache, md, output) -> None:
        TritonAttentionImpl.forward(self, layer, query, key, value, kv_cache, md, output)


class EvictTritonAttentionMetadataBuilder(EvictionMetadataBuilderMixin, TritonAttentionMetadataBuilder):
    """The decode steps that record window queries or compact replay vLLM's attention in FULL graphs that
    also stage every layer's queries (step.StagedDecodeBatch): the tables' query buffer is that stage."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.per_head_decode = decode_graph_tables(  # queries stay unquantized on the caches it evicts
            kv_cache_spec, layer_names, vllm_config, device, self.decode_cudagraph_enabled,
            vllm_config.model_config.dtype, per_head_path=False)


class EvictTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return EvictTritonAttentionImpl

    @staticmethod
    def get_builder_cls():
        return EvictTritonAttentionMetadataBuilder

    @classmethod
    def get_required_kv_cache_layout(cls):
        return "HND"
