"""Which part of a model's KV cache eviction compacts, and why a model cannot evict.

vLLM groups a model's attention layers by the kind of cache they keep (its KV cache groups: one block
table each, one shared block pool). Eviction compacts the **full-attention group**: the layers whose KV
grows with the context. Every other group keeps vLLM's own handling: a sliding-window group already holds
at most its window (vLLM drops its blocks as they leave it), a linear-attention (Mamba, Gated DeltaNet)
group a fixed state. So a hybrid model (GPT-OSS, Gemma 3, Qwen3-Next) evicts its full-attention layers
and leaves the others as they are; a dense GQA model is the case of one group.

A model whose layout eviction cannot handle is refused by name: at engine start (a warning, or an error
when the server sets a default eviction), and per request (an `eviction` object gets a 400 naming the
layout; `policy: none` still passes). `model_refusal` reads what the API process knows (the model's
config); `evicted_group` reads the KV cache groups the engine core built, which may refuse more.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvictedGroup:
    """The KV cache group eviction compacts, and the model's group count (several: a hybrid model)."""

    index: int
    num_groups: int
    hits_cut_at_pages: bool = True  # a prefix-cache hit can be cut at any page (no linear-attention state)
    window_blocks: int = 0          # the most blocks a sliding-window group's hit must hold before its end

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1


def model_refusal(model_config, scheduler_config=None, speculative_config=None) -> str | None:
    """Why this model's KV layout cannot evict, from its config alone (None: it can, as far as the config
    tells; the KV cache groups are checked again at engine start, `evicted_group`)."""
    if model_config is None:
        return None
    reason = drafter_refusal(speculative_config)
    if reason is not None:
        return reason
    name = ", ".join(getattr(model_config.hf_config, "architectures", None) or []) or model_config.model
    if getattr(model_config, "is_attention_free", False):
        return f"{name} has no attention layers (no KV cache to evict)"
    if getattr(model_config, "use_mla", False):
        return (f"{name} uses multi-head latent attention (MLA): one latent vector per token serves every "
                "head, and per-KV-head eviction of it is not supported in this version")
    text = model_config.hf_text_config
    if getattr(text, "num_kv_shared_layers", 0):
        return (f"{name} has layers that read another layer's KV cache (num_kv_shared_layers="
                f"{text.num_kv_shared_layers}); eviction of shared caches is not supported in this version")
    if scheduler_config is not None and getattr(scheduler_config, "disable_hybrid_kv_cache_manager", False) \
            and _has_window_layers(text):
        return (f"{name} has sliding-window layers and the hybrid KV cache manager is disabled, so they share "
                "the full-attention layers' blocks; start without --disable-hybrid-kv-cache-manager to evict")
    return None


def check_on_engine(spec, vllm_config) -> None:
    """Raise ValueError when an evicting request (request_config.RequestEviction) cannot run on this engine:
    a model that cannot evict, or a rule that needs the engine's page size, its drafter or its scheduling. Run
    where requests arrive (the input processor; the OpenAI handlers, before a stream starts), so the client gets
    a 400."""
    reason = model_refusal(vllm_config.model_config, vllm_config.scheduler_config, vllm_config.speculative_config)
    if reason is not None:
        raise ValueError(f"this model cannot evict: {reason} (send \"policy\": \"none\" or no eviction)")
    spec.check_page_size(vllm_config.cache_config.block_size)
    if spec.config.allocation != "uniform" and not per_head_attention(vllm_config):
        raise ValueError(f"allocation {spec.config.allocation!r} is not supported on this engine's attention "
                         f"backend ({stock_layout_backend(vllm_config)}, KV cache dtype "
                         f"{vllm_config.cache_config.cache_dtype}): it evicts in the stock layout only; use "
                         "\"allocation\": \"uniform\"")
    if spec.decode_budget is not None and vllm_config.speculative_config is not None \
            and vllm_config.scheduler_config.async_scheduling:
        # the scheduler plans a step before the last one's drafts are verified: a decode point would land where
        # all of them are assumed accepted (DESIGN.md §4.8 g)
        raise ValueError("decode_budget is not supported with speculative decoding under asynchronous scheduling "
                         "(the engine schedules each step before it knows how many of the last step's draft tokens "
                         "were accepted, and a decode point must land on verified tokens); start the engine with "
                         "--no-async-scheduling to evict while decoding, or send no decode_budget")
    if drafts_with_kv_cache(vllm_config.speculative_config) and spec.config.allocation != "uniform":
        raise ValueError(f"allocation {spec.config.allocation!r} is not supported with a draft model that keeps "
                         f"its own KV cache (speculative method {vllm_config.speculative_config.method!r}): its "
                         "layers keep the target's kept tokens in the stock layout; use \"allocation\": \"uniform\"")


def per_head_attention(vllm_config) -> bool:
    """Whether the engine's attention runs Ada-KV's per-head layout: not on the Triton backend (per-token-head
    caches, or picked with --attention-backend TRITON_ATTN) nor on TurboQuant's, which evict in the stock
    layout only."""
    return stock_layout_backend(vllm_config) is None


