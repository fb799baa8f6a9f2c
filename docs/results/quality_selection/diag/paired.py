"""Paired accuracy differences (ragkv.eval.summary.bootstrap_ci: 10,000 resamples, 95%) on the questions every
compared run answered.

  python paired.py GRID DRAFT_ROWS        # selection_oracles.py's draft-accuracy rows against the grid's
                                          # `full` and plain query-aware rows
  python paired.py GRID MODE_KEY ...      # each mode key of a results file against its `full`, and each
                                          # `...,draft=N` key against the same key without the draft
  --same-questions-as OTHER.jsonl         # (first) only the questions OTHER has every compared key for, e.g.
                                          # another model's run on the same data; also prints OTHER's gap to
                                          # its full minus this run's, per question
  python paired.py --between A B MODE_KEY ...   # each mode key in run B minus the same key in run A, on the
                                          # questions both answered (e.g. the gold passage last against first)
"""
import json
import sys

from ragkv.eval.summary import bootstrap_ci

Q = "blend:sel=query,r="


def bootstrap(d: list[float]) -> str:
    lo, hi = bootstrap_ci(d)
    return "%+.1f [%+.1f, %+.1f]" % (100 * sum(d) / len(d), 100 * lo, 100 * hi)


def records(path: str) -> dict:
    return {(r["example_id"], r["mode_key"]): r for r in map(json.loads, open(path)) if "example_id" in r}


def between(a_path: str, b_path: str, keys: list[str]) -> None:
    a, b = records(a_path), records(b_path)
    for k in keys:
        ids = [e for e, m in b if m == k and (e, k) in a]
        acc = [(a[(e, k)]["scores"]["accuracy"], b[(e, k)]["scores"]["accuracy"]) for e in ids]
        kl = [(a[(e, k)]["fidelity"]["first_token_kl"], b[(e, k)]["fidelity"]["first_token_kl"]) for e in ids]
        print("%-34s n %d  acc A %.3f B %.3f  B minus A %s  KL to own full A %.3f B %.3f" % (
            k, len(ids), sum(x for x, _ in acc) / len(ids), sum(y for _, y in acc) / len(ids),
            bootstrap([y - x for x, y in acc]), sum(x for x, _ in kl) / len(ids), sum(y for _, y in kl) / len(ids)))


def main(grid: str, rest: list[str], other: str | None = None) -> None:
    acc = {key: r["scores"]["accuracy"] for key, r in records(grid).items()}
    if rest[0].endswith(".jsonl"):  # diagnostic rows: columns draft0.15 / draft0.3
        for r in map(json.loads, open(rest[0])):
            for x in ("0.15", "0.3"):
                acc[(r["id"], f"{Q}{x},draft=16")] = r[f"draft{x}"]["acc"]
        keys = [f"{Q}0.15", f"{Q}0.15,draft=16", f"{Q}0.3", f"{Q}0.3,draft=16"]
    else:
        keys = rest
    theirs = records(other) if other else None
    ids = [e for e in {e for e, _ in acc}
           if all((e, k) in acc and (theirs is None or (e, k) in theirs) for k in keys + ["full"])]
    print("questions", len(ids), "full %.3f" % (sum(acc[(e, "full")] for e in ids) / len(ids)))
    for k in keys:
        line = "%-34s acc %.3f  minus full %s" % (k, sum(acc[(e, k)] for e in ids) / len(ids),
                                                  bootstrap([acc[(e, k)] - acc[(e, "full")] for e in ids]))
        base = k.split(",draft=")[0]
        if base != k and base in keys:
            line += "  minus %s %s" % (base, bootstrap([acc[(e, k)] - acc[(e, base)] for e in ids]))
        if theirs is not None:  # the other run's gap to its own full, minus this run's, per question
            gap = {e: theirs[(e, k)]["scores"]["accuracy"] - theirs[(e, "full")]["scores"]["accuracy"] for e in ids}
            line += "  other's gap minus this %s" % bootstrap([gap[e] - (acc[(e, k)] - acc[(e, "full")]) for e in ids])
        print(line)


if __name__ == "__main__":
    args, other = sys.argv[1:], None
    if args[0] == "--between":
        sys.exit(between(args[1], args[2], args[3:]))
    if args[0] == "--same-questions-as":
        other, args = args[1], args[2:]
    main(args[0], args[1:], other)
