"""vllm_evict.engine.host_gc: the engine's processes raise CPython's full-collection threshold (threshold2), as
VLLM_EVICT_GC_THRESHOLD2 says; a bad value is a clear error. (The engine's own processes: test_evict_again.)"""

from __future__ import annotations

import gc

import pytest

from vllm_evict.engine.host_gc import ENV, THRESHOLD2, relax_full_collections


@pytest.fixture
def python_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_default_raises_only_the_full_collection_threshold(python_thresholds, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    relax_full_collections()
    assert gc.get_threshold() == (700, 10, THRESHOLD2)


@pytest.mark.parametrize("value, expected", [("0", 10), ("5", 5), ("250", 250)])
def test_the_variable_sets_it_and_zero_leaves_python_s(python_thresholds, monkeypatch, value, expected):
    monkeypatch.setenv(ENV, value)
    relax_full_collections()
    assert gc.get_threshold() == (700, 10, expected)


@pytest.mark.parametrize("value", ["ten", "1.5", "-1"])
def test_a_bad_value_is_a_clear_error_that_changes_nothing(python_thresholds, monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=ENV):
        relax_full_collections()
    assert gc.get_threshold() == (700, 10, 10)
