"""Platform-independent part of the eviction attention backends.

The step's plan (step.StepPlan, None for a stock step) reaches the attention layers on their metadata
(`attn_metadata.eviction`), put there by the backend's metadata builder from `step.BUILD`, which holds
the plan while vLLM builds the step's metadata: the worker builds the plan while vLLM prepares the
step's inputs, before that. Stock behaviour unless the plan says otherwise:
- window capture: copy the query rows of the last w positions before each point of evicting requests;
- per-head path (batch holds Ada-KV-compacted requests): every request row becomes H_kv virtual
  sequences with their own page tables (see per_head.py) - KV write and attention both go through it.
  Uniform decode steps run it inside FULL CUDA graphs of their own (step.PerHeadDecodeBatch), with
  tables computed on device from persistent buffers; other steps build the tables eagerly. Decode steps
  that capture window queries or compact need every layer's queries after the forward: their graphs stage
  them in a persistent buffer, which the worker copies from (the per-head graphs when the step holds
  per-head rows, else vLLM's attention in graphs of their own, step.StagedDecodeBatch);
  uniformly compacted requests need nothing here (the worker shifted their lengths and slots);
- compaction: worker.py compacts all layers at once after the model forward of a step in which requests
  reach their eviction point (compaction.py), reading the layers' caches itself, so the attention call
  has nothing to do for it.
Subclasses provide the cache adapter and the two kernel calls.
"""

from __future__ import annotations

import inspect

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.quantization.turboquant.config import TQ_PRESETS
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.torch_utils import is_quantized_kv_cache

from vllm_evict.engine import per_head
from vllm_evict.engine.step import BUILD, PerHeadDecodeBatch, StagedDecodeBatch, graph_step


# The quantized caches eviction handles, by CUDA attention backend (vLLM picks the backend from the dtype):
# FlashAttention's fp8 (e4m3, per-layer k/v scales), the Triton backend's per-token-head caches (a scale per
# token and head beside its data), TurboQuant's (key and value codes in one slot per token and head). Other
# platforms evict model-dtype caches only.
QUANTIZED_CACHE_DTYPES = {"FLASH_ATTN": ("fp8", "fp8_e4m3"),
                          "TRITON_ATTN": ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"),
                          "TURBOQUANT": tuple(TQ_PRESETS)}
MODEL_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")


def check_cache_dtype(cache_dtype: str, backend: str) -> None:
    """Refuse, at engine start, a KV cache dtype that eviction cannot handle on this attention backend
    (compaction moves a quantized cache's bytes, scoring reads them dequantized: cuda_backend.py,
    triton_backend.py). The message names every dtype that evicts on this platform."""
    cache_dtype = str(cache_dtype)
    if cache_dtype in MODEL_CACHE_DTYPES + QUANTIZED_CACHE_DTYPES.get(backend, ()):
        return
    if backend in QUANTIZED_CACHE_DTYPES:  # CUDA
        choices = "auto, " + ", ".join(f"{' or '.join(dtypes)} ({name})"
                                       for name, dtypes in QUANTIZED_CACHE_DTYPES.items())
    else:
        choices = "auto"
    raise ValueError(f"vllm-evict does not support the KV cache dtype {cache_dtype!r} "
                     f"(--kv-cache-dtype {cache_dtype}) on the {backend} attention backend: start with "
                     f"--kv-cache-dtype {choices}, or disable the plugin (VLLM_PLUGINS=none) to serve it "
                     "without eviction")


def layer_graph(kind, attn_metadata):
    """The FULL decode graph of this kind (step.PerHeadDecodeBatch or step.StagedDecodeBatch) this layer's
    attention runs in: None outside one, and for the layers eviction leaves alone (a hybrid model's
    sliding-window layers: their builder holds no graph tables)."""
    graph = graph_step(kind)
    return graph if graph is not None and getattr(attn_metadata, "per_head_decode", None) is not None else None


def per_head_graph(attn_metadata):  # -> step.PerHeadDecodeBatch | None
    return layer_graph(PerHeadDecodeBatch, attn_metadata)


def step_plan(attn_metadata):  # -> step.StepPlan | None
    """The eviction plan of the step whose attention metadata this is (None: a stock step)."""
    return getattr(attn_metadata, "eviction", None)


