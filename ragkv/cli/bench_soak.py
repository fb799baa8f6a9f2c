"""`ragkv bench` for the server's robustness: soak (clients, faults, abuse), fuzz, shadow, fairness. Flags ->
each benchmark's config (ragkv.bench.*)."""


from __future__ import annotations

from pathlib import Path

from ragkv.cli.bench_replicas import (add_replica_soak_args, run_replica_soak_bench)
from ragkv.cli.common import (MODEL_HELP, mode_list, add_model_args, add_output_args, finish_bench, say)
from ragkv.settings import DEFAULT_MODEL






def register(bsub) -> None:
    for add in (_add_fuzz, _add_shadow, _add_fairness, _add_soak):
        add(bsub)


def _add_fuzz(bsub) -> None:
    fz = bsub.add_parser("fuzz", help="property-based requests from the server's own OpenAPI document "
                                      "(schemathesis): counts per status, every 5xx listed")
    fz.add_argument("--examples", type=int, default=500, help="generated requests per route")
    fz.add_argument("--url", default=None, help="a running server (default: start one here)")
    fz.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    fz.add_argument("--new-draw", action="store_true", help="a new random draw (default: seeded, repeatable)")
    add_output_args(fz)
    fz.set_defaults(func=run_fuzz)


def _add_shadow(bsub) -> None:
    sv = bsub.add_parser("shadow", help="what shadow verification costs live traffic: TTFT and req/s under load with "
                                        "--shadow-fraction F against 0, servers started here in alternating order")
    sv.add_argument("--mode", default="blend:sel=query,r=0.15", help="the requests' mode (approximate: checked)")
    sv.add_argument("--fraction", type=float, default=0.05, help="the checked server's --shadow-fraction")
    sv.add_argument("--concurrency", type=int, default=16, help="closed-loop clients")
    sv.add_argument("--requests", type=int, default=64, help="requests per run")
    sv.add_argument("--rounds", type=int, default=2, help="rounds of (without, with), the order flipped each round")
    sv.add_argument("--max-tokens", type=int, default=32)
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    sv.add_argument("--dtype", default="float32")
    add_output_args(sv)
    sv.set_defaults(func=run_shadow)


def _add_fairness(bsub) -> None:
    fa = bsub.add_parser("fairness", help="another tenant's TTFT while one tenant's long request (ape over many "
                                          "documents) runs, against a `ragkv serve` started here")
    fa.add_argument("--mode", default="ape", help="the long request's mode")
    fa.add_argument("--docs", type=int, default=8, help="documents of the long request")
    fa.add_argument("--words", type=int, default=1500, help="words per document (about one token each)")
    fa.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for the started server, repeatable")
    add_output_args(fa)
    fa.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    fa.add_argument("--dtype", default="float32")
    fa.set_defaults(func=run_fairness)


def _add_soak(bsub) -> None:
    k = bsub.add_parser("soak", help="N clients for M minutes against `ragkv serve` (two tenants, memory+disk+Redis "
                                     "store) while faults are injected: crashes, 5xx, lost documents, cross-tenant "
                                     "reads, changed greedy answers")
    k.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    k.add_argument("--minutes", type=float, default=3.0, help="minutes of load with faults (after --calm)")
    k.add_argument("--calm", type=float, default=20.0, help="seconds of load without faults first")
    k.add_argument("--fault-interval", type=float, default=10.0, help="mean seconds between two faults")
    k.add_argument("--seed", type=int, default=0, help="seeds the workload, the clients and the fault injector")
    k.add_argument("--modes", default="reuse,blend,full", help="modes the clients use, comma-separated")
    k.add_argument("--max-tokens", type=int, default=16, help="answer length limit (greedy)")
    k.add_argument("--memory", default="48MiB", help="memory tier of the server's store (small: blocks fall "
                   "through to disk and Redis)")
    k.add_argument("--disk-size", default="512MiB", help="disk tier capacity")
    k.add_argument("--request-timeout", type=float, default=180.0, help="client-side seconds per request")
    k.add_argument("--max-requests", type=int, default=20_000, help="requests of all clients together, at most")
    k.add_argument("--work-dir", default=None, help="server cache folder, Redis folder and logs (default: "
                   "OUTPUT_DIR/soak-work; cleared at the start, its KV files removed at the end)")
    k.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
    k.add_argument("--kv-memory", default="2GiB", help="the server's --kv-memory (`default`: not passed)")
    ab = k.add_argument_group("abuse phase (after the faults; RSS watched; all counts 0: none)")
    ab.add_argument("--abuse-only", action="store_true", help="set up, then run the abuse phase only")
    ab.add_argument("--abuse-clients", type=int, default=8)
    ab.add_argument("--abuse-streams", type=int, default=200, help="streams closed after a few events")
    ab.add_argument("--abuse-n", type=int, default=8, help="choices per abandoned stream")
    ab.add_argument("--abuse-max-tokens", type=int, default=2000, help="max_tokens of an abandoned stream")
    ab.add_argument("--abuse-read-events", type=int, default=3, help="events read before closing")
    ab.add_argument("--abuse-salts", type=int, default=40, help="requests with a cache_salt of their own")
    ab.add_argument("--abuse-long-words", type=int, default=4, help="requests whose document is one long word")
    ab.add_argument("--abuse-word-chars", type=int, default=6000, help="letters of that word")
    ab.add_argument("--abuse-documents", type=int, default=6,
                    help="requests with the most inline documents the server accepts (every other one: one more)")
    ab.add_argument("--abuse-contracts", type=int, default=10,
                    help="requests of each kind whose reply has a contract (a forced call, a constrained answer, "
                         "refused schemas and tool messages); a broken one is counted")
    ab.add_argument("--abuse-seconds", type=float, default=600.0, help="the phase stops sending after this long")
    ab.add_argument("--rss-slack", default="1GiB", help="RSS may rise by memory tier + KV limit + this")
    ab.add_argument("--rss-return-pct", type=float, default=10.0, help="RSS must come back within this %% of its "
                    "pre-phase level ...")
    ab.add_argument("--rss-return-s", type=float, default=30.0, help="... within this many seconds")
    ho = k.add_argument_group("hostile traffic during the faults (0: none)")
    ho.add_argument("--fuzz-clients", type=int, default=0, help="threads fuzzing the API from its OpenAPI schema")
    ho.add_argument("--fuzz-examples", type=int, default=25, help="generated requests per route and round")
    ho.add_argument("--long-ape-every", type=float, default=0.0, help="seconds between two long `ape` requests")
    ho.add_argument("--long-ape-documents", type=int, default=8, help="documents of a long `ape` request")
    ho.add_argument("--long-ape-words", type=int, default=1000, help="words per document (random letters, ~3.6 "
                    "tokens a word: 8 x 1000 is ~29K tokens)")
    add_output_args(k)
    add_model_args(k, decode_weights=False)
    add_replica_soak_args(k)
    k.set_defaults(func=run_soak)


