import contextlib
import io
import os
import sys

import pytest


@contextlib.contextmanager
def stdout_with_a_file_descriptor():
    """For building an in-process engine: vLLM points file descriptor 1 at /dev/null around gloo's group
    set-up (`suppress_stdout` reads `sys.stdout.fileno()`), which sys-level capture has not got (the
    engine modules' own processes run under pytest-isolated's --capture=tee-sys)."""
    try:
        sys.stdout.fileno()
        usable = sys.stdout
    except (io.UnsupportedOperation, AttributeError, ValueError):
        usable = sys.__stdout__
    with contextlib.redirect_stdout(usable):
        yield


@contextlib.contextmanager
def inprocess_llm(model, **overrides):
    """A plugin-enabled `vllm.LLM` whose engine core runs in this process, so tests can read the
    scheduler's block tables (`llm.llm_engine.engine_core.engine_core.scheduler`)."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_evict.testing.engines import make_llm

    try:
        with stdout_with_a_file_descriptor():
            llm = make_llm(model, **overrides)
        yield llm
        del llm
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


@contextlib.contextmanager
def cpu_workers(workers: int = 2):
    """Environment for an engine with `workers` CPU worker processes (TP=2, PP=2, PP=2 x TP=2) on
    one NUMA node: vLLM binds each worker to a node of its own unless told which cores to use; workers
    beyond the machine's cores share them. vLLM caches its environment after the first engine start in a
    process, so the cache is dropped for the new value to count."""
    import vllm.envs

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(workers)))
        vllm.envs.disable_envs_cache()
        yield
    vllm.envs.disable_envs_cache()
