"""Per-head paged layout on vLLM's CPU kernels vs explicit torch attention (no engine start).

Covers: prefix gather from the CPU cache layout, compaction into fresh per-head pages, decode-token
slots after compaction, and the per-head virtual-sequence attention kernel call."""

import pytest
import torch

ops = pytest.importorskip("vllm._custom_ops")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU vLLM's cache and attention ops")

from vllm_evict.engine import compaction  # noqa: E402
from vllm_evict.engine.compaction import LayerCompaction, compaction_slots, select_group  # noqa: E402
from vllm_evict.engine.cpu_backend import CpuPagedCache  # noqa: E402
from vllm_evict.engine import per_head  # noqa: E402
from vllm_evict.engine.request_state import WorkerEviction  # noqa: E402
from vllm_evict.engine.step import StepPlan  # noqa: E402
from vllm_evict.engine.request_config import RequestEviction  # noqa: E402
from vllm_evict.policies import EvictionConfig  # noqa: E402

N, D, H, G = 16, 64, 2, 2
ISA = "vec16"


def make_cache(num_blocks=64):
    kv = torch.zeros(num_blocks, H, N, 2 * D)
    return kv, CpuPagedCache(kv, ISA, 1.0, 1.0, "auto")


def write_standard(kv, keys, values, blocks):
    key_cache, value_cache = kv.view(kv.shape[0], H, 2 * N, D).chunk(2, dim=2)
    pos = torch.arange(keys.shape[0])
    slots = blocks[pos // N].long() * N + pos % N
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, ISA)


def test_gather_prefix_roundtrip():
    torch.manual_seed(1)
    kv, cache = make_cache()
    keys, values = torch.randn(100, H, D), torch.randn(100, H, D)
    blocks = torch.tensor([5, 3, 9, 12, 20, 7, 8], dtype=torch.int32)
    write_standard(kv, keys, values, blocks)
    k2, v2 = cache.gather_prefix(blocks, 100)
    assert torch.equal(k2, keys) and torch.equal(v2, values)


