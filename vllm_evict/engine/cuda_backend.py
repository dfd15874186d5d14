"""FLASH_ATTN with eviction (vLLM 0.26 CUDA, FlashAttention 2/3 from vllm_flash_attn).

The cache is required in HND layout: logical and physical [num_blocks, H_kv, N, 2*D] with K and V
packed in the last dim. Viewed as [B*H, N, 1, 2*D] every (block, head) page is a block of a
one-KV-head cache (page id = block*H + head): the per-head view FlashAttention runs on with
`nheads_k = 1` and the g query heads of the group as its query heads.

An fp8 cache (`--kv-cache-dtype fp8`, e4m3 with vLLM's per-layer k/v scales; FlashAttention 3) is
stored as bytes. Writes quantize through vLLM's own `reshape_and_cache_flash`; compaction gathers and
scatters the bytes unchanged (the scales are per layer, so a copied byte keeps its value), and scoring
reads them dequantized (`dequantize`). Attention reads the cache as fp8 with the layer's descales, and
its queries arrive quantized by vLLM's attention layer: the window queries are those, dequantized.
"""

from __future__ import annotations

import torch
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from vllm.platforms import current_platform
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.kv_cache_interface import kv_cache_uses_per_token_head_scales
from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, reshape_and_cache_flash

from vllm_evict.engine.attention import EvictionAttentionMixin, EvictionMetadataBuilderMixin, decode_graph_tables
from vllm_evict.engine.hnd_cache import HndPagedCache
from vllm_evict.engine.layout import is_turboquant, per_head_attention
from vllm_evict.engine.per_head import DecodeGraphTables


