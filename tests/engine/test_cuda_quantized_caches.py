"""GPU: eviction on quantized KV caches: FlashAttention's fp8 (e4m3, vLLM's per-layer k/v scales, FlashAttention 3),
the Triton backend's per-token-head caches (int8, fp8, int4; tests/engine/test_per_token_head_cache.py
checks their adapter against vLLM's own write and scale views) and TurboQuant's (tests/engine/
test_turboquant_cache.py checks its adapter against vLLM's own store and dequantization).

* Compaction of fp8 caches: scoring reads the cache dequantized (each layer's bytes times its scale) and
  fp8 window queries dequantized with their scale; the kept sets equal the torch reference's on those same
  dequantized values (CPU, up to DESIGN.md §7.3's near ties); the kept tokens move as the cache's own bytes.
* The engine on each cache dtype: a 100% budget (uniform: the stock layout; Ada-KV: the per-head path, on
  FlashAttention) and a decode budget covering the sequence give the tokens of the same engine without
  eviction; every policy at a 10% budget, one-shot, block-wise and decode-time, runs to its length and frees
  blocks. On the Triton and TurboQuant backends Ada-KV is refused with a 400-style error that names the backend."""

from __future__ import annotations

import pytest
import torch

from tests.policies.test_cuda import near_tie_ok

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, D, H, G = 16, 64, 2, 2
SCALES = {"k": 0.5, "v": 2.0, "q": 0.25}


def fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x quantized as vLLM quantizes with a static scale: x / scale, saturated to e4m3's range."""
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("allocation", ["uniform", "adakv"])
@pytest.mark.parametrize("policy", ["snapkv", "dropkv", "keydiff", "obcache-joint", "caote", "tova", "h2o", "knorm",
                                    "streaming"])
