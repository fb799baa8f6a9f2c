"""A real redis-server for the store tests: started on a free port in a temp dir, killed afterwards.

The fixtures reach every test module through conftest.py (it imports them); `free_port` is re-exported here.
Tests using them are skipped, with the reason, only when no redis-server binary is installed.
"""

from __future__ import annotations

import shutil

import pytest
import redis

from ragkv.net import free_port  # noqa: F401 (re-exported for the test modules)
from ragkv.store.redis_server import INSTALL_HINT, RedisStartError, private_redis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """URL of a private redis-server (no persistence) for the whole session."""
    if shutil.which("redis-server") is None:
        pytest.skip(f"redis-server is not installed; {INSTALL_HINT}")
    try:
        with private_redis(tmp_path_factory.mktemp("redis")) as url:
            yield url
    except RedisStartError as e:
        pytest.fail(str(e))


@pytest.fixture
def redis_url(redis_server):
    """The session's Redis, emptied before the test."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server
