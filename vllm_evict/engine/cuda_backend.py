"""FLASH_ATTN with eviction (vLLM 0.26 CUDA, FlashAttention 2/3 from vllm_flash_attn).

The cache is required in HND layout: logical and physical [num_blocks, H_kv, N, 2*D] with K and V
packed in the last dim. Viewed as [B*H, N, 1, 2*D] every (block, head) page is a block of a
one-KV-head cache (page id = block*H + head): the per-head view FlashAttention runs on with
`nheads_k = 1` and the g query heads of the group as its query heads.
"""

from __future__ import annotations

import torch
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, reshape_and_cache_flash

from vllm_evict.engine.attention import EvictionAttentionMixin


class CudaPagedCache:
    def __init__(self, kv_cache: torch.Tensor, head_size: int, kv_cache_dtype: str, k_scale, v_scale):
        B, H, N, two_d = kv_cache.shape
        self.kv_cache, self.num_heads, self.page_size, self.head_dim = kv_cache, H, N, head_size
        paged = kv_cache.view(B * H, 1, N, two_d).transpose(1, 2)           # [B*H, N, 1, 2D]
        key_pages, value_pages = paged.split(head_size, dim=-1)
        self.key_pages = canonicalize_singleton_dim_strides(key_pages)
        self.value_pages = canonicalize_singleton_dim_strides(value_pages)
        self.kv_cache_dtype, self.k_scale, self.v_scale = kv_cache_dtype, k_scale, v_scale

    def gather_prefix(self, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        nb, H, N, D = blocks.numel(), self.num_heads, self.page_size, self.head_dim
        pages = self.kv_cache[blocks.long()].permute(0, 2, 1, 3).reshape(nb * N, H, 2 * D)[:n]
        return pages[..., :D], pages[..., D:]

    def write_tokens(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write keys/values [T, H, D] of scheduled tokens to their per-head slots [T, H]: rows of the
        contiguous HND cache are exactly the slots (page * N + offset), so two index_puts, no copies."""
        rows = self.kv_cache.view(-1, 2 * self.head_dim)
        rows[:, : self.head_dim].index_put_((slots,), keys)
        rows[:, self.head_dim:].index_put_((slots,), values)

    def write_pages(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write keys/values [M, D] to per-head slots [M] (page * N + offset; -1 = skip)."""
        reshape_and_cache_flash(keys.unsqueeze(1), values.unsqueeze(1), self.key_pages, self.value_pages,
                                slots.to(torch.int64), self.kv_cache_dtype, self.k_scale, self.v_scale)


class EvictFlashAttentionImpl(EvictionAttentionMixin, FlashAttentionImpl):
    def _paged_cache(self, layer, kv_cache) -> CudaPagedCache:
        return CudaPagedCache(kv_cache, self.head_size, self.kv_cache_dtype, layer._k_scale, layer._v_scale)

    def _stock_attention(self, layer, query, key, value, kv_cache, md, output) -> None:
        FlashAttentionImpl.forward(self, layer, query, key, value, kv_cache, md, output)

    def _per_head_attention(self, q, cache, qsl, seq_lens, block_table, max_query_len, max_seq_len, out):
        flash_attn_varlen_func(
            q=q, k=cache.key_pages, v=cache.value_pages, out=out, cu_seqlens_q=qsl, max_seqlen_q=max_query_len,
            seqused_k=seq_lens, max_seqlen_k=max_seq_len, softmax_scale=self.scale, causal=True,
            alibi_slopes=None, window_size=None, block_table=block_table, softcap=self.logits_soft_cap,
            scheduler_metadata=None, fa_version=self.vllm_flash_attn_version)


class EvictFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    # FlashAttention's own CUDA-graph support: a FULL graph replays the stock attention, which is right
    # for every step whose plan needs no attention call (worker.py's dispatcher hook keeps the others
    # off FULL graphs).

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False  # cascade assumes shared leading blocks; compacted requests own private ones


class EvictFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return EvictFlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return EvictFlashAttentionMetadataBuilder

    @classmethod
    def get_required_kv_cache_layout(cls):
        return "HND"
