"""Local servers' ports: chosen outside the OS's ephemeral range, and a server whose port was taken before it could
bind is started again on another (Ray's start took the Serve proxy's port once and failed a CI run)."""

from __future__ import annotations

import socket

import httpx

from ragkv import net
from tiny import make_tiny_served


def test_free_ports_are_outside_the_ephemeral_range_and_never_repeat():
    ports = [net.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(net.QUIET_LOW <= p < net._ephemeral_low() for p in ports)


def test_a_server_whose_port_is_taken_starts_again_on_another(tmp_path, monkeypatch):
    from ragkv.bench.serve import ServerProcess, servers

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        chosen = iter([taken.getsockname()[1]])
        monkeypatch.setattr(servers, "free_port", lambda: next(chosen, None) or net.free_port())
        with ServerProcess(model=str(make_tiny_served(tmp_path)), dtype="float32", device="cpu",
                           store="memory:64MiB", startup_s=120, cache_dir=tmp_path) as server:
            assert server.port != taken.getsockname()[1]
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
