"""EvictionConfig: from_dict / from_flat validation and round trips, derived values."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_evict.policies import POLICIES, EvictionConfig


def test_defaults():
    cfg = EvictionConfig.from_dict({"policy": "snapkv", "budget": 0.1})
    assert cfg == EvictionConfig(policy="snapkv", budget=0.1)
    assert (cfg.allocation, cfg.window, cfg.pool_kernel, cfg.sink, cfg.gqa, cfg.alpha, cfg.caote_base, cfg.chunked) == (
        "uniform", None, None, None, "mean", 0.2, "snapkv", False,
    )
    assert dataclasses.is_dataclass(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget = 0.2  # type: ignore[misc]


def test_none_policy_means_no_eviction():
    assert EvictionConfig.from_dict({"policy": "none"}) is None
    assert EvictionConfig.from_dict({"policy": "none", "budget": 0.5}) is None
    assert EvictionConfig.from_flat({}) is None
    assert EvictionConfig.from_flat(None) is None
    assert EvictionConfig.from_flat({"other_plugin": 1}) is None
    assert EvictionConfig.from_flat({"eviction_policy": "none", "eviction_budget": "0.1"}) is None


@pytest.mark.parametrize("policy", list(POLICIES))
def test_round_trip_every_policy(policy):
    d = {"policy": policy, "budget": 2048, "allocation": "adakv", "sink": 2, "gqa": "max", "alpha": 0.3}
    cfg = EvictionConfig.from_dict(d)
    assert EvictionConfig.from_dict(cfg.to_dict()) == cfg
    assert EvictionConfig.from_flat(cfg.to_flat()) == cfg
    flat_str = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in cfg.to_flat().items()}
    assert EvictionConfig.from_flat(flat_str) == cfg


def test_round_trip_all_fields():
    cfg = EvictionConfig(policy="keydiff", budget=0.25, window=16, pool_kernel=3, sink=4, chunked=True)
    assert cfg.to_dict() == {
        "policy": "keydiff", "budget": 0.25, "allocation": "uniform", "window": 16, "pool_kernel": 3, "sink": 4,
        "gqa": "mean", "alpha": 0.2, "caote_base": "snapkv", "chunked": True,
    }
    assert EvictionConfig.from_dict(cfg.to_dict()) == cfg
    assert EvictionConfig.from_flat(cfg.to_flat()) == cfg


def test_from_flat_parses_strings():
    cfg = EvictionConfig.from_flat(
        {"eviction_policy": "caote", "eviction_budget": "0.1", "eviction_allocation": "adakv",
         "eviction_window": "16", "eviction_pool_kernel": 5, "eviction_caote_base": "dropkv",
         "eviction_alpha": "0.5", "unrelated": "x"}
    )
    assert cfg == EvictionConfig(policy="caote", budget=0.1, allocation="adakv", window=16, pool_kernel=5,
                                 caote_base="dropkv", alpha=0.5)
    assert EvictionConfig.from_flat({"eviction_policy": "snapkv", "eviction_budget": "2048"}).budget == 2048
    one = EvictionConfig.from_flat({"eviction_policy": "snapkv", "eviction_budget": "1"}).budget
    assert one == 1 and isinstance(one, int)
    full = EvictionConfig.from_flat({"eviction_policy": "snapkv", "eviction_budget": "1.0"}).budget
    assert full == 1.0 and isinstance(full, float)
    for raw, want in [(1, True), (0, False), ("1", True), ("0", False), ("true", True), ("False", False), (True, True)]:
        d = {"eviction_policy": "keydiff", "eviction_budget": 64, "eviction_chunked": raw}
        assert EvictionConfig.from_flat(d).chunked is want


@pytest.mark.parametrize(
    "flat, needle",
    [
        ({"eviction_budget": "0.1", "eviction_policy": "snapkv", "eviction_colour": "red"}, "eviction_colour"),
        ({"eviction_policy": "snapkv", "eviction_budget": "lots"}, "lots"),
        ({"eviction_policy": "keydiff", "eviction_budget": 8, "eviction_chunked": 2}, "2"),
        ({"eviction_policy": "keydiff", "eviction_budget": 8, "eviction_chunked": "maybe"}, "maybe"),
        ({"eviction_policy": "snapkv", "eviction_budget": "1.5"}, "1.5"),
        ({"eviction_policy": "snapkv"}, "budget"),
    ],
)
def test_from_flat_errors(flat, needle):
    with pytest.raises(ValueError) as err:
        EvictionConfig.from_flat(flat)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "d, field, value",
    [
        ({"policy": "snapkvv", "budget": 0.1}, "policy", "snapkvv"),
        ({"budget": 0.1}, "policy", ""),
        ({"policy": "snapkv"}, "budget", ""),
        ({"policy": "snapkv", "budget": 0}, "budget", "0"),
        ({"policy": "snapkv", "budget": -5}, "budget", "-5"),
        ({"policy": "snapkv", "budget": 0.0}, "budget", "0.0"),
        ({"policy": "snapkv", "budget": 1.2}, "budget", "1.2"),
        ({"policy": "snapkv", "budget": True}, "budget", "True"),
        ({"policy": "snapkv", "budget": "0.1"}, "budget", "'0.1'"),
        ({"policy": "snapkv", "budget": [1]}, "budget", "[1]"),
        ({"policy": "snapkv", "budget": 0.1, "pool_kernel": 4}, "pool_kernel", "4"),
        ({"policy": "snapkv", "budget": 0.1, "pool_kernel": 0}, "pool_kernel", "0"),
        ({"policy": "snapkv", "budget": 0.1, "pool_kernel": -3}, "pool_kernel", "-3"),
        ({"policy": "snapkv", "budget": 0.1, "pool_kernel": 3.0}, "pool_kernel", "3.0"),
        ({"policy": "snapkv", "budget": 0.1, "window": -1}, "window", "-1"),
        ({"policy": "snapkv", "budget": 0.1, "window": 0}, "window", "0"),
        ({"policy": "snapkv", "budget": 0.1, "window": True}, "window", "True"),
        ({"policy": "snapkv", "budget": 0.1, "sink": -4}, "sink", "-4"),
        ({"policy": "snapkv", "budget": 0.1, "allocation": "pyramid"}, "allocation", "pyramid"),
        ({"policy": "snapkv", "budget": 0.1, "gqa": "sum"}, "gqa", "sum"),
        ({"policy": "snapkv", "budget": 0.1, "alpha": 1.5}, "alpha", "1.5"),
        ({"policy": "snapkv", "budget": 0.1, "alpha": -0.2}, "alpha", "-0.2"),
        ({"policy": "random", "budget": 0.1, "seed": 1.5}, "seed", "1.5"),
        ({"policy": "keydiff", "budget": 0.1, "chunked": "yes"}, "chunked", "yes"),
        ({"policy": "caote", "budget": 0.1, "caote_base": "keydiff"}, "caote_base", "keydiff"),
        ({"policy": "caote", "budget": 0.1, "caote_base": "knorm"}, "caote_base", "knorm"),
        ({"policy": "caote", "budget": 0.1, "caote_base": "streaming"}, "caote_base", "streaming"),
        ({"policy": "caote", "budget": 0.1, "caote_base": "caote"}, "caote_base", "caote"),
        ({"policy": "caote", "budget": 0.1, "caote_base": "fastcaote"}, "caote_base", "fastcaote"),
        ({"policy": "caote", "budget": 0.1, "caote_base": "magic"}, "caote_base", "magic"),
        ({"policy": "snapkv", "budget": 0.1, "compression_ratio": 0.5}, "compression_ratio", ""),
    ],
)
def test_from_dict_errors(d, field, value):
    with pytest.raises(ValueError) as err:
        EvictionConfig.from_dict(d)
    assert field in str(err.value) and value in str(err.value)


def test_from_dict_accepts_valid_edge_values():
    assert EvictionConfig.from_dict({"policy": "snapkv", "budget": 1}).budget == 1
    assert EvictionConfig.from_dict({"policy": "snapkv", "budget": 1.0}).budget == 1.0
    assert EvictionConfig.from_dict({"policy": "keydiff", "budget": 16, "window": 0}).window == 0
    assert EvictionConfig.from_dict({"policy": "keydiff", "budget": 16, "chunked": True}).chunked
    # DESIGN.md §4.8: block-wise eviction for every policy (uniform allocation in this version)
    assert all(EvictionConfig.from_dict({"policy": p, "budget": 16, "chunked": True}).chunked for p in POLICIES)
    assert EvictionConfig.from_dict({"policy": "random", "budget": 16, "seed": -3}).seed == -3
    assert EvictionConfig.from_dict({"policy": "snapkv", "budget": 0.5, "alpha": 0}).alpha == 0.0
    assert EvictionConfig.from_dict({"policy": "snapkv", "budget": 0.5, "pool_kernel": 1}).pool_kernel == 1
    # streaming ignores adakv (DESIGN.md §3.4): stored as uniform
    assert EvictionConfig.from_dict({"policy": "streaming", "budget": 64, "allocation": "adakv"}).allocation == "uniform"
    with pytest.raises(ValueError):
        EvictionConfig(policy="snapkv", budget=2.0)  # direct construction is validated too


@pytest.mark.parametrize(
    "d, w, queries, kappa, sink",
    [
        ({"policy": "snapkv"}, 32, True, 7, 0),
        ({"policy": "dropkv"}, 8, True, 11, 0),
        ({"policy": "obcache-joint"}, 32, True, 7, 0),
        ({"policy": "tova"}, 1, True, 1, 0),
        ({"policy": "h2o"}, 32, True, 1, 0),
        ({"policy": "keydiff"}, 0, False, 1, 0),
        ({"policy": "knorm"}, 0, False, 1, 0),
        ({"policy": "streaming"}, 0, False, 1, 4),
        ({"policy": "keydiff", "window": 64}, 64, False, 1, 0),
        ({"policy": "caote"}, 32, True, 7, 0),
        ({"policy": "fastcaote", "caote_base": "dropkv"}, 8, True, 11, 0),
        ({"policy": "caote", "caote_base": "tova", "window": 4, "pool_kernel": 3, "sink": 2}, 4, True, 3, 2),
    ],
)
def test_derived_values(d, w, queries, kappa, sink):
    cfg = EvictionConfig.from_dict({**d, "budget": 0.5})
    assert cfg.window_size() == w
    assert cfg.needs_queries() is queries
    assert cfg.pool_kernel_size() == kappa
    assert cfg.sink_size() == sink
    assert cfg.protected_count(1000) == w + sink
    assert cfg.protected_count(3) == min(3, w + sink)


def test_protected_count_overlap_and_num_pages():
    cfg = EvictionConfig(policy="snapkv", budget=0.1, sink=4)
    assert cfg.protected_count(100) == 36
    assert cfg.protected_count(34) == 34  # sink and window overlap
    assert cfg.num_pages(1000) == 7  # b_tok = 100 -> 7 pages; p_min = ceil(36/16) = 3
    assert cfg.num_pages(30) is None
    assert EvictionConfig(policy="snapkv", budget=1).num_pages(1000) == 2  # raised to cover the 32-token window
    assert EvictionConfig(policy="keydiff", budget=1).num_pages(1000) == 1
    assert EvictionConfig(policy="keydiff", budget=1.0).num_pages(1000) is None


def test_score_and_select_options():
    cfg = EvictionConfig(policy="caote", budget=0.2, caote_base="dropkv", gqa="max", sink=1, allocation="adakv", alpha=0.1)
    assert cfg.score_options() == {"gqa": "max", "window": 8, "sink": 1, "caote_base": "dropkv"}
    assert cfg.select_options() == {"allocation": "adakv", "alpha": 0.1}
    assert EvictionConfig(policy="knorm", budget=0.2).score_options() == {"gqa": "mean"}