def run_fuzz(args) -> int:
    from ragkv.bench.fuzz import FuzzConfig, run_fuzz_bench

    cfg = FuzzConfig(examples=args.examples, url=args.url, model=args.model, seed=None if args.new_draw else 0)
    result = run_fuzz_bench(cfg, Path(args.output_dir), say)
    finish_bench(args, result, "fuzz.md")
    return 1 if result["failures"] else 0


def run_shadow(args) -> int:
    from ragkv.bench.shadow_cost import ShadowBenchConfig, run_shadow_bench

    cfg = ShadowBenchConfig(model=args.model, dtype=args.dtype, mode=args.mode, fraction=args.fraction,
                            concurrency=args.concurrency, requests=args.requests, rounds=args.rounds,
                            max_tokens=args.max_tokens, seed=args.seed)
    return finish_bench(args, run_shadow_bench(cfg, Path(args.output_dir), say), "shadow_bench.md")


def run_fairness(args) -> int:
    from ragkv.bench.fairness import FairnessConfig, run_fairness_bench

    cfg = FairnessConfig(model=args.model, dtype=args.dtype, mode=args.mode, docs=args.docs, words=args.words,
                         server_args=tuple(args.server_arg))
    return finish_bench(args, run_fairness_bench(cfg, Path(args.output_dir), say), "fairness.md")


def run_soak(args) -> int:
    if args.replicas > 1:
        return run_replica_soak_bench(args)
    from ragkv.bench.soak import SoakConfig, run_soak as run_soak_bench

    cfg = SoakConfig(clients=args.clients, minutes=args.minutes, seed=args.seed, fault_interval_s=args.fault_interval,
                     calm_s=args.calm, model=args.model, dtype=args.dtype, device=args.device,
                     modes=mode_list(args.modes), max_tokens=args.max_tokens, memory=args.memory,
                     disk_size=args.disk_size, request_timeout_s=args.request_timeout,
                     max_requests=args.max_requests, work_dir=args.work_dir, max_batch=args.max_batch,
                     kv_memory=None if args.kv_memory == "default" else args.kv_memory, abuse_only=args.abuse_only,
                     abuse_clients=args.abuse_clients, abuse_streams=args.abuse_streams, abuse_n=args.abuse_n,
                     abuse_max_tokens=args.abuse_max_tokens, abuse_read_events=args.abuse_read_events,
                     abuse_salts=args.abuse_salts, abuse_long_words=args.abuse_long_words,
                     abuse_word_chars=args.abuse_word_chars, abuse_documents=args.abuse_documents,
                     abuse_contracts=args.abuse_contracts,
                     abuse_max_s=args.abuse_seconds, rss_slack=args.rss_slack, rss_return_pct=args.rss_return_pct,
                     rss_return_s=args.rss_return_s, fuzz_clients=args.fuzz_clients,
                     fuzz_examples=args.fuzz_examples, long_ape_every_s=args.long_ape_every,
                     long_ape_documents=args.long_ape_documents, long_ape_words=args.long_ape_words)
    return finish_bench(args, run_soak_bench(cfg, Path(args.output_dir), say), "soak.md")
