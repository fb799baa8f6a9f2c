"""A real local Redis Cluster (3 masters + 3 replicas of redis-server on free loopback ports) for the session.

Import the fixture into a test module (`from redis_cluster_fixture import redis_cluster  # noqa: F401`). Every
node is killed at the end, whatever happened. Skipped, with the reason, only when redis-server is not installed.
"""

from __future__ import annotations

import shutil

import pytest

from ragkv.store.redis_cluster_server import private_redis_cluster
from ragkv.store.redis_server import INSTALL_HINT, RedisStartError


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A LocalCluster (ragkv.store.redis_cluster_server); its `url` is the store spec's redis+cluster:// form."""
    if shutil.which("redis-server") is None:
        pytest.skip(f"redis-server is not installed; {INSTALL_HINT}")
    try:
        # a small node timeout: a killed master's replica takes over within ~2 s
        with private_redis_cluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=1,
                                   node_timeout_ms=1000) as cluster:
            yield cluster
    except RedisStartError as e:
        pytest.fail(str(e))


def empty(cluster) -> str:
    """Flush every master of the cluster; returns its URL."""
    for node in cluster.masters():
        with node.client() as c:
            c.flushall()
    return cluster.url
