"""The kernels a decode point launches compile one variant per model: what the engine-start warm-up compiles
(engine/warm_up.py) is all a served request runs. Triton compiles a kernel again for each new value of a
constexpr and, unless told not to, for each integer that is 1 or a multiple of 16 and each pointer that is or
is not 16-byte aligned; a compile inside a served step holds its whole batch (docs/BENCHMARKS.md: Ada-KV's first
decode points on an H100).

Random calls as the engine makes them (the kernel tests' cases: lengths, batch sizes, layer-group views and
rows of the batch's scalars) run in the Triton interpreter (subprocess), and every launch is specialised
as Triton's own binder does for an sm_90 GPU. Per kernel, the calls that share what the model and the
engine's mode fix (head counts, page size, head dim, dtypes, policy, ragged held sets) must share one variant."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.kernels.interpreter import check_in_interpreter


def record_variants() -> dict:
    """Install a recorder on the interpreter's launches: {kernel name: [specialisation of each launch]}
    (Triton's (type, specialisation) per argument, constexprs with their values)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    launches, binders = defaultdict(list), {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if self.fn not in binders:
            jit = JITFunction(self.fn, do_not_specialize=self.kwargs.get("do_not_specialize"),
                              do_not_specialize_on_alignment=self.kwargs.get("do_not_specialize_on_alignment"))
            binders[self.fn] = create_function_from_signature(jit.signature, jit.params, backend)
        launches[self.fn.__name__].append(tuple(binders[self.fn](*args, **kwargs)[1]))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    return launches


def adakv_pages_calls(gen: torch.Generator):
    """(model key, call) of Ada-KV's allocation: layer groups, widths and budgets vary."""
    from tests.kernels.test_adakv_pages import random_case
    from vllm_evict.kernels.adakv_pages import adakv_pages_fused

    args = random_case(gen)
    sorted_scores, lengths, pages = args.pop("sorted_scores"), args.pop("lengths"), args.pop("pages")
    group = int(torch.randint(0, sorted_scores.shape[0], (), generator=gen))  # a layer group's view, as the engine
    yield ((sorted_scores.shape[1], lengths is None),
           lambda: adakv_pages_fused(sorted_scores[group:], pages, lengths=None if lengths is None else
                                     lengths[group:], **args))


def compaction_slots_calls(gen: torch.Generator):
    """The kept tokens' destinations: requests, layers, token counts and pool sizes vary."""
    from tests.kernels.test_compaction_slots import random_case
    from vllm_evict.kernels.compaction_slots import compaction_slots_fused

    args = random_case(gen)
    heads = args["keep"].shape[-2]
    yield ((heads, args["page_size"], args["fresh_blocks"].dtype, isinstance(args["num_blocks"], torch.Tensor)),
           lambda: compaction_slots_fused(**args))


def held_slots_calls(gen: torch.Generator):
    """The held tokens' slots: requests, layer groups (views) and widths vary."""
    from tests.kernels.test_held_slots import arguments, random_case
    from vllm_evict.kernels.held_slots import held_slots_fused

    case = random_case(gen)
    yield (case["counts"].shape[-1], case["page_size"]), lambda: held_slots_fused(**arguments(case, "cpu"))


def window_scores_calls(gen: torch.Generator):
    """Batched window scores of one head shape: batch sizes, lengths and ragged held sets vary."""
    from vllm_evict.kernels.window_scores import window_scores_batched

    B, n = int(torch.randint(1, 4, (), generator=gen)), int(torch.randint(8, 300, (), generator=gen))
    q = torch.randn(B, 8, 4, 16, generator=gen)
    keys, values = torch.randn(2, B, n, 2, 16, generator=gen)
    ragged = bool(torch.rand((), generator=gen) < 0.5)
    lengths = torch.randint(1, n + 1, (B, 2), generator=gen) if ragged else None
    for policy in ("dropkv", "snapkv"):
        yield (policy, ragged), lambda policy=policy: window_scores_batched(policy, q, keys, values, lengths=lengths)


CALLS = {"adakv_pages": adakv_pages_calls, "compaction_slots": compaction_slots_calls,
         "held_slots": held_slots_calls, "window_scores": window_scores_calls}


def check(device: str, seed: int) -> None:
    assert device == "cpu", "the variants are taken from the interpreter's launches"
    launches = record_variants()
    gen = torch.Generator().manual_seed(seed)
    for name, calls in CALLS.items():
        variants = defaultdict(set)  # (kernel, model key) -> specialisations
        for _ in range(6 if name == "window_scores" else 12):
            for key, call in calls(gen):
                launches.clear()
                call()
                assert launches, f"{name}: no kernel launched"
                for kernel, specs in launches.items():
                    variants[kernel, key].update(specs)
        for (kernel, key), specs in variants.items():
            assert len(specs) == 1, f"seed {seed}: {kernel} compiles {len(specs)} variants for one model ({key}): " \
                                    + "; ".join(str(s) for s in specs)


def test_one_compiled_variant_per_model():
    pytest.importorskip("triton")
    check_in_interpreter("tests.kernels.test_compiled_variants", seeds=2)
