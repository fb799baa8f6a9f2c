"""`ragkv store stats|clear|warm|profile`: inspect, clear, precompute into and profile the KV store.

Every subcommand opens the same default store as `ask`, `ingest` and `serve` (ragkv.settings)."""

from __future__ import annotations

import argparse
import json
import sys

from ragkv.cli.ask import read_passages
from ragkv.cli.common import add_model_args, add_store_args, engine_from_args, make_store
from ragkv.engine.modes import MODES, get_mode
from ragkv.engine.options import FusionOptions
from ragkv.errors import RagkvError
from ragkv.store.sizes import human_size

WARM_MODES = tuple(m for m in MODES if get_mode(m).reads_blocks)  # prefix caches chunks per request


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("store", help="inspect, clear, warm or profile the KV store",
                                   description="Inspect or clear cached block KV in every tier of a store, "
                                               "precompute documents into it, or measure its load profile.")
    sub = parser.add_subparsers(dest="store_command", metavar="{stats,clear,warm,profile}", required=True)

    stats = sub.add_parser("stats", help="entries and bytes per tier and namespace")
    stats.add_argument("--json", action="store_true", help="print the statistics as JSON")
    add_store_args(stats, namespace=False)
    stats.set_defaults(func=cmd_stats)

    clear = sub.add_parser("clear", help="delete cached blocks (of one namespace, or all)")
    add_store_args(clear, namespace=False)
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
    warm.set_defaults(func=cmd_warm)

    profile = sub.add_parser("profile", help="measure each tier's load bandwidth and the model's recompute cost",
                             description="What blend's loading controller plans with (CacheBlend sec. 5.1). "
                                         "Saved for every later process; `ragkv serve` measures what is missing "
                                         "at start-up, never inside a request.")
    profile.add_argument("--refresh", action="store_true", help="measure again even what is already saved")
    profile.add_argument("--json", action="store_true")
    add_model_args(profile, decode_weights=False)
    add_store_args(profile, namespace=False)
    profile.set_defaults(func=cmd_profile)


def cmd_stats(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    stats = make_store(args.store).stats()
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
    from ragkv.store.base import check_namespace

    if args.namespace is not None:
        check_namespace(args.namespace)
    store = make_store(args.store)
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

    from ragkv.store.base import check_namespace

    out = out or sys.stdout
    check_namespace(args.namespace)
    passages = read_passages(args.doc, args.docs_dir)
    if not passages:
        raise RagkvError("nothing to warm: pass --docs-dir DIR or --doc FILE")
    engine = engine_from_args(args)
    fusion = FusionOptions(mode=args.mode)
    computed = present = blocks = 0
    for passage in tqdm(passages, desc="warming", unit="doc", file=sys.stderr):
        res = engine.warm(engine.context_segments([passage], system=args.system), fusion)
        computed, present = computed + (res.misses > 0), present + (res.misses == 0)
        blocks += res.misses
    out.write(f"{len(passages)} documents in {engine.describe_store()} (namespace {args.namespace!r}, mode "
              f"{args.mode}): {computed} computed, {present} already present ({blocks} blocks encoded)\n")
    return 0


def cmd_profile(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    profile = engine_from_args(args).profile_store(refresh=args.refresh)
    if args.json:
        json.dump(profile, out, indent=2)
        out.write("\n")
        return 0
    for tier, bw in profile["tiers"].items():
        out.write(f"{tier}: loads at {bw / 1e9:.2f} GB/s\n")
    for tokens, s in profile["recompute_points"]:
        out.write(f"recompute at {tokens} tokens: {s * 1e6:.2f} us per token and layer\n")
    out.write(f"saved to {profile['saved_to']}\n")
    return 0
