"""What compaction does with a CUDA layer cache in vLLM's HND layout, whichever attention backend reads it:
[num_blocks, H_kv, N, 2*W], a token's K and V halves of W elements each packed in the last dim. Compaction
gathers and writes the halves as they are stored (kernels/paged_kv.py, one launch for a group of layers);
each backend's adapter says what a half holds (`stored_dim` elements, `dequantize` for scoring)."""

from __future__ import annotations

import torch

from vllm_evict.kernels.paged_kv import gather_prompt, gather_slots, scatter_kept


class HndPagedCache:
    kv_cache: torch.Tensor    # [num_blocks, H, N, 2 * stored_dim], what compaction moves
    num_heads: int
    page_size: int
    head_dim: int             # the model's head size (what scoring reads)

    @property
    def stored_dim(self) -> int:
        """Elements of one token's stored key (or value) half of one head."""
        return self.kv_cache.shape[-1] // 2

    @staticmethod
    def gather_layers(caches: list["HndPagedCache"], blocks: torch.Tensor, n: int, keys: torch.Tensor,
                      values: torch.Tensor) -> None:
        """keys/values [n, R, G, H, W] (unit stride on W; R and G foldable into one axis) <- the first n prompt
        tokens of R requests (blocks [R, nb]) in G layers: one launch."""
        rows = (n, keys.shape[1] * len(caches), *keys.shape[3:])
        gather_prompt([c.kv_cache for c in caches], blocks, n, keys.view(rows), values.view(rows))

    @staticmethod
    def gather_held(caches: list["HndPagedCache"], slots: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> None:
        """keys/values [n, G, H, W] <- the tokens at per-head slots [G, n, H] (zero where -1) of G layers
        (a layer may repeat): one launch."""
        gather_slots([c.kv_cache for c in caches], slots, keys, values)

    @staticmethod
    def write_layers(caches: list["HndPagedCache"], keys: torch.Tensor, values: torch.Tensor,
                     slots: torch.Tensor) -> None:
        """Write keys/values [n, G, H, W] to per-head slots [G, n, H] (-1 = skip) of G layers: one launch."""
        scatter_kept([c.kv_cache for c in caches], keys, values, slots)


def paged_cache(kv_cache: torch.Tensor, head_size: int, kv_cache_dtype: str, model_dtype: torch.dtype, k_scale,
                v_scale, q_scale) -> HndPagedCache:
    """The compaction adapter of a CUDA layer cache, by its dtype: TurboQuant's, a per-token-head cache's, or
    FLASH_ATTN's (a model-dtype or per-layer fp8 cache: k/v/q_scale are the layer's scales)."""
    from vllm.v1.kv_cache_interface import kv_cache_uses_per_token_head_scales

    from vllm_evict.engine.layout import is_turboquant

    if is_turboquant(kv_cache_dtype):
        from vllm_evict.engine.turboquant_backend import TurboQuantPagedCache

        return TurboQuantPagedCache(kv_cache, head_size, kv_cache_dtype, model_dtype)
    if kv_cache_uses_per_token_head_scales(kv_cache_dtype):
        from vllm_evict.engine.triton_backend import PerTokenHeadPagedCache

        return PerTokenHeadPagedCache(kv_cache, head_size, kv_cache_dtype, model_dtype)
    from vllm_evict.engine.cuda_backend import CudaPagedCache

    return CudaPagedCache(kv_cache, head_size, kv_cache_dtype, k_scale, v_scale, q_scale, model_dtype)
