"""`ragkv serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

from ragkv.cli.common import add_fusion_args, add_index_arg, add_model_args, add_store_args, engine_from_args, fusion_from_args


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, documents, metrics)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_index_arg(p)
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a request may wait and run")
    p.add_argument("--max-batch", type=int, default=16,
                   help="generations decoded together in one batched step (continuous batching)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="while other answers decode, a full/prefix prefill runs this many tokens between two "
                        "decode steps (bounds the pause a new request imposes on them)")
    add_fusion_args(p, title="fusion defaults (for requests with documents; a request's own `ragkv` fields win)")
    add_model_args(p)
    add_store_args(p)
    p.set_defaults(func=run_serve)


def run_serve(args) -> int:
    import signal
    import threading

    import uvicorn

    from ragkv.errors import InvalidRequestError
    from ragkv.serve.app import Server, create_app

    fusion = fusion_from_args(args)  # fail fast on a bad default
    if args.max_batch < 1 or args.prefill_chunk < 1:
        raise InvalidRequestError(f"--max-batch and --prefill-chunk must be >= 1, got {args.max_batch} and "
                                  f"{args.prefill_chunk}")
    engine = engine_from_args(args)
    server = Server(engine, args.model, args.index, args.max_queue, args.timeout, fusion,
                    args.max_batch, args.prefill_chunk, worker_thread=False)
    # HTTP on a thread, the model on the main thread: OpenMP kernels launched from another thread ran 40%
    # slower (decode 39 vs 64 tokens/s, measured).
    http = uvicorn.Server(uvicorn.Config(create_app(server), host=args.host, port=args.port, log_level="warning"))
    web = threading.Thread(target=http.run, name="ragkv-http", daemon=True)

    def stop(signum, frame):
        http.should_exit = True
        server.scheduler.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    web.start()
    # the loading controller's profile (tier bandwidths, recompute cost): measured once, in the background, as
    # the worker's first job, never inside a request; later starts read the saved one
    server.scheduler.submit(lambda job: _profile(engine))
    print(f"ragkv: serving {args.model} ({engine.dtype_name}) on http://{args.host}:{args.port}/v1", flush=True)
    server.scheduler.serve_forever()
    web.join(timeout=10)
    return 0


def _profile(engine) -> None:
    import logging

    try:
        engine.profile_store()
    except Exception as e:  # no profile only means blend runs at its r_min: say so, keep serving
        logging.getLogger("ragkv.serve").warning("could not profile the store (%s); blend runs without a "
                                                 "loading plan until `ragkv store profile` succeeds", e)