def is_turboquant(cache_dtype: str) -> bool:
    """A TurboQuant KV cache dtype (vLLM's TURBOQUANT backend: one key/value slot per token and head)."""
    from vllm.model_executor.layers.quantization.turboquant.config import TQ_PRESETS

    return str(cache_dtype) in TQ_PRESETS


def stock_layout_backend(vllm_config) -> str | None:
    """The attention backend of this engine that evicts in the stock layout only, or None."""
    from vllm.v1.kv_cache_interface import kv_cache_uses_per_token_head_scales

    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    backend = vllm_config.attention_config.backend
    if is_turboquant(cache_dtype):
        return "TURBOQUANT"
    if kv_cache_uses_per_token_head_scales(cache_dtype) or (backend is not None and backend.name == "TRITON_ATTN"):
        return "TRITON_ATTN"
    return None


def drafts_with_kv_cache(speculative_config) -> bool:
    """Speculation by a draft model whose attention layers write KV of their own into the target's KV cache
    groups (EAGLE, EAGLE3, MTP, a separate draft model); n-gram speculation has none."""
    return speculative_config is not None and (speculative_config.use_eagle() or speculative_config.uses_draft_model())


def drafter_refusal(speculative_config) -> str | None:
    """Why eviction cannot run beside this drafter (None: it can, or there is none with a KV cache). Its layers
    keep the last target layer's tokens, and its later draft steps address them at shifted positions
    (runner_hooks.eagle_step): the padded drafter batch of one KV cache group only."""
    if not drafts_with_kv_cache(speculative_config):
        return None
    method = speculative_config.method
    if method in ("dflash", "dspark"):
        return f"speculative method {method!r} places its draft tokens' KV by positions eviction does not shift"
    if speculative_config.disable_padded_drafter_batch:
        return ("a draft model with its own KV cache evicts with the padded drafter batch only "
                "(drop disable_padded_drafter_batch)")
    return None


def _has_window_layers(text_config) -> bool:
    layer_types = getattr(text_config, "layer_types", None) or []
    return any("sliding" in str(kind) or "local" in str(kind) for kind in layer_types) or bool(
        getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True))


def is_full_attention(spec) -> bool:
    """A cache spec eviction compacts: plain full attention (not a window, chunked-local or latent subclass),
    TurboQuant's included, or one group of such layers whose caches differ in size (TurboQuant's boundary
    layers keep the model dtype beside the quantized ones: one block table for both)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, TQFullAttentionSpec, UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return all(is_full_attention(layer) for layer in spec.kv_cache_specs.values())
    return (type(spec) in (FullAttentionSpec, TQFullAttentionSpec) and spec.sliding_window is None
            and spec.attention_chunk_size is None)


def evicted_group(kv_cache_config) -> tuple[EvictedGroup | None, str | None]:
    """(the group eviction compacts, None) or (None, why the model cannot evict) for the KV cache groups
    the engine built."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    full = [i for i, group in enumerate(groups) if is_full_attention(group.kv_cache_spec)]
    kinds = ", ".join(f"{type(g.kv_cache_spec).__name__} x{len(g.layer_names)}" for g in groups)
    if not full:
        return None, f"no full-attention KV cache group (groups: {kinds or 'none'})"
    if len(full) > 1:
        return None, (f"{len(full)} full-attention KV cache groups (groups: {kinds}); this version evicts "
                      "one")
    for i, group in enumerate(groups):
        if i != full[0] and not isinstance(group.kv_cache_spec, (AttentionSpec, MambaSpec)):
            return None, (f"a KV cache group eviction cannot run beside: {type(group.kv_cache_spec).__name__} "
                          f"(groups: {kinds})")
    cut = not any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups)
    windows = [-(-g.kv_cache_spec.sliding_window // g.kv_cache_spec.block_size) + 1 for g in groups
               if isinstance(g.kv_cache_spec, SlidingWindowSpec)]
    return EvictedGroup(index=full[0], num_groups=len(groups), hits_cut_at_pages=cut,
                        window_blocks=max(windows, default=0)), None


def other_group_blocks(kv_cache_config, evicted: EvictedGroup, num_tokens: int) -> int:
    """Blocks the groups eviction leaves alone hold for a request of `num_tokens` tokens at most: a
    sliding window's blocks (vLLM frees the rest as they leave it), a linear-attention group's state
    blocks (at most one per block of tokens, with prefix caching), anything else its whole sequence."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    total = 0
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        if i == evicted.index:
            continue
        spec = group.kv_cache_spec
        blocks = -(-num_tokens // spec.block_size)
        if isinstance(spec, SlidingWindowSpec):
            blocks = min(blocks, -(-(spec.sliding_window - 1) // spec.block_size) + 1)
        elif isinstance(spec, MambaSpec) and spec.mamba_cache_mode != "all":
            blocks = min(blocks, (1 if spec.mamba_cache_mode == "none" else 2) + spec.num_speculative_blocks)
        total += blocks
    return total
