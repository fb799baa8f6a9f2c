"""`ragkv store stats`, `ragkv store clear` and `ragkv store warm`. ragkv.cli calls `register(subparsers)`; each
command sets `args.func(args) -> int` (exit code) and raises RagkvError subclasses for bad input."""

from __future__ import annotations

import argparse
import json
import sys

from ragkv.commands.common import add_model_args, add_store_args
from ragkv.store.base import check_namespace
from ragkv.store.sizes import human_size
from ragkv.store.spec import DEFAULT_SPEC, SYNTAX, open_store

STORE_HELP = f"tiers, fastest first (default {DEFAULT_SPEC}); {SYNTAX}"
WARM_MODES = ("reuse", "ape", "blend")  # the modes that read cached blocks (prefix caches chunks per request)


def default_warm_spec() -> str:
    """Where `store warm` writes without --store: the disk tier other processes read (memory would die with us)."""
    from ragkv.config import cache_dir

    return f"disk:{cache_dir() / 'kv'}:20GiB"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("store", help="inspect or clear the KV store",
                                   description="Inspect or clear cached block KV in every tier of a store.")
    sub = parser.add_subparsers(dest="store_command", metavar="{stats,clear,warm}", required=True)

    stats = sub.add_parser("stats", help="entries and bytes per tier and namespace")
    stats.add_argument("--store", default=DEFAULT_SPEC, metavar="SPEC", help=STORE_HELP)
    stats.add_argument("--json", action="store_true", help="print the statistics as JSON")
    stats.set_defaults(func=cmd_stats)

    clear = sub.add_parser("clear", help="delete cached blocks (of one namespace, or all)")
    clear.add_argument("--store", default=DEFAULT_SPEC, metavar="SPEC", help=STORE_HELP)
    clear.add_argument("--namespace", metavar="NS", default=None,
                       help="delete only this tenant's blocks (default: every namespace)")
    clear.set_defaults(func=cmd_clear)

    warm = sub.add_parser("warm", help="precompute documents' block KV into the store",
                          description="Encode every document once and store its block KV, so that later "
                                      "`ragkv ask`/`ragkv serve` processes over the same store only reuse it.")
    warm.add_argument("--docs-dir", default=None, help="use every .txt/.md file of this folder as a document")
    warm.add_argument("--doc", action="append", default=[], help="a document file (repeatable)")
    warm.add_argument("--mode", default="reuse", choices=WARM_MODES,
                      help="the fusion mode whose blocks to store (reuse and blend share theirs; ape conditions "
                           "them on the prefix)")
    warm.add_argument("--system", default=None, help="the instruction `ragkv ask --system` will use (APE keys "
                                                     "depend on it)")
    add_model_args(warm)
    add_store_args(warm)
    for action in warm._actions:  # the shared --store help describes `ask`'s memory-only default
        if action.dest == "store":
            action.help = ("tiers, fastest first, e.g. memory:2GiB,disk:PATH:20GiB,redis://HOST:PORT/DB (default: "
                           "disk:~/.cache/ragkv/kv:20GiB, under $RAGKV_CACHE_DIR when set)")
    warm.set_defaults(func=cmd_warm)


def cmd_stats(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    stats = open_store(args.store).stats()
    if args.json:
        json.dump(stats, out, indent=2, sort_keys=True)
        out.write("\n")
        return 0
    rows = [("tier", "namespace", "entries", "bytes")]
    for t in stats["tiers"]:
        rows.append((t["describe"], "(all)", str(t["entries"]), human_size(t["bytes"])))
        for ns, s in sorted(t["namespaces"].items()):
            rows.append(("", ns, str(s["entries"]), human_size(s["bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        out.write(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}\n")
    return 0


def cmd_clear(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    if args.namespace is not None:
        check_namespace(args.namespace)
    store = open_store(args.store)
    total = 0
    for tier in store.tiers:
        n = tier.clear(args.namespace)
        total += n
        out.write(f"{tier.describe()}: deleted {n} entries\n")
    scope = f"namespace {args.namespace!r}" if args.namespace else "all namespaces"
    out.write(f"cleared {total} entries ({scope})\n")
    return 0


def cmd_warm(args: argparse.Namespace, out=None) -> int:
    from tqdm import tqdm

    from ragkv.commands.ask import read_passages
    from ragkv.commands.common import engine_from_args, make_store
    from ragkv.engine.options import FusionOptions
    from ragkv.errors import RagkvError

    out = out or sys.stdout
    check_namespace(args.namespace)
    passages = read_passages(args.doc, args.docs_dir)
    if not passages:
        raise RagkvError("nothing to warm: pass --docs-dir DIR or --doc FILE")
    spec = args.store or default_warm_spec()
    engine = engine_from_args(args, store=make_store(spec))
    fusion = FusionOptions(mode=args.mode)
    computed = present = blocks = 0
    for passage in tqdm(passages, desc="warming", unit="doc", file=sys.stderr):
        res = engine.warm(engine.segments("x", [passage], system=args.system), fusion)
        computed, present = computed + (res.misses > 0), present + (res.misses == 0)
        blocks += res.misses
    out.write(f"{len(passages)} documents in {engine.store.describe()} (namespace {args.namespace!r}, mode "
              f"{args.mode}): {computed} computed, {present} already present ({blocks} blocks encoded)\n")
    return 0
