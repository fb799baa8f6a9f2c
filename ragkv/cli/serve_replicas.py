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

log = logging.getLogger("ragkv.serve")
PASSED_ENV = ("RAGKV_", "HF_", "TRANSFORMERS_")  # settings every replica must see as this process does


def run_replicas(args, build_server) -> int:
    """`build_server(args, worker_thread, keys)`: cli/serve.py's, passed in (it imports this module)."""
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
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
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
