"""POLICIES: name -> policy object (DESIGN.md §6 `policy` names)."""

from __future__ import annotations

from .base import Policy
from .caote import CAOTE, FastCAOTE
from .dropkv import DropKV
from .expected_attention import ExpectedAttention
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import KNorm
from .obcache import OBCacheJoint, OBCacheKey, OBCacheValue
from .random import Random
from .snapkv import SnapKV
from .streaming import Streaming
from .tova import TOVA

POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        SnapKV(), DropKV(), KeyDiff(), OBCacheValue(), OBCacheKey(), OBCacheJoint(),
        CAOTE(), FastCAOTE(), Streaming(), TOVA(), H2O(), KNorm(), Random(), ExpectedAttention(),
    )
}


def get_policy(name: object) -> Policy:
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name]
