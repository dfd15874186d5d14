"""engine/surface.py: the start-up self-check of the vLLM internals the plugin patches.

It passes on the pinned vLLM (checked against the unpatched originals: the plugin may already be
installed in this process), and names every changed or missing symbol when vLLM differs."""

import subprocess
import sys

import pytest

from vllm_evict.engine import surface


@pytest.mark.parametrize("group", sorted(surface.SURFACE))
def test_pinned_vllm_passes(group):
    """In a fresh interpreter: in this one, earlier tests may have installed the hooks already (the check
    runs before them, on vLLM's originals)."""
    code = f"from vllm_evict.engine import surface; surface.check({group!r}); print('checked')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "checked" in res.stdout, res.stderr[-3000:]


def test_changed_and_missing_symbols_are_named(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    def init(self, max_num_reqs, max_num_batched_tokens, pin_memory, device, block_sizes, max_num_blocks,
             kernel_block_sizes=None):  # max_num_blocks moved: worker.block_table_init would double the wrong one
        pass

    monkeypatch.setattr(MultiGroupBlockTable, "__init__", init)
    monkeypatch.delattr(Scheduler, "_preempt_request")
    table = {"engine": {path: shape for path, shape in surface.SURFACE["engine"].items()
                        if "MultiGroupBlockTable" in path or "_preempt_request" in path or "add_request" in path}}
    with pytest.raises(RuntimeError) as err:
        surface.check("engine", table)
    message = str(err.value)
    assert "MultiGroupBlockTable.__init__" in message and "Scheduler._preempt_request: missing" in message
    assert "found    (self, max_num_reqs, max_num_batched_tokens, pin_memory, device, block_sizes, max_num_blocks, " \
           "kernel_block_sizes=)" in message
    assert "Scheduler.add_request" not in message  # unchanged symbols are not reported


def test_shape_of_reads_names_kinds_and_defaults():
    def f(self, a, b=1, *args, c, d=None, **kw):
        pass

    assert surface.shape_of(f) == "self, a, b=, *args, c, d=, **kw"