def test_compaction_slots_flat_layout():
    """Head h's kept tokens fill flat slots start_h.. in ascending position order (flat slot s = slot
    s // P of fresh block s % P); evicted tokens get -1; uniform counts give vLLM's own layout."""
    torch.manual_seed(0)
    fresh = [10, 11, 12]
    for counts in ([5, 1, 3, 3], [3, 3, 3, 3]):
        heads, E = len(counts), 100
        keep = torch.zeros(heads, E, dtype=torch.bool)
        for h, c in enumerate(counts):
            keep[h, torch.randperm(E)[: c * N - (h % 2)]] = True   # a partly filled last page too
        slots = compaction_slots(keep, torch.tensor(counts), torch.tensor(fresh), N)
        start = 0
        for h, c in enumerate(counts):
            kept_positions = keep[h].nonzero().flatten().tolist()
            for v, t in enumerate(kept_positions):
                s = start + v // N
                page = fresh[s % len(fresh)] * heads + s // len(fresh)
                assert int(slots[t, h]) == page * N + v % N
                if counts == [3] * 4:  # uniform: slot h of every fresh block, in block order
                    assert page == fresh[v // N] * heads + h
            assert (slots[~keep[h], h] == -1).all()
            start += c


@pytest.mark.parametrize("policy, allocation", [("dropkv", "uniform"), ("snapkv", "adakv"), ("knorm", "adakv"),
                                                ("keydiff", "uniform"), ("caote", "uniform")])
def test_all_layers_at_once_equal_layer_by_layer(policy, allocation):
    """compact_request folds the layers of a group into the head axis: every layer's cache and layout must
    equal scoring, selecting and writing that layer alone; groups of 1, 2 and all 3 layers."""
    torch.manual_seed(4)
    E, P, num_layers, Hq = 150, 3, 3, 2 * H
    prompt_blocks = torch.tensor([5, 3, 9, 12, 20, 7, 40, 41, 42, 43], dtype=torch.int32)
    fresh = torch.tensor([30, 31, 32])
    config = EvictionConfig.from_dict({"policy": policy, "budget": P * N, "allocation": allocation})
    keys, values = torch.randn(num_layers, E, H, D), torch.randn(num_layers, E, H, D)
    keys[:, :, 1] *= 6  # head 1 attends sharply, head 0 flatly: Ada-KV gives them different pages
    keys[:, : E // 2, 1, 0] += 12
    q_window = torch.randn(num_layers, config.window_size(), Hq, D)  # [L, w, Hq, D]

    expected = []
    for i in range(num_layers):
        kv, cache = make_cache()
        write_standard(kv, keys[i], values[i], prompt_blocks)
        keep, counts = select_group(config, q_window[i], keys[i], values[i], 0.125, N, P)
        cache.write_pages(keys[i].reshape(E * H, D), values[i].reshape(E * H, D),
                          compaction_slots(keep, counts, fresh, N).reshape(-1))
        expected.append((kv[fresh.long()].clone(), counts, keep.sum(1)))

    per_layer = 2 * E * H * D * 4
    for group_layers in (1, 2, 3):
        layers = []
        for i in range(num_layers):
            kv, cache = make_cache()
            write_standard(kv, keys[i], values[i], prompt_blocks)
            layers.append((i, cache, kv))
        state = WorkerEviction.for_prompt("r", RequestEviction(config), E, N, q_window=q_window)
        assert state.pages == P
        compaction.compact_request(state, [(i, cache) for i, cache, _ in layers], 0.125, prompt_blocks, fresh,
                                   group_bytes=group_layers * per_layer)
        for i, _, kv in layers:
            pages, counts, kept = expected[i]
            assert torch.equal(kv[fresh.long()], pages), (group_layers, i)
            assert torch.equal(state.layers[i].page_counts, counts) and torch.equal(state.layers[i].kept, kept)
        if allocation == "adakv":
            assert any(len(set(c.tolist())) > 1 for _, c, _ in expected)  # the allocation is uneven


@pytest.mark.parametrize("policy, allocation", [("dropkv", "uniform"), ("snapkv", "adakv"), ("keydiff", "uniform"),
                                                ("h2o", "adakv")])
def test_requests_compacted_together_equal_each_alone(policy, allocation):
    """compact_requests folds the requests of one batch key into the head axis next to the layers: every
    request's pages and layout equal compacting it alone, with all requests in one group and with one
    layer of one request per group."""
    torch.manual_seed(5)
    E, P, num_layers, R = 150, 3, 2, 3
    config = EvictionConfig.from_dict({"policy": policy, "budget": P * N, "allocation": allocation})
    prompt_blocks = [torch.arange(10 * r, 10 * r + 10, dtype=torch.int32).flip(0) for r in range(R)]
    fresh = [torch.arange(40 + P * r, 40 + P * r + P) for r in range(R)]
    keys, values = torch.randn(R, num_layers, E, H, D), torch.randn(R, num_layers, E, H, D)
    keys[:, :, :, 1] *= 6  # head 1 attends sharply, head 0 flatly: Ada-KV gives them different pages
    keys[:, :, : E // 2, 1, 0] += 12
    q_window = torch.randn(R, num_layers, config.window_size(), 2 * H, D)

    def run(batches, group_bytes=compaction.GROUP_BYTES):
        layers = [make_cache() for _ in range(num_layers)]
        for i, (kv, _) in enumerate(layers):
            for r in range(R):
                write_standard(kv, keys[r, i], values[r, i], prompt_blocks[r])
        states = [WorkerEviction.for_prompt(f"r{r}", RequestEviction(config), E, N, q_window=q_window[r])
                  for r in range(R)]
        for batch in batches:
            compaction.compact_requests([(states[r], prompt_blocks[r], fresh[r]) for r in batch],
                                        [(i, cache) for i, (_, cache) in enumerate(layers)], 0.125,
                                        group_bytes=group_bytes)
        return [kv for kv, _ in layers], states

    alone, alone_states = run([[r] for r in range(R)])
    per_layer = 2 * E * H * D * 4
    for group_bytes in (R * num_layers * per_layer, per_layer):
        together, states = run([list(range(R))], group_bytes)
        for i in range(num_layers):
            assert torch.equal(together[i], alone[i]), (group_bytes, i)
            for state, expected in zip(states, alone_states):
                assert torch.equal(state.layers[i].page_counts, expected.layers[i].page_counts)
                assert torch.equal(state.layers[i].kept, expected.layers[i].kept)
    if allocation == "adakv":  # the allocation is uneven, and differs between requests or layers
        counts = [tuple(s.layers[i].page_counts.tolist()) for s in alone_states for i in range(num_layers)]
        assert any(len(set(c)) > 1 for c in counts)


def test_compaction_batches_group_equal_keys_within_group_bytes():
    """Requests batch with the requests of equal batch key, up to group_bytes with all layers; a policy that
    reads token positions (random) compacts alone."""
    def state(policy, prompt_len, budget=64):
        config = EvictionConfig.from_dict({"policy": policy, "budget": budget})
        return WorkerEviction.for_prompt(policy, RequestEviction(config), prompt_len, N)

    per_request = 2 * 200 * 4 * H * D * 4  # held 200 tokens, 4 layers, float32
    a1, b1, a2, a3, c1, r1, r2 = (state("dropkv", 200), state("snapkv", 200), state("dropkv", 200), state("dropkv", 200),
                                  state("dropkv", 208), state("random", 200), state("random", 200))
    batches = compaction.compaction_batches([a1, b1, a2, a3, c1, r1, r2], 4, H, 2 * D * 4, 2 * per_request)
    assert batches == [[a1, a2], [b1], [a3], [c1], [r1], [r2]]


def explicit_attention(q, keys, values, scale):
    logits = torch.einsum("gd,ld->gl", q, keys) * scale
    return logits.softmax(-1) @ values


@pytest.mark.parametrize("allocation", ["uniform", "adakv"])
def test_compact_then_decode_matches_explicit(allocation):
    torch.manual_seed(2)
    kv, cache = make_cache()
    E, P = 100, 2
    prompt_blocks = torch.tensor([5, 3, 9, 12, 20, 7, 8], dtype=torch.int32)
    fresh = [30, 31]
    keys, values = torch.randn(E, H, D), torch.randn(E, H, D)
    write_standard(kv, keys, values, prompt_blocks)
    # an uneven per-head keep (adakv-like) or uniform
    counts = torch.tensor([3, 1]) if allocation == "adakv" else torch.tensor([2, 2])
    keep = torch.zeros(H, E, dtype=torch.bool)
    for h in range(H):
        keep[h, torch.randperm(E)[: int(counts[h]) * N]] = True
    slots = compaction_slots(keep, counts, torch.tensor(fresh), N)
    layout = LayerCompaction(page_counts=counts, kept=keep.sum(1))
    cache.write_pages(keys.reshape(E * H, D), values.reshape(E * H, D), slots.reshape(-1))

    config = EvictionConfig.from_dict({"policy": "keydiff", "budget": 32, "allocation": allocation})
    state = WorkerEviction.for_prompt("r", RequestEviction(config), E, N)
    assert state.pages == P
    state.advance()  # compacted
    state.layers[0] = layout
    # one decode step at position E+3 after 3 tail tokens; tail block 40
    tail_block = 40
    m = 4
    new_k, new_v = torch.randn(m, H, D), torch.randn(m, H, D)
    block_row = torch.tensor([[30, 31, tail_block, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([E + m - state.shift], dtype=torch.int32)  # the worker's shifted length
    # The per-head path on this row (the engine takes it for Ada-KV rows; uniform ones must agree with it).
    plan = StepPlan(num_reqs=1, states=[state], captures=[], compacting=[], compacted_rows=[0], per_head_rows=[0],
                    per_head_tokens=list(range(m)), page_size=N, max_blocks=4, row_blocks=[3])
    qsl = torch.tensor([0, m], dtype=torch.int32)  # m-token chunk (causal) after compaction
    tables = per_head.virtual_tables(plan, 0, block_row, seq_lens, qsl, m, H)
    slots_new = tables.slots
    if allocation == "uniform":  # the stock layout: identity tables, no per-head shift
        assert tables.pages[:, 0, :3].tolist() == [[b * H + h for b in (30, 31, tail_block)] for h in range(H)]
        assert tables.shift.eq(0).all()
    cache.write_tokens(new_k, new_v, slots_new)

    q = torch.randn(m, H * G, D)
    qv = q.view(m, H, G, D).permute(1, 0, 2, 3).contiguous().view(H * m, G, D)
    vqsl = plan.tables.query_start_loc
    vlens = tables.seq_lens.reshape(-1).to(torch.int32)
    md = ops.cpu_attn_get_scheduler_metadata(num_reqs=H, num_heads=G, num_kv_heads=1, head_dim=D, seq_lens=vlens,
                                             dtype=torch.float32, query_start_loc=vqsl, causal=True,
                                             sliding_window_size=-1, isa=ISA, enable_kv_split=False)
    out = torch.empty_like(qv)
    ops.cpu_attention_with_kv_cache(query=qv, key_cache=cache.key_pages, value_cache=cache.value_pages, output=out,
                                    query_start_loc=vqsl, seq_lens=vlens, scale=D ** -0.5, causal=True,
                                    alibi_slopes=None, sliding_window=-1, block_table=tables.pages.reshape(H, -1),
                                    softcap=0.0, scheduler_metadata=md, s_aux=None)
    out = out.view(H, m, G, D)
    for h in range(H):
        kept_k = keys[keep[h], h]
        kept_v = values[keep[h], h]
        for t in range(m):
            ks = torch.cat([kept_k, new_k[: t + 1, h]])
            vs = torch.cat([kept_v, new_v[: t + 1, h]])
            expected = explicit_attention(q[t, h * G:(h + 1) * G], ks, vs, D ** -0.5)
            torch.testing.assert_close(out[h, t], expected, rtol=1e-5, atol=1e-5)


def test_per_head_attention_with_sinks_matches_explicit():
    """GPT-OSS's attention sinks on the per-head path (Ada-KV rows): each KV head's virtual sequences get
    their own query heads' sinks (one kernel call per KV head), as explicit softmax with the sink logit in
    the denominator computes them. bf16: vLLM's CPU kernel takes sinks in bf16."""
    from vllm_evict.engine.cpu_backend import EvictCPUAttentionImpl

    torch.manual_seed(5)
    R, T = 2, 3                                   # two requests, three query tokens each (causal)
    lens = torch.tensor([[40, 21], [17, 33]])     # [H, R] uneven per-head lengths
    kv = torch.zeros(64, H, N, 2 * D, dtype=torch.bfloat16)
    cache = CpuPagedCache(kv, ISA, 1.0, 1.0, "auto")
    pages = torch.randperm(64 * H)[: H * R * 4].view(H * R, 4).to(torch.int32)  # any pages of the per-head view
    keys, values = torch.randn(H * R, 64, D, dtype=torch.bfloat16), torch.randn(H * R, 64, D, dtype=torch.bfloat16)
    for row in range(H * R):
        n = int(lens.view(-1)[row])
        pos = torch.arange(n)
        cache.write_pages(keys[row, :n], values[row, :n], pages[row, pos // N].long() * N + pos % N)
    impl = object.__new__(EvictCPUAttentionImpl)  # the kernel call alone: no engine
    sinks = torch.randn(H * G, dtype=torch.bfloat16) * 2
    impl.sinks, impl.num_kv_heads, impl.isa, impl.scale = sinks, H, ISA, D ** -0.5
    impl.logits_soft_cap, impl.kv_cache_dtype = 0.0, "auto"
    q = torch.randn(H * R * T, G, D, dtype=torch.bfloat16)                  # head-major virtual sequences
    qsl = torch.arange(0, H * R * T + 1, T, dtype=torch.int32)
    out = torch.empty_like(q)
    impl._per_head_attention(q, cache, qsl, lens.view(-1).to(torch.int32), pages, T, 64, out)
    for row in range(H * R):
        h, n = row // R, int(lens.view(-1)[row])
        for t in range(T):
            visible = n - T + t + 1
            logits = torch.einsum("gd,ld->gl", q[row * T + t].float(), keys[row, :visible].float()) * D ** -0.5
            probs = torch.cat([logits, sinks[h * G: (h + 1) * G].float().unsqueeze(1)], dim=1).softmax(-1)[:, :-1]
            expected = probs @ values[row, :visible].float()
            torch.testing.assert_close(out[row * T + t].float(), expected, rtol=2e-2, atol=2e-2)


def test_group_bytes_are_half_the_profiled_activation_memory():
    """An engine's compaction batches gather up to half the activation memory vLLM profiled (the other half for
    the scores and slot tables), never less than GROUP_BYTES (no profile: a KV cache size given by hand)."""
    assert compaction.group_bytes(None) == compaction.GROUP_BYTES
    assert compaction.group_bytes(compaction.GROUP_BYTES) == compaction.GROUP_BYTES
    assert compaction.group_bytes(int(1.95 * 2**30)) == int(1.95 * 2**30) // 2  # Llama-3.1-8B on an H200