def test_fp8_cache_compaction_matches_the_reference_on_dequantized_values(monkeypatch, policy, allocation):
    from vllm_evict.engine import compaction
    from vllm_evict.engine.cuda_backend import CudaPagedCache
    from vllm_evict.engine.request_config import RequestEviction
    from vllm_evict.engine.request_state import WorkerEviction
    from vllm_evict.policies import EvictionConfig, score_tokens, select_tokens

    torch.manual_seed(7)
    dev, E, P, num_layers, scale = "cuda", 300, 4, 2, D ** -0.5
    config = EvictionConfig.from_dict({"policy": policy, "budget": P * N, "allocation": allocation})
    w = config.window_size()
    prompt_blocks = torch.arange(20, 20 + -(-E // N), device=dev, dtype=torch.int32).flip(0)
    fresh = torch.arange(60, 60 + P, device=dev)
    scales = {k: torch.tensor(v, device=dev) for k, v in SCALES.items()}
    layers, raw, expected_inputs = [], [], []
    for i in range(num_layers):
        kv = torch.zeros(80, H, N, 2 * D, device=dev, dtype=torch.uint8)
        cache = CudaPagedCache(kv, D, "fp8", scales["k"], scales["v"], scales["q"], torch.bfloat16)
        keys = torch.randn(E, H, D, device=dev, dtype=torch.bfloat16)
        keys[:, 1] *= 4  # head 1 attends sharply: Ada-KV gives the heads different pages
        values = torch.randn(E, H, D, device=dev, dtype=torch.bfloat16)
        pos = torch.arange(E, device=dev)
        slots = (prompt_blocks[pos // N].long().unsqueeze(1) * H + torch.arange(H, device=dev)) * N + (pos % N).unsqueeze(1)
        cache.write_pages(keys.reshape(-1, D), values.reshape(-1, D), slots.reshape(-1))  # vLLM's fp8 write
        layers.append((i, cache))
        raw.append(kv.clone())
        q8 = fp8(torch.randn(w, H * G, D, device=dev), SCALES["q"]) if w else None
        k_raw, v_raw = cache.gather_prefix(prompt_blocks, E)
        dequantized = [(x.view(torch.float8_e4m3fn).float() * s).to(torch.bfloat16)
                       for x, s in ((k_raw, SCALES["k"]), (v_raw, SCALES["v"]))]
        q = None if q8 is None else (q8.float() * SCALES["q"]).to(torch.bfloat16)
        expected_inputs.append((q8, q, *dequantized))
    # the round trip is exact up to e4m3 rounding (scales are powers of two)
    assert (expected_inputs[0][2].float() - keys.float()).abs().max() > 0

    seen = []
    select_group = compaction.select_group

    def recording(config, q_window, keys, values, *args, **kwargs):
        keep, counts = select_group(config, q_window, keys, values, *args, **kwargs)
        seen.append((q_window, keys, values, keep, counts))
        return keep, counts

    monkeypatch.setattr(compaction, "select_group", recording)
    state = WorkerEviction.for_prompt("r", RequestEviction(config), E, N,
                                      q_window=torch.stack([expected_inputs[i][0] for i in range(num_layers)]) if w else None)
    compaction.compact_request(state, layers, scale, prompt_blocks, fresh)
    (q_seen, k_seen, v_seen, keep, counts), = seen  # both layers in one group
    keep, counts = keep.view(num_layers, H, E), counts.view(num_layers, H)
    for i, (layer_idx, cache) in enumerate(layers):
        _, q, k, v = expected_inputs[i]
        # scoring saw exactly the dequantized values
        assert torch.equal(k_seen.view(E, num_layers, H, D)[:, i], k) and torch.equal(v_seen.view(E, num_layers, H, D)[:, i], v)
        if w:
            assert torch.equal(q_seen.view(w, num_layers, H * G, D)[:, i], q)
        # the kept set equals the CPU reference's on the same values, up to near ties
        ref_scores = score_tokens(policy, None if q is None else q.cpu(), k.cpu(), v.cpu(), scale=scale,
                                  **config.score_options())
        ref_keep = select_tokens(ref_scores, P * N, page_size=N, **config.select_options())
        kept = keep[i].sum(dim=1)
        if torch.equal(ref_keep.sum(dim=1), kept.cpu()):
            near_tie_ok(ref_scores, ref_keep, keep[i].cpu(), kept.tolist())
        else:
            assert allocation == "adakv", "uniform allocation keeps the same count per head"
        # the kept tokens' bytes moved unchanged into their per-head slots
        expected = raw[i].clone()
        rows, src = expected.view(-1, 2 * D), raw[i].view(-1, 2 * D)
        slots = compaction.compaction_slots(keep[i], counts[i], fresh, N)      # [E, H]
        pos = torch.arange(E, device=dev)
        source = (prompt_blocks[pos // N].long().unsqueeze(1) * H + torch.arange(H, device=dev)) * N + (pos % N).unsqueeze(1)
        moved = slots >= 0
        rows[slots[moved]] = src[source[moved]]
        assert torch.equal(cache.kv_cache[fresh], expected[fresh]), (policy, allocation, layer_idx)


MAX_TOKENS = 40


PER_TOKEN_HEAD = ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"]
# the tiny model's 3 layers under TurboQuant: the middle one quantized, vLLM keeps the first and last in bf16
TURBOQUANT = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"]


@pytest.mark.parametrize("cache_dtype", ["fp8", "auto", *PER_TOKEN_HEAD, "auto-triton", *TURBOQUANT])
def test_engine_eviction_at_full_budget_matches_no_eviction(tiny_llama, cache_dtype):
    """One engine (FULL CUDA graphs, async scheduling) per cache dtype (bf16 on FlashAttention and on Triton,
    "auto-triton", for comparison): at a 100% budget and with a decode budget covering the sequence the tokens
    equal the same prompt's without eviction (uniform exactly; what runs per-head attention, Ada-KV rows and on
    fp8 the decode budget's capture steps, until a divergence where each side's token is in the other's top 5,
    as test_cuda_graphs allows); every policy at 10%, one-shot and block-wise, and a decode budget, run to
    their length and free blocks. The Triton and TurboQuant backends refuse Ada-KV."""
    import gc

    from vllm import SamplingParams

    from tests.engine.inprocess import stdout_with_a_file_descriptor
    from vllm_evict.policies import POLICIES
    from vllm_evict.testing.engines import make_llm

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 1000, (600,), generator=g).tolist()
    exact = [{"policy": "snapkv", "budget": 1.0}, {"policy": "keydiff", "budget": 1.0, "chunked": True,
                                                   "chunk_size": 128}]
    close = [{"policy": "snapkv", "budget": 1.0, "allocation": "adakv"}]
    # The decode steps that record its window queries replay the per-head graphs: FlashAttention over one
    # KV head per virtual sequence. On fp8 its P tiles are quantized per split, so those steps round
    # differently from the stock graph (exact on bf16).
    covering = {"policy": "dropkv", "decode_budget": 600 + MAX_TOKENS, "decode_every": 16}
    (close if cache_dtype == "fp8" else exact).append(covering)
    # vLLM's Triton kernels for fp8 and int4 per-token-head caches do not give a request the same tokens
    # in every batch (H200: two identical int4 requests of one eager batch differed from their first token,
    # without eviction), so there the requests at full budget are compared as the close ones are.
    # On TurboQuant vLLM prefills a fresh prompt from its unquantized K/V and a prompt's later chunks, or a
    # prefix-cache hit, from the cache's dequantized ones: a request's tokens depend on how it was scheduled.
    if cache_dtype in ("fp8_per_token_head", "int4_per_token_head", *TURBOQUANT):
        close, exact = close + exact, []
    evicting = [{"policy": p, "budget": 0.1} for p in POLICIES] + [
        {"policy": "snapkv", "budget": 0.1, "chunked": True, "chunk_size": 128},
        {"policy": "dropkv", "budget": 0.1, "allocation": "adakv"},
        {"policy": "snapkv", "decode_budget": 64, "decode_every": 16}]
    stock_only = ("TURBOQUANT" if cache_dtype in TURBOQUANT else
                  "TRITON_ATTN" if cache_dtype in PER_TOKEN_HEAD or cache_dtype == "auto-triton" else None)
    refused = [c for c in close + evicting if c.get("allocation") == "adakv"] if stock_only else []
    cases = [None, *[c for c in exact + close + evicting if c not in refused]]
    engine = dict(kv_cache_dtype="auto", attention_backend="TRITON_ATTN") if cache_dtype == "auto-triton" else dict(
        kv_cache_dtype=cache_dtype)
    with stdout_with_a_file_descriptor():
        llm = make_llm(tiny_llama, dtype="bfloat16", block_size=N, max_model_len=2048, kv_cache_memory_bytes=1 << 30,
                       max_num_seqs=32, seed=0, **engine)
    try:
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5,
                                 extra_args={"vllm_evict": c} if c else None) for c in cases]
        outs = llm.generate([{"prompt_token_ids": prompt}] * len(cases), params)
        for case in refused:  # refused where requests arrive, naming the backend; the engine keeps serving
            with pytest.raises(ValueError, match=stock_only):
                llm.generate([{"prompt_token_ids": prompt}],
                             SamplingParams(max_tokens=4, extra_args={"vllm_evict": case}))
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    plain, wrong = outs[0].outputs[0], []
    for case, out in zip(cases[1:], outs[1:]):  # every case checked, the failures reported together
        seq = out.outputs[0]
        if len(seq.token_ids) != MAX_TOKENS or seq.finish_reason != "length":
            wrong.append((case, f"ended {seq.finish_reason} after {len(seq.token_ids)} tokens"))
        elif case in exact and list(seq.token_ids) != list(plain.token_ids):
            first = next(t for t, (x, y) in enumerate(zip(seq.token_ids, plain.token_ids)) if x != y)
            wrong.append((case, f"tokens differ from index {first}"))
        elif case in close:
            for t, (x, y) in enumerate(zip(seq.token_ids, plain.token_ids)):
                if x != y:
                    if not (x in plain.logprobs[t] and y in seq.logprobs[t]):
                        wrong.append((case, f"index {t}: {x} and {y} not in each other's top 5"))
                    break
        elif case in evicting:
            report = out.kv_transfer_params["vllm_evict"]
            if report.get("blocks_freed", 0) + report.get("decode_blocks_freed", 0) <= 0:
                wrong.append((case, f"freed no block: {report}"))
    assert not wrong, wrong
