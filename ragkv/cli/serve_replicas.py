"""`ragkv serve --replicas N`: the server as N engine replicas on Ray Serve, behind its HTTP proxy and the
cache-aware router (serve/replicas/, docs/deployment.md). Without --ray-address a local Ray starts and stops with
this command."""

from __future__ import annotations

import logging
import os
import signal
import threading
from functools import partial

from ragkv.errors import InvalidRequestError
from ragkv.net import is_loopback

log = logging.getLogger("ragkv.serve")
PASSED_ENV = ("RAGKV_", "HF_", "TRANSFORMERS_")  # settings every replica must see as this process does
# "0": Ray's single-machine mode (its default on macOS and Windows): the node's address is 127.0.0.1, so GCS, raylet,
# workers, agents and metrics listen on loopback only; read when ray is imported
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def exposure_warning(host: str, port: int, ray_address: str | None, token_auth: bool) -> str | None:
    """What `--replicas` exposes beyond loopback and how to protect it, or None when nothing is."""
    protect = ("start that cluster with RAY_AUTH_MODE=token (Ray's token authentication: `ray get-auth-token "
               "--generate`) and keep it on a private network" if token_auth else
               "this Ray has no authentication: keep the cluster on a private network or behind a firewall")
    if ray_address:
        return (f"--ray-address {ray_address}: the cluster's GCS, raylets and workers listen where its nodes were "
                f"started, and Ray runs code for whoever reaches them: {protect}")
    if is_loopback(host):
        return None
    return (f"--host {host}: Ray Serve's HTTP proxy listens on {host}:{port} (ragkv's API under --api-key, and "
            "Serve's own /-/routes and /-/healthz with no key); the local Ray cluster's ports stay on 127.0.0.1. "
            "Pass --api-key and keep the port on a private network or behind a firewall")


def run_replicas(args, build_server) -> int:
    """`build_server(args, worker_thread, keys)`: cli/serve.py's, passed in (it imports this module)."""
    if not args.ray_address:
        os.environ.setdefault(LOCAL_ONLY_ENV, "0")  # inherited by every process the local Ray starts
    try:
        import ray
        from ray import serve
    except ImportError:
        raise InvalidRequestError("--replicas and --ray-address need Ray Serve: pip install 'ragkv[replicas]' "
                                  "(or bash scripts/setup.sh --for-tests)") from None
    from ragkv.serve.auth import ApiKeys
    from ragkv.net import listening_socket
    from ragkv.serve.replicas.deployment import build_app

    try:  # a port in use fails now, not after Ray and the models start
        listening_socket(args.host, args.port).close()
    except OSError as e:
        raise InvalidRequestError(e.strerror) from None
    keys = ApiKeys.parse(args.api_key, args.api_keys)  # read here: the replicas' machines may not have the file

    env = {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV)}
    env["OMP_NUM_THREADS"] = str(args.replica_threads)
    init = dict(include_dashboard=False, logging_level=logging.WARNING, runtime_env={"env_vars": env})
    if args.ray_address:
        ray.init(address=args.ray_address, **init)
    else:
        cpus = os.cpu_count() or 1
        need = args.replicas * args.replica_threads
        if need > cpus:
            log.warning("%d replicas x %d threads need %d CPUs; this machine has %d: they will share them",
                        args.replicas, args.replica_threads, need, cpus)
        ray.init(num_cpus=max(cpus, need), object_store_memory=256 << 20, **init)
        if not is_loopback(ray.util.get_node_ip_address()):  # ray was imported before the variable was set
            log.warning("the local Ray cluster listens on %s, not on loopback", ray.util.get_node_ip_address())
    warning = exposure_warning(args.host, args.port, args.ray_address, token_auth_available())
    if warning:
        log.warning("%s", warning)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port, "keep_alive_timeout_s": args.keep_alive})
        make_server = partial(build_server, args, worker_thread=True, keys=keys)
        app = build_app(make_server, args.replicas, args.replica_threads, args.router, args.affinity_slack,
                        args.max_batch + args.max_queue, args.metrics_need_key)
        serve.run(app, name="ragkv", route_prefix="/")  # returns once every replica has loaded its model
        print(f"ragkv: serving {args.model} on http://{args.host}:{args.port}/v1 with {args.replicas} replica(s) "
              f"on Ray Serve, router {args.router}", flush=True)
        while not stop.wait(1):  # signals arrive between waits
            pass
    finally:
        serve.shutdown()  # each replica flushes its store's write-back as it stops
        ray.shutdown()
    return 0


def token_auth_available() -> bool:
    """Whether the installed Ray has token authentication (RAY_AUTH_MODE=token)."""
    import importlib.util

    return importlib.util.find_spec("ray._private.authentication") is not None
