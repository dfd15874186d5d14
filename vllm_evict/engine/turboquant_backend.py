"""TURBOQUANT with eviction (vLLM 0.26 CUDA): vLLM's backend for its TurboQuant caches (`--kv-cache-dtype
turboquant_k8v4`, `turboquant_4bit_nc`, `turboquant_k3v4_nc`, `turboquant_3bit_nc`).

The cache is [num_blocks, H_kv, N, S] bytes, head-major as eviction's other CUDA caches. One S-byte slot holds
a (token, head)'s key and value together (the format: kernels/turboquant_slots.py).

Compaction moves a slot as it is, as the two S/2-byte halves the HND adapter gathers and writes (the
kernels of kernels/paged_kv.py, bytes unchanged). Scoring reads the gathered slots decoded as vLLM's own
attention decodes them (`dequantize_slots`, one kernel launch), in the model dtype; queries reach this
attention unquantized, so the window queries are the layer's own.

vLLM keeps the first and last two layers of a dense model in the model dtype (its boundary layers, run by
FlashAttention) in the same KV cache group and block table as the TurboQuant layers: compaction keeps the
two layouts in separate layer groups (compaction.layer_groups). Attention is vLLM's own, except for decode
rows on 4-bit presets (`turboquant_4bit_nc`; decode_attention): kernels/turboquant_decode.py decodes each slot
once per KV head where vLLM's decode does so once per query head, and vLLM's own kernel reduces its splits.
Ada-KV's per-head path is not built on this backend: check_on_engine refuses Ada-KV here, as on TRITON_ATTN.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
from vllm.v1.attention.backends.turboquant_attn import (
    TurboQuantAttentionBackend,
    TurboQuantAttentionImpl,
    TurboQuantMetadataBuilder,
    _build_hadamard,
)
from vllm.v1.attention.ops.triton_decode_attention import _fwd_kernel_stage2
from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

from vllm_evict.engine.attention import EvictionAttentionMixin, EvictionMetadataBuilderMixin, decode_graph_tables
from vllm_evict.engine.hnd_cache import HndPagedCache
from vllm_evict.engine.layout import is_turboquant
from vllm_evict.engine.step import BUILD
from vllm_evict.kernels import turboquant_decode
from vllm_evict.kernels.turboquant_slots import dequantize_slots


class TurboQuantPagedCache(HndPagedCache):
    """A TurboQuant cache [num_blocks, H, N, S] as bytes: compaction gathers and writes a token's slot as two
    S/2-byte halves without reading them; `dequantize` decodes gathered slots for scoring."""

    def __init__(self, kv_cache: torch.Tensor, head_size: int, kv_cache_dtype: str, model_dtype: torch.dtype):
        self.config = TurboQuantConfig.from_cache_dtype(kv_cache_dtype, head_size)
        slots = kv_cache.view(torch.uint8)
        _, H, N, S = slots.shape
        if S != self.config.slot_size_aligned:
            raise ValueError(f"{kv_cache_dtype} cache of head size {head_size}: slot of {S} bytes, expected "
                             f"{self.config.slot_size_aligned}")
        self.kv_cache, self.num_heads, self.page_size, self.head_dim = slots, H, N, head_size
        self.dtype, self.device, self.model_dtype = slots.dtype, slots.device, model_dtype
        self.centroids = get_centroids(head_size, self.config.centroid_bits).to(self.device, torch.float32)
        self.rotation = _build_hadamard(head_size, str(self.device))   # orthonormal and symmetric
        self.fp8_e4b15 = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of one token and head in compaction: its slot, and what decoding it holds at once (the key
        before its rotation and rotated, float32 each, beside the key and value in the model dtype)."""
        return 2 * self.stored_dim + self.head_dim * (8 + 2 * self.model_dtype.itemsize)

    @staticmethod
    def dequantize(caches: list["TurboQuantPagedCache"], keys: torch.Tensor, values: torch.Tensor,
                   queries: torch.Tensor | None) -> tuple:
        """Scoring's view of gathered slot halves [..., S/2] (bytes; `keys` the first half of each slot,
        `values` the second): keys and values [..., D] in the model dtype. Queries are unchanged."""
        first = caches[0]
        key, value = dequantize_slots(keys, values, first.config, first.centroids, first.rotation, first.fp8_e4b15,
                                      first.model_dtype)
        return key, value, queries


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     config, centroids: torch.Tensor, rotation_t: torch.Tensor, scale: float,
                     partials: torch.Tensor, output: torch.Tensor, lse: torch.Tensor, **launch) -> torch.Tensor:
    """output [B, Hq, D] (its dtype: the query's) of decode rows query [B, Hq, D]: the split partials of
    kernels/turboquant_decode.decode_partials (same arguments; `launch`: its block_n and num_warps, which
    benchmarks/turboquant_decode.py compares), reduced by vLLM's stage-2 kernel into output and lse [B, Hq]
    (the log-sum-exp), as vLLM's TurboQuant decode reduces its own."""
    B, Hq, D = query.shape
    turboquant_decode.decode_partials(query, kv_cache, block_table, seq_lens, config, centroids, rotation_t, scale,
                                      partials, **launch)
    _fwd_kernel_stage2[(B, Hq)](
        partials, output, lse, seq_lens, partials.stride(0), partials.stride(1), partials.stride(2),
        output.stride(0), output.stride(1), lse.stride(0), NUM_KV_SPLITS=partials.shape[2],
        BLOCK_DV=triton.next_power_of_2(D), Lv=D, OUTPUT_FP16=int(output.dtype == torch.float16), num_warps=4,
        num_stages=2)
    return output


