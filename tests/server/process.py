"""A real `vllm-evict serve` (vLLM's OpenAI API server with the plugin) in a subprocess of its own process
group, CPU-friendly flags; the tiny model unless told otherwise. Every `vllm serve` flag can be passed in
`extra_args`. Used by the server tests (one server per module) and the deploy tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TINY_MODEL = "tiny-llama"
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_EVICT_SERVER_STARTUP_TIMEOUT", "900"))

# small engine: 64 MiB of KV cache is ~1.3k blocks of 16 tokens for the tiny model
SERVER_ENGINE_FLAGS = [
    "--enforce-eager", "--max-model-len", "4096", "--block-size", "16", "--kv-cache-memory-bytes", str(64 << 20),
    "--max-num-seqs", "16", "--seed", "0",
]


@dataclass
class ServerProcess:
    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    api_key: str | None

    def log_tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_dir: Path, *, model: str | None = TINY_MODEL, api_key: str | None = None,
                 extra_args: list[str] | None = None) -> ServerProcess:
    """`python -m vllm_evict.cli serve [model]` with the small-engine flags, healthy. model=None: no MODEL
    argument (the server's own default model)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_evict.cli", "serve"] + ([model] if model else [])
    cmd += ["--host", "127.0.0.1", "--port", str(port), *SERVER_ENGINE_FLAGS, *(extra_args or [])]
    if api_key:
        cmd += ["--api-key", api_key]
    return launch(cmd, port, log_dir, api_key=api_key)


def launch(cmd: list[str], port: int, log_dir: Path, *, api_key: str | None = None,
           env: dict[str, str] | None = None) -> ServerProcess:
    """Run a server command in its own session (log in log_dir/server.log) and wait until /health answers
    200; RuntimeError with the log's tail if it exits or stays unhealthy. Only the environment given
    here sets an API key or eviction defaults."""
    import httpx

    log_path = log_dir / "server.log"
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("VLLM_API_KEY", "VLLM_EVICT_API_KEY", "VLLM_EVICT_DEFAULT")}
    full_env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    full_env.update(env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                                cwd=str(Path(__file__).resolve().parents[2]))
    server = ServerProcess(url=f"http://127.0.0.1:{port}", port=port, proc=proc, log_path=log_path,
                           api_key=api_key)
    deadline = time.time() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during startup:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            stop_server(server)
            raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S:.0f}s:\n{server.log_tail()}")
        time.sleep(1.0)


def stop_server(server: ServerProcess, timeout: float = 60.0) -> None:
    """SIGINT the server's process group (uvicorn + vLLM engine core + workers), SIGKILL if it lingers."""
    proc = server.proc
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:  # engine processes left in the group (only ours: the group was created for this server)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(10)


