"""The flags of `ragkv bench serve --replicas N` (bench/replicas.py): routers compared on repeating passage sets."""

from __future__ import annotations

from pathlib import Path

from ragkv.cli.common import finish_bench, say


def add_replica_args(v) -> None:
    g = v.add_argument_group("replicas (--replicas N: the single server, then N replicas on Ray Serve per router, on "
                             "a workload of repeating passage sets)")
    g.add_argument("--replicas", type=int, default=1, help="compare routers over this many replicas (>= 2)")
    g.add_argument("--router", default="balance,round-robin", help="routers, comma-separated, run in turn; "
                   "ROUTER:N sets its --affinity-slack (e.g. affinity,home:1,round-robin)")
    g.add_argument("--passage-sets", type=int, default=24, help="distinct passage sets the requests draw from")
    g.add_argument("--zipf", type=float, default=1.0, help="P(set of rank i) ~ 1/i^zipf (0: uniform)")
    g.add_argument("--replica-memory", default="memory:1GiB", help="each server's (each replica's) KV store")
    g.add_argument("--repeats", type=int, default=1, help="rounds over the routers, alternating")
    g.add_argument("--no-single", action="store_true", help="skip the single-server baseline")


def run_replicas_bench(args) -> int:
    from ragkv.bench.replicas import ReplicaBenchConfig, render, run_replica_bench
    from ragkv.cli.common import ints

    cfg = ReplicaBenchConfig(replicas=args.replicas, routers=tuple(r for r in args.router.split(",") if r),
                             sets=args.passage_sets, zipf=args.zipf, requests=args.requests,
                             concurrency=ints(args.concurrency, "--concurrency")[0],
                             passages_per_request=args.passages_per_request, pool_size=args.pool_size,
                             passage_words=args.passage_words, max_tokens=args.max_tokens,
                             memory=args.replica_memory, repeats=args.repeats, single=not args.no_single,
                             seed=args.seed)
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
