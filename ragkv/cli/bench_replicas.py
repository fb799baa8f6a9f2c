"""The flags of `ragkv bench serve --replicas N` (bench/replicas.py): routers compared on repeating passage sets."""

from __future__ import annotations

from pathlib import Path

from ragkv.cli.common import finish_bench, ints, say
from ragkv.cli.config_args import add_config_args, config_from_args


def add_replica_args(v) -> None:
    g = v.add_argument_group("replicas (--replicas N: the single server, then N replicas on Ray Serve per router, on "
                             "a workload of repeating passage sets)")
    g.add_argument("--replicas", type=int, default=1, help="compare routers over this many replicas (>= 2)")
    from ragkv.bench.replicas import ReplicaBenchConfig

    add_config_args(g, ReplicaBenchConfig, only=REPLICA_OWN, flags=REPLICA_FLAG_NAMES, help={
        "routers": "routers, run in turn; ROUTER:N sets its --affinity-slack (e.g. affinity,home:1,round-robin)",
        "sets": "distinct passage sets the requests draw from", "zipf": "P(set of rank i) ~ 1/i^zipf (0: uniform)",
        "memory": "each server's (each replica's) KV store", "repeats": "rounds over the routers, alternating",
        "single": "measure the single-server baseline first"})


# the replica bench's own flags (the workload's come from `bench serve`'s), some named for the group
REPLICA_OWN = ("routers", "sets", "zipf", "memory", "repeats", "single")
REPLICA_FLAG_NAMES = {"routers": "router", "sets": "passage_sets", "memory": "replica_memory"}


def run_replicas_bench(args) -> int:
    from dataclasses import fields

    from ragkv.bench.replicas import ReplicaBenchConfig, render, run_replica_bench

    cfg = config_from_args(ReplicaBenchConfig, args, flags=REPLICA_FLAG_NAMES, skip=tuple(
        f.name for f in fields(ReplicaBenchConfig) if f.name not in REPLICA_OWN), replicas=args.replicas,
        requests=args.requests, concurrency=ints(args.concurrency, "--concurrency")[0],
        passages_per_request=args.passages_per_request, pool_size=args.pool_size, passage_words=args.passage_words,
        max_tokens=args.max_tokens, seed=args.seed)
    result = run_replica_bench(cfg, args.model, args.dtype, Path(args.output_dir), say, tuple(args.server_arg))
    (Path(args.output_dir) / "replicas_bench.md").write_text(render(result))
    return finish_bench(args, result, "replicas_bench.md")


def add_replica_soak_args(k) -> None:
    g = k.add_argument_group("replicas (--replicas N: `ragkv serve --replicas N` under load, replicas killed; the "
                             "other soak flags except --clients, --minutes, --seed, --max-tokens do not apply)")
    g.add_argument("--replicas", type=int, default=1, help="soak this many replicas on Ray Serve (>= 2)")
    g.add_argument("--kills", type=int, default=2, help="replicas killed (SIGKILL), evenly spaced over --minutes")


def run_replica_soak_bench(args) -> int:
    from ragkv.bench.replica_soak import ReplicaSoakConfig, render, run_replica_soak

    cfg = ReplicaSoakConfig(replicas=args.replicas, clients=args.clients, minutes=args.minutes, kills=args.kills,
                            max_tokens=max(args.max_tokens, 2), model=args.model, dtype=args.dtype, seed=args.seed)
    result = run_replica_soak(cfg, Path(args.output_dir), say)
    (Path(args.output_dir) / "replica_soak.md").write_text(render(result))
    return finish_bench(args, result, "replica_soak.md")