def decode_graph_tables(kv_cache_spec, layer_names, vllm_config, device, full_graphs: bool,
                        query_dtype: torch.dtype, per_head_path: bool):  # -> per_head.DecodeGraphTables | None
    """The persistent tables of the eviction's FULL decode graphs (runner_hooks.py), for the evicted KV
    cache group's builder when vLLM captures FULL graphs of one token per row (no speculative decoding);
    None for the other groups of a hybrid model (they replay stock attention). A backend without per-head
    attention replays only staged graphs, which use the tables' queries: one page per sequence then. The
    builders of the evicted group share one query buffer (step.BUILD.staged_queries)."""
    evicted = BUILD.evicted_layers.intersection(layer_names)
    if not (full_graphs and vllm_config.num_speculative_tokens == 0 and evicted):
        return None
    page, model = kv_cache_spec.block_size, vllm_config.model_config
    # every builder of the evicted group stages its layers' queries in one buffer, which the worker reads (a
    # TurboQuant model's boundary layers have a FlashAttention builder beside TurboQuant's)
    tables = per_head.DecodeGraphTables(
        num_layers=max(extract_layer_index(name) for name in BUILD.evicted_layers) + 1,
        max_rows=min(vllm_config.scheduler_config.max_num_seqs,
                     vllm_config.compilation_config.max_cudagraph_capture_size),
        num_heads=kv_cache_spec.num_kv_heads, max_pages=-(-model.max_model_len // page) + 1 if per_head_path else 1,
        page_size=page, device=device, num_q_heads=model.get_num_attention_heads(vllm_config.parallel_config),
        head_dim=kv_cache_spec.head_size, dtype=query_dtype, queries=BUILD.staged_queries,
        # the per-head graphs' table kernel writes a model-dtype cache (cuda_backend._per_head_graph_forward)
        writes_kv=per_head_path and not is_quantized_kv_cache(vllm_config.cache_config.cache_dtype))
    BUILD.staged_queries = tables.queries
    return tables


class EvictionMetadataBuilderMixin:
    """Mixed into a stock AttentionMetadataBuilder: the metadata it builds for the evicted KV cache group
    carries the step's plan; the other groups of a hybrid model (sliding window) get none and run stock.
    A CUDA builder's FULL decode graph tables (`decode_graph_tables`) ride on every metadata it builds.

    A hybrid model's evicted group reads its own copy of seq_lens, lowered by the compacted rows' shifts
    (the runner's copy stays semantic for the other groups). It is a persistent buffer written in place
    every step, the captured one included, so FULL CUDA graphs replay with it."""

    per_head_decode = None  # decode_graph_tables (CUDA builders)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        evicts = getattr(self, "_vllm_evict_evicts", None)
        if evicts is None:
            evicts = self._vllm_evict_evicts = bool(BUILD.evicted_layers.intersection(self.layer_names))
        plan = BUILD.plan if evicts else None
        if evicts and BUILD.hybrid:
            common_attn_metadata = self._physical_lengths(common_attn_metadata, plan)
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md.eviction, md.per_head_decode = plan, self.per_head_decode
        return md

    def _physical_lengths(self, cm, plan):
        """cm with seq_lens in this builder's buffer, less each compacted row's shift."""
        import dataclasses

        n = cm.seq_lens.shape[0]
        buffer = getattr(self, "_vllm_evict_seq_lens", None)
        if buffer is None or buffer.shape[0] < n:
            config = self.vllm_config
            size = max(n, config.scheduler_config.max_num_seqs,
                       config.compilation_config.max_cudagraph_capture_size or 0)
            buffer = self._vllm_evict_seq_lens = cm.seq_lens.new_zeros(size)
        buffer[:n].copy_(cm.seq_lens)
        if plan is not None and plan.shift is not None:
            buffer[: plan.num_reqs] -= plan.shift.to(buffer.dtype)
        return dataclasses.replace(cm, seq_lens=buffer[:n])


class EvictionAttentionMixin:
    """Mixed into a stock AttentionImpl (CPU_ATTN, FLASH_ATTN or TRITON_ATTN)."""

    backend_name = ""  # the stock backend's name (check_cache_dtype)

    def __init__(self, *args, **kwargs) -> None:
        # before the stock impl's own checks: the user reads why eviction refuses the setting
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        check_cache_dtype(bound.arguments["kv_cache_dtype"], self.backend_name)
        self.model_dtype = get_current_vllm_config().model_config.dtype  # what compaction scores a quantized cache's K/V in
        super().__init__(*args, **kwargs)

    def _paged_cache(self, layer, kv_cache):  # -> object with gather_prefix / write_pages / key_pages
        raise NotImplementedError

    def _stock_attention(self, layer, query, key, value, kv_cache, attn_metadata, output):
        raise NotImplementedError

    def _per_head_attention(self, q, cache, qsl, seq_lens, block_table, max_query_len, max_seq_len, out):
        raise NotImplementedError

    def _per_head_graph_forward(self, layer_idx, query, key, value, cache, attn_metadata, output, split_kv) -> None:
        raise NotImplementedError  # only backends with FULL decode graphs

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        md = get_attention_context(layer.layer_name)[0]
        plan = step_plan(md)
        per_head = per_head_graph(md) or (plan is not None and plan.per_head)
        if not per_head or self.kv_sharing_target_layer_name is not None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # Per-head slots need this layer's tables, built in forward(); the write happens there.

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        plan = step_plan(attn_metadata)
        graph = per_head_graph(attn_metadata)
        if attn_metadata is not None and graph:  # captured once, replayed: no plan read
            self._per_head_graph_forward(extract_layer_index(layer.layer_name), query, key, value,
                                         self._cached_paged_cache(layer, kv_cache), attn_metadata, output,
                                         graph.split_kv)
            return output
        if attn_metadata is not None and layer_graph(StagedDecodeBatch, attn_metadata):  # captured once, replayed: no plan read
            n = attn_metadata.seq_lens.shape[0]
            staged = attn_metadata.per_head_decode.queries[extract_layer_index(layer.layer_name), :n]
            staged.view(n, -1).copy_(query[:n].reshape(n, -1))
        if attn_metadata is None or plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        layer_idx = extract_layer_index(layer.layer_name)
        if plan.capture_tokens is not None:
            plan.windows.capture(layer_idx, query, plan.capture_tokens, plan.capture_rows)
        cache = self._cached_paged_cache(layer, kv_cache)
        if plan.per_head:
            with torch.profiler.record_function("vllm_evict::per_head_attention"):
                self._per_head_forward(layer_idx, query, key, value, cache, attn_metadata, output, plan)
        else:
            self._stock_attention(layer, query, key, value, kv_cache, attn_metadata, output)
        return output

    def _cached_paged_cache(self, layer, kv_cache):
        # The cache tensor of a layer is the same object every step: build its views once.
        held = getattr(self, "_vllm_evict_paged", None)
        if held is None or held[0] is not kv_cache:
            held = self._vllm_evict_paged = (kv_cache, self._paged_cache(layer, kv_cache))
        return held[1]

    def _per_head_forward(self, layer_idx, query, key, value, cache, md, output, plan) -> None:
        H, g, D = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size
        n = md.num_actual_tokens
        num_reqs = plan.num_reqs
        qsl = md.query_start_loc[: num_reqs + 1]
        seq_lens = md.seq_lens[:num_reqs]
        tables = per_head.virtual_tables(plan, layer_idx, md.block_table[:num_reqs], seq_lens, qsl, n, H)
        if self.kv_sharing_target_layer_name is None:
            cache.write_tokens(key[:n].view(n, H, D), value[:n].view(n, H, D), tables.slots)
        q = query[:n].view(n, H, g, D).transpose(0, 1).reshape(H * n, g, D)
        vqsl = plan.tables.query_start_loc
        out = torch.empty(q.shape, dtype=output.dtype, device=q.device)  # q may be fp8 (an fp8 cache)
        self._per_head_attention(q, cache, vqsl, tables.seq_lens.reshape(-1),
                                 tables.pages.reshape(H * num_reqs, -1), md.max_query_len, md.max_seq_len, out)
        output[:n].view(n, H, g, D).copy_(out.view(H, n, g, D).transpose(0, 1))