class CudaPagedCache(HndPagedCache):
    graphable = True  # its compaction captures in CUDA graphs (compaction_graphs.py)

    def __init__(self, kv_cache: torch.Tensor, head_size: int, kv_cache_dtype: str, k_scale, v_scale,
                 q_scale=None, model_dtype: torch.dtype | None = None):
        B, H, N, two_d = kv_cache.shape
        self.kv_cache, self.num_heads, self.page_size, self.head_dim = kv_cache, H, N, head_size
        self.dtype, self.device = kv_cache.dtype, kv_cache.device
        paged = kv_cache.view(B * H, 1, N, two_d).transpose(1, 2)           # [B*H, N, 1, 2D]
        key_pages, value_pages = paged.split(head_size, dim=-1)
        self.key_pages = canonicalize_singleton_dim_strides(key_pages)
        self.value_pages = canonicalize_singleton_dim_strides(value_pages)
        self.kv_cache_dtype, self.k_scale, self.v_scale, self.q_scale = kv_cache_dtype, k_scale, v_scale, q_scale
        self.quantized = is_quantized_kv_cache(kv_cache_dtype)
        self.model_dtype = model_dtype or kv_cache.dtype    # what scoring reads (dequantized)
        fp8 = current_platform.fp8_dtype() if self.quantized else None
        self.attn_key_pages = self.key_pages.view(fp8) if fp8 else self.key_pages       # what attention reads
        self.attn_value_pages = self.value_pages.view(fp8) if fp8 else self.value_pages

    @property
    def gathered_bytes(self) -> int:
        """Bytes of one token's gathered K and V of one head: the cache's, plus their dequantized copy."""
        return 2 * self.head_dim * (self.dtype.itemsize + (self.model_dtype.itemsize if self.quantized else 0))

    @staticmethod
    def dequantize(caches: list["CudaPagedCache"], keys: torch.Tensor, values: torch.Tensor,
                   queries: torch.Tensor | None) -> tuple:
        """Scoring's view of gathered keys/values [n, R, G, H, D] and window queries [w, R, G, Hq, D] of G
        layers (the caches' dtype; queries may be None): unchanged for a model-dtype cache, else the fp8
        values times each layer's scale, in the model dtype."""
        first = caches[0]
        if not first.quantized:
            return keys, values, queries
        fp8, dtype = current_platform.fp8_dtype(), first.model_dtype

        def scaled(x, scales):
            scale = torch.stack([s.reshape(()) for s in scales]).view(len(caches), 1, 1)
            return (x.view(fp8).to(torch.float32) * scale).to(dtype)

        keys = scaled(keys, [c.k_scale for c in caches])
        values = scaled(values, [c.v_scale for c in caches])
        if queries is not None and queries.dtype == fp8:
            queries = scaled(queries, [c.q_scale for c in caches])
        return keys, values, queries

    def gather_prefix(self, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        nb, H, N, D = blocks.numel(), self.num_heads, self.page_size, self.head_dim
        pages = self.kv_cache[blocks.long()].permute(0, 2, 1, 3).reshape(nb * N, H, 2 * D)[:n]
        return pages[..., :D], pages[..., D:]

    def write_tokens(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write keys/values [T, H, D] of scheduled tokens to their per-head slots [T, H] (quantized as
        vLLM writes them)."""
        D = self.head_dim
        self.write_pages(keys.reshape(-1, D), values.reshape(-1, D), slots.reshape(-1))

    def write_pages(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write keys/values [M, D] to per-head slots [M] (page * N + offset; -1 = skip)."""
        reshape_and_cache_flash(keys.unsqueeze(1), values.unsqueeze(1), self.key_pages, self.value_pages,
                                slots.to(torch.int64), self.kv_cache_dtype, self.k_scale, self.v_scale)


class EvictFlashAttentionImpl(EvictionAttentionMixin, FlashAttentionImpl):
    backend_name = "FLASH_ATTN"

    def _paged_cache(self, layer, kv_cache) -> CudaPagedCache:
        return CudaPagedCache(kv_cache, self.head_size, self.kv_cache_dtype, layer._k_scale, layer._v_scale,
                              layer._q_scale, self.model_dtype)

    def _stock_attention(self, layer, query, key, value, kv_cache, md, output) -> None:
        FlashAttentionImpl.forward(self, layer, query, key, value, kv_cache, md, output)

    def _per_head_attention(self, q, cache, qsl, seq_lens, block_table, max_query_len, max_seq_len, out):
        result = flash_attn_varlen_func(
            q=q, k=cache.attn_key_pages, v=cache.attn_value_pages, out=out, cu_seqlens_q=qsl,
            max_seqlen_q=max_query_len, seqused_k=seq_lens, max_seqlen_k=max_seq_len, softmax_scale=self.scale,
            causal=True, alibi_slopes=None, window_size=None, block_table=block_table, softcap=self.logits_soft_cap,
            scheduler_metadata=None, fa_version=self.vllm_flash_attn_version, return_softmax_lse=self.sinks is not None,
            **descales(cache, q, seq_lens.shape[0]))
        if self.sinks is not None:  # virtual sequences head-major: row h*T + t
            apply_sinks(out, result[1], self.sinks, self.num_kv_heads, head_major=True)

    def _per_head_graph_forward(self, layer_idx, query, key, value, cache, md, output, split_kv) -> None:
        """Decode step (one token per row) as per-head virtual sequences, captured in and replayed from a
        FULL graph: tables from DecodeGraphTables' persistent buffers, nothing read from the host. FlashAttention
        splits KV dynamically (up to the builder's splits for graphs) in the graphs for split_kv steps only."""
        tables: DecodeGraphTables = md.per_head_decode
        H, g, D = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size
        n = md.seq_lens.shape[0]
        writes = self.kv_sharing_target_layer_name is None
        # query is a strided view of the fused QKV projection: the table kernel copies it into the staged
        # queries (FlashAttention's contiguous input; window capture, worker.py) and writes a model-dtype
        # cache's K/V in the same launch; an fp8 cache is written by vLLM's quantizing kernel
        fused = writes and not cache.quantized
        pages, lens, slots = tables.layer(layer_idx, md.block_table, md.seq_lens, query=query[:n].reshape(n, -1),
                                          kv=(key[:n], value[:n], cache.kv_cache) if fused else None)
        if writes and not fused:
            cache.write_pages(key[:n].reshape(n * H, D), value[:n].reshape(n * H, D), slots)
        q = tables.queries[layer_idx, :n]
        out = output[:n].view(n * H, g, D)  # written in place, each sequence at its row
        lse = ordered_decode_attention(q.view(n * H, g, D), cache, tables.order[layer_idx, : n * H + 1],
                                       tables.query_counts[: n * H], lens, pages, md.max_seq_len, out, self.scale,
                                       self.logits_soft_cap, num_splits=md.max_num_splits if split_kv else 1)
        if self.sinks is not None:  # query rows token-major: row t*H + h
            apply_sinks(out, lse, self.sinks, H, head_major=False)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, num_kv_heads: int,
                head_major: bool) -> None:
    """Attention sinks (GPT-OSS) on per-head attention computed without them: a sink s adds exp(s) to the
    softmax's denominator only, so each output row scales by exp(lse) / (exp(lse) + exp(s)) =
    sigmoid(lse - s). out [S, g, D] and lse [g, S] (float32) of S = H*T query rows, ordered head-major
    (row h*T + t) or token-major (row t*H + h); sinks [H*g], query head h*g + j at index h*g + j."""
    S, g, H = out.shape[0], out.shape[1], num_kv_heads
    per_head = sinks.to(torch.float32).view(H, g)
    per_row = (per_head.unsqueeze(1).expand(H, S // H, g) if head_major
               else per_head.unsqueeze(0).expand(S // H, H, g)).reshape(S, g)
    out.mul_(torch.sigmoid(lse.transpose(0, 1) - per_row).unsqueeze(-1).to(out.dtype))


def descales(cache: CudaPagedCache, q: torch.Tensor, num_sequences: int) -> dict:
    """FlashAttention's descales for an fp8 cache: the layer's scales, one per virtual sequence (a single KV
    head each); the query's only where it arrives quantized."""
    if not cache.quantized:
        return {}
    shape = (num_sequences, 1)
    return dict(q_descale=cache.q_scale.expand(shape) if q.dtype == current_platform.fp8_dtype() else None,
                k_descale=cache.k_scale.expand(shape), v_descale=cache.v_scale.expand(shape))


def ordered_decode_attention(q: torch.Tensor, cache: CudaPagedCache, query_rows: torch.Tensor,
                             query_counts: torch.Tensor, lens: torch.Tensor, pages: torch.Tensor, max_seq_len: int,
                             out: torch.Tensor, scale: float, softcap: float, num_splits: int) -> None:
    """FlashAttention 3 over S one-query virtual sequences in any order. Sequence i: the query row
    query_rows[i] of q [Q, g, D] (its output goes to that row of out [Q, g, D]), lens[i] tokens on
    pages[i] (page ids of the per-head cache view).

    query_rows [S + 1] int32 (the last entry only pads the shape) is FA's cu_seqlens_q and query_counts [S]
    int32, all ones, its seqused_q: with seqused_q FA3 reads each sequence's offset alone, so the offsets
    need not grow. vllm_flash_attn's wrapper passes no seqused_q, so this calls the FA3 op itself (its
    schema's argument names). Returns the softmax LSE [g, Q] (float32)."""
    scales = descales(cache, q, lens.shape[0])
    return torch.ops._vllm_fa3_C.fwd(
        q=q, k=cache.attn_key_pages, v=cache.attn_value_pages, k_new=None, v_new=None, q_v=None, out=out,
        cu_seqlens_q=query_rows, cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=query_counts,
        seqused_k=lens, max_seqlen_q=1, max_seqlen_k=max_seq_len, page_table=pages, kv_batch_idx=None,
        leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None,
        q_descale=scales.get("q_descale"), k_descale=scales.get("k_descale"), v_descale=scales.get("v_descale"),
        softmax_scale=scale, is_causal=True, window_size_left=-1, window_size_right=-1, softcap=softcap,
        is_rotary_interleaved=True, scheduler_metadata=None, num_splits=num_splits, pack_gqa=None, sm_margin=0,
        s_aux=None, cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None)[1]


def query_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The queries' dtype in the attention call: vLLM's attention layer quantizes them to fp8 for an fp8
    cache (not a per-token-head or TurboQuant one: FlashAttention then runs only the model-dtype boundary
    layers) when FlashAttention takes quantized queries (FA3)."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_supports_quant_query_input

    if is_quantized_kv_cache(cache_dtype) and not kv_cache_uses_per_token_head_scales(cache_dtype) \
            and not is_turboquant(cache_dtype) and flash_attn_supports_quant_query_input():
        return current_platform.fp8_dtype()
    return model_dtype


class EvictFlashAttentionMetadataBuilder(EvictionMetadataBuilderMixin, FlashAttentionMetadataBuilder):
    # FlashAttention's own CUDA-graph support: a FULL graph replays the stock attention, which is right
    # for every step whose plan needs no attention call (runner_hooks.py's dispatcher hook keeps the others
    # off FULL graphs).

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.per_head_decode = decode_graph_tables(
            kv_cache_spec, layer_names, vllm_config, device, self.use_full_cuda_graph,
            query_dtype(vllm_config.cache_config.cache_dtype, vllm_config.model_config.dtype),
            per_head_path=per_head_attention(vllm_config))  # none where the engine's backend has none
                                                            # (a TurboQuant model's boundary layers)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.per_head_decode is not None and md.eviction is not None:  # the step may replay a per-head graph
            self.per_head_decode.load(md.eviction, md.seq_lens)
        return md

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
