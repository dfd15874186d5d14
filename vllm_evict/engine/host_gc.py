"""Rarer full garbage collections in the processes that run the engine (its scheduler and its workers).

CPython (3.10-3.13) runs a full collection of its oldest generation after every `threshold2` (10) collections of
the middle one, and a full collection walks every tracked container that vLLM's freeze at engine start did not
cover: above all the token-id lists of every running request (vLLM's Request, the model runner's request state),
item by item. Decoding 256 requests of 4K tokens, that is a stall every ~130 steps growing to 45-100 ms (a step is
20 ms), 1.3-2.3 s of a 96 s run on an H100 (docs/BENCHMARKS.md). The engine's processes raise `threshold2` to
THRESHOLD2: the same collections, an order of magnitude rarer. Python 3.14's incremental collector ignores it.
"""

from __future__ import annotations

import gc
import os

ENV = "VLLM_EVICT_GC_THRESHOLD2"
THRESHOLD2 = 100


def threshold2_setting() -> int:
    """VLLM_EVICT_GC_THRESHOLD2 (default THRESHOLD2; 0: Python's own), or a ValueError naming it."""
    raw = os.environ.get(ENV, str(THRESHOLD2))
    try:
        wanted = int(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a whole number of middle-generation collections (0: Python's own), "
                         f"got {raw!r}") from None
    if wanted < 0:
        raise ValueError(f"{ENV} must be 0 or more, got {wanted}")
    return wanted


def relax_full_collections() -> None:
    """Set this process's threshold2 to threshold2_setting() (0: leave Python's)."""
    wanted = threshold2_setting()
    if wanted:
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, wanted)
