"""CPU_ATTN with eviction (vLLM 0.26 CPU).

CPU cache layout (HND): [num_blocks, H_kv, block_size, 2*D]; viewed as [B, H, 2N, D] the first N rows
of each (block, head) hold that page's keys TRANSPOSED ([D, N] in memory), the next N its values.
Viewed as [B*H, 1, 2N, D] each (block, head) page becomes a block of a one-KV-head cache: the per-head
view the kernels run on. Writes go through vLLM's own `cpu_attn_reshape_and_cache`.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from vllm_evict.engine.attention import EvictionAttentionMixin, EvictionMetadataBuilderMixin


class CpuPagedCache:
    def __init__(self, kv_cache: torch.Tensor, isa: str, k_scale: float, v_scale: float, dtype_str: str):
        B, H, N, two_d = kv_cache.shape
        D = two_d // 2
        self.num_heads, self.page_size, self.head_dim = H, N, D
        self.dtype, self.device = kv_cache.dtype, kv_cache.device
        self.key, self.value = kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)
        self.key_pages, self.value_pages = kv_cache.view(B * H, 1, 2 * N, D).chunk(2, dim=2)
        pages = kv_cache.view(B * H, 2, N * D)
        self.page_keys, self.page_values = pages[:, 0].view(B * H, D, N), pages[:, 1].view(B * H, N, D)
        self.isa, self.k_scale, self.v_scale, self.dtype_str = isa, k_scale, v_scale, dtype_str

    @property
    def stored_dim(self) -> int:
        """Elements of one token's key (or value) of one head as compaction gathers it."""
        return self.head_dim

    @property
    def gathered_bytes(self) -> int:
        """Bytes of one token's gathered K and V of one head (a model-dtype cache: no dequantized copy)."""
        return 2 * self.head_dim * self.dtype.itemsize

    @staticmethod
    def dequantize(caches: list["CpuPagedCache"], keys: torch.Tensor, values: torch.Tensor, queries):
        """Scoring's view of gathered K/V and window queries: the model-dtype cache's own values."""
        return keys, values, queries

    def gather_prefix(self, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [n, H, D] of the first n tokens stored in `blocks` (standard layout)."""
        nb, H, N, D = blocks.numel(), self.num_heads, self.page_size, self.head_dim
        blocks = blocks.long()
        keys = self.key[blocks].reshape(nb, H, D, N).transpose(2, 3)
        keys = keys.permute(0, 2, 1, 3).reshape(nb * N, H, D)[:n]
        values = self.value[blocks].permute(0, 2, 1, 3).reshape(nb * N, H, D)[:n]
        return keys, values

    def write_tokens(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write keys/values [T, H, D] of scheduled tokens to their per-head slots [T, H]."""
        D = self.head_dim
        self.write_pages(keys.reshape(-1, D), values.reshape(-1, D), slots.reshape(-1))

    @staticmethod
    def gather_layers(caches: list["CpuPagedCache"], blocks: torch.Tensor, n: int, keys: torch.Tensor,
                      values: torch.Tensor) -> None:
        """keys/values [n, R, G, H, D] <- the first n prompt tokens of R requests (blocks [R, nb]) in G layers."""
        for r, request_blocks in enumerate(blocks):
            for g, cache in enumerate(caches):
                keys[:, r, g], values[:, r, g] = cache.gather_prefix(request_blocks, n)

    @staticmethod
    def gather_held(caches: list["CpuPagedCache"], slots: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> None:
        """keys/values [n, G, H, D] <- the tokens at per-head slots [G, n, H] (page * N + offset; zero where
        -1) of G layers (a layer may repeat)."""
        for g, cache in enumerate(caches):
            held = (slots[g] >= 0).unsqueeze(-1)
            page, offset = slots[g].clamp(min=0) // cache.page_size, slots[g].clamp(min=0) % cache.page_size
            keys[:, g] = torch.where(held, cache.page_keys[page, :, offset], 0)
            values[:, g] = torch.where(held, cache.page_values[page, offset], 0)

    @staticmethod
    def write_layers(caches: list["CpuPagedCache"], keys: torch.Tensor, values: torch.Tensor,
                     slots: torch.Tensor) -> None:
        """Write keys/values [n, G, H, D] to per-head slots [G, n, H] (-1 = skip) of G layers."""
        n, _, H, D = keys.shape
        for g, cache in enumerate(caches):
            cache.write_pages(keys[:, g].reshape(n * H, D), values[:, g].reshape(n * H, D), slots[g].reshape(-1))

    def write_pages(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write keys/values [M, D] to per-head slots (page * N + offset)."""
        ops.cpu_attn_reshape_and_cache(keys.unsqueeze(1).contiguous(), values.unsqueeze(1).contiguous(),
                                       self.key_pages, self.value_pages, slots.to(torch.int64), self.isa,
                                       k_scale=self.k_scale, v_scale=self.v_scale,
                                       kv_cache_dtype=self.dtype_str)


class EvictCPUAttentionImpl(EvictionAttentionMixin, CPUAttentionBackendImpl):
    backend_name = "CPU_ATTN"

    def _paged_cache(self, layer, kv_cache) -> CpuPagedCache:
        return CpuPagedCache(kv_cache, self.isa, layer._k_scale_float, layer._v_scale_float, self.kv_cache_dtype)

    def _stock_attention(self, layer, query, key, value, kv_cache, md, output) -> None:
        # CPUAttentionBackendImpl.forward minus its second KV write (do_kv_cache_update already wrote).
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        n = md.num_actual_tokens
        ops.cpu_attention_with_kv_cache(
            query=query[:n], key_cache=key_cache, value_cache=value_cache, output=output[:n],
            query_start_loc=md.query_start_loc, seq_lens=md.seq_lens, scale=self.scale, causal=md.causal,
            alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window, block_table=md.block_table,
            softcap=self.logits_soft_cap, scheduler_metadata=md.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=md.dynamic_causal, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)

    def _per_head_attention(self, q, cache, qsl, seq_lens, block_table, max_query_len, max_seq_len, out):
        if self.sinks is None:
            return self._virtual_attention(q, cache, qsl, seq_lens, block_table, out, None)
        # Attention sinks (GPT-OSS) are per query head, and one call takes one [g] vector for all its
        # sequences: one call per KV head, its virtual sequences (rows h*R .. h*R+R-1, queries in order).
        H = self.num_kv_heads
        R, g = seq_lens.numel() // H, q.shape[1]
        starts = qsl.tolist()
        for h in range(H):
            lo, hi = starts[h * R], starts[(h + 1) * R]
            rows = slice(h * R, (h + 1) * R)
            self._virtual_attention(q[lo:hi], cache, qsl[h * R: (h + 1) * R + 1] - lo, seq_lens[rows],
                                    block_table[rows], out[lo:hi], self.sinks[h * g: (h + 1) * g])

    def _virtual_attention(self, q, cache, qsl, seq_lens, block_table, out, sinks) -> None:
        g, D = q.shape[1], q.shape[2]
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.numel(), num_heads=g, num_kv_heads=1, head_dim=D, seq_lens=seq_lens,
            dtype=q.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=cache.key_pages, value_cache=cache.value_pages, output=out,
            query_start_loc=qsl, seq_lens=seq_lens, scale=self.scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=block_table, softcap=self.logits_soft_cap,
            scheduler_metadata=metadata, s_aux=sinks, k_scale=cache.k_scale, v_scale=cache.v_scale,
            kv_cache_dtype=self.kv_cache_dtype)


class EvictCPUAttentionMetadataBuilder(EvictionMetadataBuilderMixin, CPUAttentionMetadataBuilder):
    pass


class EvictCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return EvictCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return EvictCPUAttentionMetadataBuilder
