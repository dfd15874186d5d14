"""The torch operations one decode-point compaction batch issues, counted on the CPU. Not a unit test.

On a GPU each is a kernel launch or at least a dispatch on the host, and a step that compacts a dozen requests
was bound by them (docs/BENCHMARKS.md, "Decode-time eviction"). This counts the engine's own compaction
(`compaction.compact_requests`, then `kept_most` of its per-head requests, as the worker calls them) of R requests at
their third decode point (the second in per-head layout under Ada-KV), Llama-3.1-8B-shaped (32 layers,
8 KV heads, 32 query heads, d=128, page 16), with the torch profiler's top-level operators. The cache
adapter's gather and write and the fused scoring kernel are one launch each on CUDA, so they are left out
(the CPU adapter loops over layers instead; scoring returns random scores). `kernels` counts the dispatched
operations that compute (no views, no empty tensors): on a GPU a kernel each, a graph node each in a captured
compaction; `by_function` splits them by the engine function that issued them.

  python benchmarks/compaction_launches.py --requests 1 3 6 --allocations uniform adakv
"""

from __future__ import annotations

import argparse
import collections
import json
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LAYERS, H, G, D, N = 32, 8, 4, 128, 16
PROMPT, DECODE_BUDGET, DECODE_EVERY = 1024, 1024, 128


BLOCKS_EACH = -(-(PROMPT + 4 * DECODE_EVERY) // N)  # a request's blocks: its prompt and four points' tokens


class DecodePointBatch:
    """R requests of PROMPT tokens with a decode budget of DECODE_BUDGET every DECODE_EVERY tokens, compacted
    together at each of their decode points as the worker compacts them (compact_requests, then each per-head
    request's kept_most) over `layers`, whose caches hold R * BLOCKS_EACH blocks (request r's are its own
    consecutive run); `queries(window)` gives the window queries [L, w, Hq, D] a point reads."""

    def __init__(self, config, layers: list, num_requests: int, queries, group_bytes: int) -> None:
        from vllm_evict.engine.request_config import RequestEviction
        from vllm_evict.engine.request_state import WorkerEviction

        spec = RequestEviction(config, decode_budget=DECODE_BUDGET, decode_every=DECODE_EVERY)
        self.states = [WorkerEviction.for_prompt(f"r{r}", spec, PROMPT, N) for r in range(num_requests)]
        self.layers, self.queries, self.group_bytes = layers, queries, group_bytes
        self.device = layers[0][1].device

    def point(self) -> None:
        from vllm_evict.engine import compaction, request_state

        requests = []
        for r, state in enumerate(self.states):
            blocks = list(range(r * BLOCKS_EACH, (r + 1) * BLOCKS_EACH))
            state.prompt_block_ids = blocks[: -(-(state.point.at - state.shift) // N)]
            state.fresh_blocks = blocks[: state.written_blocks]
            if state.window:
                state.q_window = self.queries(state.window)
            requests.append((state, torch.tensor(state.prompt_block_ids, device=self.device),
                             torch.tensor(state.fresh_blocks, device=self.device)))
        compaction.compact_requests(requests, self.layers, D ** -0.5, group_bytes=self.group_bytes)
        per_head = [state for state in self.states if not state.stock_layout]
        if per_head:
            request_state.kept_most(per_head)

    def advance(self) -> None:
        for state in self.states:
            state.advance()


# aten operations that compute nothing on a GPU (views, metadata, allocation)
NO_KERNEL = ("view", "_unsafe_view", "empty", "empty_strided", "permute", "expand", "slice", "select", "unsqueeze",
             "squeeze", "alias", "detach", "lift_fresh", "transpose", "t", "unbind", "split", "narrow", "as_strided",
             "_local_scalar_dense")


class KernelCount(TorchDispatchMode):
    """Dispatched operations that compute, by the innermost vllm_evict function on the stack (this file's own:
    the stand-in scores, the block ids, not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_function = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in NO_KERNEL:
            frames = [f for f in traceback.extract_stack()[:-1] if "vllm_evict" in f.filename or f.filename == __file__]
            inner = frames[-1] if frames else None
            self.by_function["(benchmark)" if inner is None or inner.filename == __file__ else inner.name] += 1
        return func(*args, **(kwargs or {}))


def count(policy: str, allocation: str, num_requests: int) -> dict:
    from torch.profiler import profile

    from vllm_evict.engine import compaction
    from vllm_evict.engine.cpu_backend import CpuPagedCache
    from vllm_evict.policies import EvictionConfig

    def scores(policy, q_window, keys, values, lengths=None, **options):  # what the fused kernel returns
        out = torch.rand(keys.shape[1], keys.shape[0])
        if lengths is not None:
            out[torch.arange(keys.shape[0]) >= lengths.view(-1, 1)] = float("-inf")
        return out

    CpuPagedCache.gather_layers = staticmethod(lambda caches, blocks, n, keys, values: None)
    CpuPagedCache.gather_held = staticmethod(lambda caches, slots, keys, values: None)
    CpuPagedCache.write_layers = staticmethod(lambda caches, keys, values, slots: None)
    compaction.score_tokens = scores
    config = EvictionConfig.from_dict({"policy": policy, "allocation": allocation}, budget_required=False)
    layers = [(i, CpuPagedCache(torch.zeros(num_requests * BLOCKS_EACH, H, N, 2 * D), "vec16", 1.0, 1.0, "auto"))
              for i in range(LAYERS)]
    batch = DecodePointBatch(config, layers, num_requests, lambda w: torch.randn(LAYERS, w, H * G, D),
                             group_bytes=1 << 40)
    for _ in range(2):
        batch.point()
        batch.advance()
    saved = [(state.layers, state.shift) for state in batch.states]
    with profile() as prof:
        batch.point()
    ops = collections.Counter(event.name for event in prof.events() if event.cpu_parent is None)
    for state, (kept_layers, shift) in zip(batch.states, saved):  # the same point again, its kernels counted
        state.layers, state.shift = kept_layers, shift
    with KernelCount() as kernels:
        batch.point()
    kernels.by_function.pop("(benchmark)", None)  # the stand-in scores and the block ids
    return {"policy": policy, "allocation": allocation, "requests": num_requests, "ops": sum(ops.values()),
            "most": ops.most_common(5), "kernels": sum(kernels.by_function.values()),
            "by_function": dict(kernels.by_function.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", nargs="+", default=["dropkv"])
    parser.add_argument("--allocations", nargs="+", default=["uniform", "adakv"])
    parser.add_argument("--requests", nargs="+", type=int, default=[1, 3, 6])
    args = parser.parse_args()
    for policy in args.policies:
        for allocation in args.allocations:
            for num_requests in args.requests:
                print(json.dumps(count(policy, allocation, num_requests)), flush=True)


if __name__ == "__main__":
    main()
