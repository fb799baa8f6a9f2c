"""A private redis-server on a free localhost port (no persistence), for benchmarks and tests."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path

from ragkv.errors import RagkvError
from ragkv.net import free_port

INSTALL_HINT = "run scripts/install_redis.sh (apt-get install redis-server)"


class RedisStartError(RagkvError):
    """redis-server is missing or did not answer in time; the message says which."""


@contextlib.contextmanager
def private_redis(workdir: str | Path, timeout_s: float = 10.0):
    """Start redis-server in `workdir`, yield its URL once it answers PING, stop it on exit."""
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisStartError(f"redis-server is not installed; {INSTALL_HINT}")
    port, log = free_port(), Path(workdir) / "redis.log"
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--logfile", str(log), "--daemonize", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        url, deadline = f"redis://127.0.0.1:{port}/0", time.monotonic() + timeout_s
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    text = log.read_text()[-2000:] if log.exists() else ""
                    raise RedisStartError(f"redis-server did not start on port {port}: {text}") from None
                time.sleep(0.02)
        client.close()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
