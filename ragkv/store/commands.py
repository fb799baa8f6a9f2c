"""`ragkv store stats` and `ragkv store clear`. ragkv.cli calls `register(subparsers)`; each command sets
`args.func(args) -> int` (exit code) and raises RagkvError subclasses for bad input."""

from __future__ import annotations

import argparse
import json
import sys

from ragkv.store.base import check_namespace
from ragkv.store.sizes import human_size
from ragkv.store.spec import DEFAULT_SPEC, SYNTAX, open_store

STORE_HELP = f"tiers, fastest first (default {DEFAULT_SPEC}); {SYNTAX}"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("store", help="inspect or clear the KV store",
                                   description="Inspect or clear cached block KV in every tier of a store.")
    sub = parser.add_subparsers(dest="store_command", metavar="{stats,clear}", required=True)

    stats = sub.add_parser("stats", help="entries and bytes per tier and namespace")
    stats.add_argument("--store", default=DEFAULT_SPEC, metavar="SPEC", help=STORE_HELP)
    stats.add_argument("--json", action="store_true", help="print the statistics as JSON")
    stats.set_defaults(func=cmd_stats)

    clear = sub.add_parser("clear", help="delete cached blocks (of one namespace, or all)")
    clear.add_argument("--store", default=DEFAULT_SPEC, metavar="SPEC", help=STORE_HELP)
    clear.add_argument("--namespace", metavar="NS", default=None,
                       help="delete only this tenant's blocks (default: every namespace)")
    clear.set_defaults(func=cmd_clear)


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
