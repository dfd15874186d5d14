"""GPU: FULL CUDA graphs with eviction give the tokens of the same compiled engine run without graphs.

One mixed batch: plain requests, uniformly compacted requests (stock attention with shifted lengths
and slots, replayed inside vLLM's FULL decode graphs) and Ada-KV-compacted ones (per-head attention,
replayed inside per-head FULL decode graphs), plus a block-wise KeyDiff request (chunked=true) that
compacts in place every 64 prompt tokens (the CUDA gather / write kernels on overlapping blocks) and three
decode-budget requests that compact in place every 16 or 32 generated tokens, one of them query-based
(SnapKV: window queries recorded from the graphs' staged queries). The Ada-KV requests stop early, so the
decode steps first hold per-head rows (per-head graphs), then only stock-layout rows (vLLM's graphs, or
staged graphs, vLLM's attention staging the queries, for the steps that record queries or compact); the
test records the dispatcher's choices, requires each kind of FULL step, and requires every decode-only step
to be FULL.
It runs twice with graphs: per-head graphs that let FlashAttention split KV, and graphs that do not
(per_head.SPLIT_KV_RATIO and SPLIT_KV_MIN_TOKENS forcing either choice), each against the run without graphs.

The baseline is the same torch.compile'd model without CUDA graphs (cudagraph_mode NONE), so the test
isolates what graph capture and replay change. Against enforce_eager the compiled model's bf16 keys differ
in rounding (inductor's RMSNorm and RoPE against vLLM's custom ops), which flips KeyDiff selections at near
ties: tools/device/diag_chunked_graphs.py found compile, PIECEWISE and FULL runs giving identical tokens, all
three apart from eager by the same few kept tokens.

Greedy tokens are compared as vLLM compares its own graph and eager runs (`check_logprobs_close`):
equal until the first divergence, where each side's token is in the other's top-5; up to there the
chosen tokens' logprobs agree within bf16 noise."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

PAGE = 16
LONG, SHORT = 48, 20
CASES = [None, {"policy": "dropkv", "budget": 0.25}, {"policy": "streaming", "budget": 0.3},
         {"policy": "snapkv", "budget": 0.25, "allocation": "adakv"}, None,
         {"policy": "keydiff", "budget": 0.2, "allocation": "adakv"}, {"policy": "snapkv", "budget": 0.2},
         {"policy": "keydiff", "budget": 96, "chunked": True, "chunk_size": 64},  # block-wise, in place
         # decode-time eviction (DESIGN.md §4.8): its window captures and compactions run in per-head FULL graphs
         {"policy": "keydiff", "decode_budget": 64, "decode_every": 16},
         {"policy": "random", "budget": 0.25, "decode_budget": 48, "decode_every": 32, "protect_prompt": True},
         {"policy": "snapkv", "decode_budget": 64, "decode_every": 32},
         # Ada-KV evicting again: uneven heads in per-head FULL graphs, re-laid out at every point (one before
         # the Ada-KV requests stop at SHORT tokens, so that the later decode points run in staged graphs)
         {"policy": "dropkv", "decode_budget": 64, "decode_every": 16, "allocation": "adakv"},
         {"policy": "snapkv", "budget": 96, "chunked": True, "chunk_size": 64, "allocation": "adakv",
          "decode_budget": 80, "decode_every": 16}]


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (int(n),), generator=g).tolist()
            for n in (300, 700, 650, 720, 500, 610, 900, 800, 400, 350, 380, 460, 640)]


def generate(model, **engine_overrides):
    from vllm import SamplingParams
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from tests.engine.inprocess import stdout_with_a_file_descriptor
    from vllm_evict.engine.step import PerHeadDecodeBatch, StagedDecodeBatch
    from vllm_evict.engine.worker import STATE
    from vllm_evict.testing.engines import make_llm

    # (mode, plan has compacted rows, per-head rows, per-head graph, decode only, records queries or compacts,
    # staged graph) of every real step
    modes, splits = [], []  # splits: split_kv of every per-head graph step
    # Recorded where the runner receives the dispatcher's final answer (after the plugin's hooks).
    hooked = GPUModelRunner._determine_batch_execution_and_padding

    def recording(self, *args, **kwargs):
        result = hooked(self, *args, **kwargs)
        mode, desc = result[0], result[1]
        plan = STATE.plan
        if plan is not None:
            per_head_graph = isinstance(desc, PerHeadDecodeBatch)
            modes.append((mode, bool(plan.compacted_rows), plan.per_head, per_head_graph,
                          int(self.query_start_loc.np[plan.num_reqs]) == plan.num_reqs,
                          bool(plan.captures or plan.compacting), isinstance(desc, StagedDecodeBatch)))
            if per_head_graph:
                splits.append(desc.split_kv)
        return result

    GPUModelRunner._determine_batch_execution_and_padding = recording
    try:
        with stdout_with_a_file_descriptor():
            llm = make_llm(model, dtype="bfloat16", block_size=PAGE, max_model_len=2048,
                           kv_cache_memory_bytes=1 << 30, max_num_seqs=16, seed=0, **engine_overrides)
        params = [SamplingParams(temperature=0, max_tokens=SHORT if c and c.get("allocation") == "adakv" else LONG,
                                 ignore_eos=True, logprobs=5, extra_args={"vllm_evict": c} if c else None)
                  for c in CASES]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
        del llm
    finally:
        GPUModelRunner._determine_batch_execution_and_padding = hooked
        gc.collect()
        torch.cuda.empty_cache()
    return outs, [(mode == CUDAGraphMode.FULL, *rest) for mode, *rest in modes], splits


@pytest.fixture(scope="module")
def no_graphs(tiny_llama):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return generate(tiny_llama, compilation_config={"cudagraph_mode": "NONE"})[0]


@pytest.mark.parametrize("split_kv", [True, False])
def test_full_graphs_match_no_graphs(tiny_llama, no_graphs, split_kv, monkeypatch):
    from vllm_evict.engine import per_head

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # dispatcher runs in this process
    monkeypatch.setattr(per_head, "SPLIT_KV_RATIO", 0.0 if split_kv else float("inf"))
    monkeypatch.setattr(per_head, "SPLIT_KV_MIN_TOKENS", 0)
    graphs, modes, splits = generate(tiny_llama)
    assert splits and set(splits) == {split_kv}, f"per-head graphs replayed with split_kv {set(splits)}"
    summary = {k: modes.count(k) for k in set(modes)}  # (FULL?, compacted?, per-head rows?, per-head graph?,
    #                                                    decode only?, records or compacts?, staged graph?) -> steps
    assert any(full and compacted and not per_head and not work for full, compacted, per_head, _, _, work, _ in modes), \
        f"no stock FULL graph step with compacted rows: {summary}"
    assert any(full and per_head and graph for full, _, per_head, graph, _, _, _ in modes), \
        f"no per-head FULL graph step: {summary}"
    assert any(full and graph and work for full, _, _, graph, _, work, _ in modes), \
        f"no per-head FULL graph step that records window queries or compacts: {summary}"
    assert any(full and staged and work for full, _, _, _, _, work, staged in modes), \
        f"no staged FULL graph step that records window queries or compacts: {summary}"
    assert all(graph == (full and per_head) for full, _, per_head, graph, _, _, _ in modes), \
        f"a per-head graph for a step without per-head rows, or such a step in another graph: {summary}"
    assert all(staged == (full and work and not per_head) for full, _, per_head, _, _, work, staged in modes), \
        f"a staged graph for a step that needs none, or such a step in another graph: {summary}"
    assert all(full for full, _, _, _, decode_only, _, _ in modes if decode_only), f"a decode-only step not FULL: {summary}"
    for i, (a, b) in enumerate(zip(graphs, no_graphs)):
        ga, gb = a.outputs[0], b.outputs[0]
        assert len(ga.token_ids) == len(gb.token_ids)
        for t, (x, y) in enumerate(zip(ga.token_ids, gb.token_ids)):
            if x != y:
                assert x in gb.logprobs[t] and y in ga.logprobs[t], \
                    f"request {i} ({CASES[i]}) step {t}: graphs {ga.token_ids} no graphs {gb.token_ids}"
                break
            diff = abs(ga.logprobs[t][x].logprob - gb.logprobs[t][y].logprob)
            assert diff < 0.1, f"request {i} ({CASES[i]}) step {t}: logprob differs by {diff}"
