import contextlib
import os


@contextlib.contextmanager
def inprocess_llm(model, **overrides):
    """A plugin-enabled `vllm.LLM` whose engine core runs in this process, so tests can read the
    scheduler's block tables (`llm.llm_engine.engine_core.engine_core.scheduler`)."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_evict.testing.engines import make_llm

    try:
        llm = make_llm(model, **overrides)
        yield llm
        del llm
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
