"""Redis Cluster tier: the Redis tier's entries spread over the masters of a cluster, each kept by its replicas.

Everything but the client and the key names is the single-node RedisStore. A key is `prefix{digest}`: the hash
tag `{digest}` decides the slot, so one block's layers (and anything a later format stores beside them under the
same tag) live on one node and one pipelined GETRANGE per layer reads them. redis-py's RedisCluster follows
MOVED/ASK redirections while a slot migrates and refreshes the slot map after a failover; what it cannot hide
(a master down before its replica is promoted, CLUSTERDOWN, an uncovered slot) is a miss, so TieredStore counts
a fault, backs off, and requests compute the blocks instead.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.retry import Retry

from ragkv.store.base import CacheKey, check_namespace, storage_name
from ragkv.store.errors import StoreUnavailableError
from ragkv.store.redis_store import RedisStore, _glob_escape, redact

CLUSTER_RETRIES = 2  # per command, after a redirection or a topology refresh; beyond it the call is a miss


def seed_nodes(url: str) -> list[tuple[str, int]]:
    """(host, port) of every seed node of redis+cluster://[auth@]HOST:PORT[,HOST:PORT...][?options]."""
    hosts = urlsplit(url).netloc.rpartition("@")[2]
    out = []
    for node in hosts.split(","):
        host, _, port = node.rpartition(":")
        out.append((host.strip("[]"), int(port)))
    return out


def cluster_client(url: str, timeout_s: float) -> RedisCluster:
    """A RedisCluster for a redis+cluster:// URL: credentials, TLS and redis-py options as a single node's URL."""
    parts = urlsplit(url)
    auth, at, hosts = parts.netloc.rpartition("@")
    single = f"{parts.scheme.split('+')[0]}://{auth}{at}{hosts.split(',')[0]}/0"  # parsed as redis-py parses it
    options = parse_url(single + (f"?{parts.query}" if parts.query else ""))
    for name in ("host", "port", "db"):
        options.pop(name, None)
    if options.pop("connection_class", None) is redis.SSLConnection:
        options["ssl"] = True
    options.setdefault("socket_connect_timeout", timeout_s)
    options.setdefault("socket_timeout", timeout_s)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seed_nodes(url)],
                        retry=Retry(NoBackoff(), CLUSTER_RETRIES), **options)


class RedisClusterStore(RedisStore):
    """Blocks in a Redis Cluster (see RedisStore for the arguments; `url` is redis+cluster://HOST:PORT,...).

    Raises:
        StoreUnavailableError: no seed node answers, or the cluster does not cover every slot (with must_reach).
    """

    # SlotNotCoveredError and the client's other topology errors are not RedisErrors
    ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)

    def _connect(self, url: str, timeout_s: float):
        return cluster_client(url, timeout_s)  # raises RedisClusterException while no seed node answers

    def _unreachable(self, e: Exception) -> StoreUnavailableError:
        if isinstance(e, redis.exceptions.RedisClusterException):
            return StoreUnavailableError(
                f"cannot use the Redis Cluster at {redact(self.url)} ({e}); check that the seed nodes run with "
                "cluster-enabled yes and that every slot is assigned (redis-cli --cluster check HOST:PORT)")
        return super()._unreachable(e)

    def _name(self, key: CacheKey) -> str:
        return f"{self.prefix}{{{storage_name(key)}}}"

    def _names(self, namespace: str | None = None) -> list[str]:
        body = "{" + (check_namespace(namespace) + "-*" if namespace else "*")
        return [n.decode() for n in self.client.scan_iter(match=_glob_escape(self.prefix) + body, count=1000)]

    def entries(self) -> list[tuple[str, int]]:
        return [(name.strip("{}"), size) for name, size in super().entries()]

