"""One real `vllm-evict serve` per test module (tests/server/process.py)."""

from __future__ import annotations

import pytest

from tests.server.process import ServerProcess, start_server, stop_server


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    started: list[ServerProcess] = []

    def make(**kwargs) -> ServerProcess:
        server = start_server(tmp_path_factory.mktemp("server"), **kwargs)
        started.append(server)
        return server

    yield make
    for server in started:
        stop_server(server)
