"""A real redis-server for the store tests: started on a free port in a temp dir, killed afterwards.

Import the fixtures into a test module (`from redis_fixture import redis_server, redis_url  # noqa: F401`).
Tests using them are skipped, with the reason, only when no redis-server binary is installed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """URL of a private redis-server (no persistence) for the whole session."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed; run scripts/install_redis.sh (apt-get install redis-server)")
    workdir = tmp_path_factory.mktemp("redis")
    port = free_port()
    log = workdir / "redis.log"
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--logfile", str(log), "--daemonize", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                text = log.read_text() if log.exists() else ""
                pytest.fail(f"redis-server did not start on port {port}: {text[-2000:]}")
            time.sleep(0.02)
    client.close()
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def redis_url(redis_server):
    """The session's Redis, emptied before the test."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server
