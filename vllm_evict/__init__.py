"""vllm-evict: end-of-prefill KV-cache eviction for vLLM that physically frees the evicted pages."""

__version__ = "0.1.0"
