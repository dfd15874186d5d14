"""CPU_ATTN replacement: stock behaviour unless the batch holds compacted requests; then every request
row becomes H_kv per-head "virtual sequences" (own page table and length) in one kernel call.

CPU cache layout (vLLM 0.26 CPU_ATTN, HND): [num_blocks, H_kv, block_size, 2*D]; viewed as
[B, H, 2N, D] the first N rows of each (block, head) hold that page's keys TRANSPOSED ([D, N] in
memory), the next N rows its values. Viewed as [B*H, 1, 2N, D] each (block, head) page becomes a
block of a one-KV-head cache: that is the per-head view the kernels run on.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_evict.engine import per_head
from vllm_evict.engine.compaction import compaction_slots, plan_compaction
from vllm_evict.engine.worker import STATE


class CpuPagedCache:
    """Gather/scatter over one layer's CPU cache."""

    def __init__(self, kv_cache: torch.Tensor, isa: str, k_scale: float, v_scale: float, dtype_str: str):
        self.num_blocks, self.num_heads, self.page_size, two_d = kv_cache.shape
        self.head_dim = two_d // 2
        B, H, N, D = self.num_blocks, self.num_heads, self.page_size, self.head_dim
        self.key, self.value = kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)
        self.key_pages, self.value_pages = kv_cache.view(B * H, 1, 2 * N, D).chunk(2, dim=2)
        self.isa, self.k_scale, self.v_scale, self.dtype_str = isa, k_scale, v_scale, dtype_str

    def gather_prefix(self, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [n, H, D] of the first n tokens stored in `blocks` (standard layout)."""
        nb, H, N, D = blocks.numel(), self.num_heads, self.page_size, self.head_dim
        blocks = blocks.long()
        keys = self.key[blocks].reshape(nb, H, D, N).transpose(2, 3)
        keys = keys.permute(0, 2, 1, 3).reshape(nb * N, H, D)[:n]
        values = self.value[blocks].permute(0, 2, 1, 3).reshape(nb * N, H, D)[:n]
        return keys, values

    def write_pages(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write keys/values [M, D] to per-head slots (page * N + offset)."""
        ops.cpu_attn_reshape_and_cache(keys.unsqueeze(1).contiguous(), values.unsqueeze(1).contiguous(),
                                       self.key_pages, self.value_pages, slots.to(torch.int64), self.isa,
                                       k_scale=self.k_scale, v_scale=self.v_scale,
                                       kv_cache_dtype=self.dtype_str)


class EvictCPUAttentionImpl(CPUAttentionBackendImpl):
    def _cache(self, layer, kv_cache) -> CpuPagedCache:
        return CpuPagedCache(kv_cache, self.isa, layer._k_scale_float, layer._v_scale_float, self.kv_cache_dtype)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        plan = STATE.plan
        if plan is None or not plan.per_head or self.kv_sharing_target_layer_name is not None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # The per-head tables need the attention metadata; the forward writes in that case.

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        plan = STATE.plan
        if attn_metadata is None or plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        layer_idx = extract_layer_index(layer.layer_name)
        num_tokens = attn_metadata.num_actual_tokens
        for cap in plan.captures:
            buf = cap.state.q_window.get(layer_idx)
            if buf is None:
                buf = cap.state.q_window[layer_idx] = query.new_empty(cap.state.window, *query.shape[1:])
            buf[cap.window_offset: cap.window_offset + cap.count] = query[cap.token_start: cap.token_start + cap.count]
        cache = self._cache(layer, kv_cache)
        if plan.per_head:
            self._per_head_forward(layer_idx, query, key, value, cache, attn_metadata, output, plan)
        else:
            self._stock_forward(layer, query, kv_cache, attn_metadata, output)
        for row in plan.compacting:
            self._compact(layer_idx, row, query, cache, attn_metadata, plan)
        return output

    def _stock_forward(self, layer, query, kv_cache, attn_metadata, output) -> None:
        # Same as CPUAttentionBackendImpl.forward minus its second KV write (do_kv_cache_update wrote).
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        n = attn_metadata.num_actual_tokens
        ops.cpu_attention_with_kv_cache(
            query=query[:n], key_cache=key_cache, value_cache=value_cache, output=output[:n],
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens, scale=self.scale,
            causal=attn_metadata.causal, alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window,
            block_table=attn_metadata.block_table, softcap=self.logits_soft_cap,
            scheduler_metadata=attn_metadata.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=attn_metadata.dynamic_causal, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)

    def _per_head_forward(self, layer_idx, query, key, value, cache, md, output, plan) -> None:
        H, g, D = self.num_kv_heads, self.num_queries_per_kv, self.head_size
        n = md.num_actual_tokens
        num_reqs = plan.num_reqs
        tables = per_head.virtual_tables(plan, layer_idx, md.block_table[:num_reqs], md.seq_lens[:num_reqs], H)
        slots = per_head.token_slots(tables, md.query_start_loc[: num_reqs + 1], md.seq_lens[:num_reqs],
                                     plan.page_size)
        if self.kv_sharing_target_layer_name is None:
            cache.write_pages(key[:n].reshape(n * H, D), value[:n].reshape(n * H, D), slots.reshape(-1))
        q = query[:n].view(n, H, g, D).permute(1, 0, 2, 3).contiguous().view(H * n, g, D)
        qsl = per_head.query_start_loc(md.query_start_loc[: num_reqs + 1], H, n)
        seq_lens = tables.seq_lens.reshape(-1).to(md.seq_lens.dtype)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=H * num_reqs, num_heads=g, num_kv_heads=1, head_dim=D, seq_lens=seq_lens,
            dtype=query.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=cache.key_pages, value_cache=cache.value_pages, output=out,
            query_start_loc=qsl, seq_lens=seq_lens, scale=self.scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=tables.pages.reshape(H * num_reqs, -1), softcap=self.logits_soft_cap,
            scheduler_metadata=metadata, s_aux=None, k_scale=cache.k_scale, v_scale=cache.v_scale,
            kv_cache_dtype=self.kv_cache_dtype)
        output[:n].view(n, H, g, D).copy_(out.view(H, n, g, D).permute(1, 0, 2, 3))

    def _compact(self, layer_idx, row, query, cache, md, plan) -> None:
        state = plan.states[row]
        blocks = md.block_table[row]
        prompt_blocks = blocks[: state.prompt_blocks]
        fresh = blocks[state.prompt_blocks: state.prompt_blocks + state.pages].tolist()
        keys, values = cache.gather_prefix(prompt_blocks, state.evict_at)
        q_window = state.q_window.get(layer_idx, query.new_empty(0, *query.shape[1:]))
        keep, page_counts = plan_compaction(state.spec.config, q_window, keys, values, self.scale, plan.page_size)
        layout, token_idx, head_idx, slots = compaction_slots(keep, page_counts, fresh, plan.page_size)
        cache.write_pages(keys[token_idx, head_idx], values[token_idx, head_idx], slots)
        state.layers[layer_idx] = layout


class EvictCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return EvictCPUAttentionImpl