def store(kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor,
          cache_dtype: str) -> None:
    """Write keys/values [n, H, D] at slot_mapping [n] of a TurboQuant cache [num_blocks, H, N, S] with vLLM's
    own store kernel, as its attention layer does (the warm-up's scratch caches, the tests)."""
    from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

    config = TurboQuantConfig.from_cache_dtype(cache_dtype, keys.shape[-1])
    rotation = _build_hadamard(keys.shape[-1], str(keys.device))
    levels, _ = get_centroids(keys.shape[-1], config.centroid_bits).to(keys.device, torch.float32).sort()
    triton_turboquant_store(keys, values, kv_cache.transpose(1, 2), slot_mapping, rotation,
                            (levels[:-1] + levels[1:]) / 2, mse_bits=config.key_mse_bits,
                            key_packed_size=config.key_packed_size, value_quant_bits=config.value_quant_bits,
                            key_fp8=config.key_fp8)


class EvictTurboQuantAttentionImpl(EvictionAttentionMixin, TurboQuantAttentionImpl):
    backend_name = "TURBOQUANT"
    kv_sharing_target_layer_name = None  # vLLM's TurboQuant impl keeps no KV sharing

    def _paged_cache(self, layer, kv_cache) -> HndPagedCache:
        return TurboQuantPagedCache(kv_cache, self.head_size, self.kv_cache_dtype, self.model_dtype)

    def _stock_attention(self, layer, query, key, value, kv_cache, md, output) -> None:
        TurboQuantAttentionImpl.forward(self, layer, query, key, value, kv_cache, md, output)

    def _decode_attention(self, query, kv_cache, attn_metadata, Pi, centroids, PiT=None, layer=None):
        """Decode rows on a 4-bit preset through decode_attention (vLLM's own decode on the others). The
        scratch buffers are those vLLM's decode takes from its workspace (the same shapes, so CUDA graphs
        capture them alike)."""
        if not turboquant_decode.supports(self.tq_config):
            return TurboQuantAttentionImpl._decode_attention(self, query, kv_cache, attn_metadata, Pi, centroids,
                                                             PiT, layer)
        B, Hq, D, splits = query.shape[0], self.num_heads, self.head_size, self.max_num_kv_splits
        shapes = (((B, Hq, splits, D + 1), torch.float32), ((B, Hq, D), query.dtype), ((B, Hq), torch.float32))
        if is_workspace_manager_initialized():
            partials, output, lse = current_workspace_manager().get_simultaneous(*shapes)
        else:
            partials, output, lse = (torch.empty(shape, dtype=dtype, device=query.device) for shape, dtype in shapes)
        return decode_attention(query, kv_cache, attn_metadata.block_table, attn_metadata.seq_lens, self.tq_config,
                                centroids, Pi.T if PiT is None else PiT, self.scale, partials, output, lse)


class EvictTurboQuantMetadataBuilder(EvictionMetadataBuilderMixin, TurboQuantMetadataBuilder):
    """The decode steps that record window queries or compact replay vLLM's attention in FULL graphs that
    also stage every layer's queries (step.StagedDecodeBatch). vLLM's TurboQuant prefill reads each row's
    cached length off the host copy of seq_lens: a compacted row's is lowered by its shift here (the device
    copy the worker already lowered).

    vLLM 0.26's TurboQuant prefill runs one FlashAttention call over the new tokens alone whenever the
    batch's longest query equals its longest sequence, taken to mean that no row has cached KV. A batch that
    holds a fresh prompt and a row with cached KV (a prefix-cache hit, a later chunk, a block-wise compacted
    prompt), the fresh one the longest, breaks that: the other row loses its cache. Here max_query_len (an
    upper bound) is raised by one when a prefill row has cached KV, so that such rows take vLLM's per-row
    path, which reads their cache (`reads_cached_kv`)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        full = vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs()
        self.per_head_decode = decode_graph_tables(kv_cache_spec, layer_names, vllm_config, device, full,
                                                   vllm_config.model_config.dtype, per_head_path=False)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        plan, cm = BUILD.plan, common_attn_metadata
        if plan is not None and plan.row_shift is not None and plan.row_shift.any() \
                and cm.seq_lens_cpu_upper_bound is not None:
            upper = cm.seq_lens_cpu_upper_bound.clone()
            upper[: plan.num_reqs] -= torch.from_numpy(plan.row_shift).to(upper.dtype)
            cm = dataclasses.replace(cm, seq_lens_cpu_upper_bound=upper)
        md = super().build(common_prefix_len, cm, fast_build)
        if cm.seq_lens_cpu_upper_bound is not None and reads_cached_kv(cm.query_start_loc_cpu,
                                                                       cm.seq_lens_cpu_upper_bound):
            md.max_query_len = cm.max_query_len + 1
        return md


def reads_cached_kv(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """Whether a prefill row (more than one query) of the batch attends to KV cached before this step
    (query_start_loc [B + 1] and seq_lens [B], on the host; seq_lens exact for prefill rows)."""
    queries = query_start_loc[1:] - query_start_loc[:-1]
    return bool(((queries > 1) & (seq_lens[: queries.shape[0]] > queries)).any())


class EvictTurboQuantAttentionBackend(TurboQuantAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return EvictTurboQuantAttentionImpl

    @staticmethod
    def get_builder_cls():
        return EvictTurboQuantMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        # vLLM's V1 runner (the one eviction hooks) asks for the "auto" shape of a TurboQuant layer: its spec
        # carries no quantization mode. This backend serves the engine's TurboQuant dtype alone.
        if not is_turboquant(cache_dtype_str):
            cache_dtype_str = get_current_vllm_config().cache_config.cache_dtype
        return TurboQuantAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                                                             cache_dtype_str)
