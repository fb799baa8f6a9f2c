"""The controller's verdict against the fixed choices, controller_bench.md and controller_bench.png."""

from __future__ import annotations

from pathlib import Path

from ragkv.bench.controller.config import KL_REL_TOL, TARGET


def verdict(rows: list[dict], target: float = TARGET, kl_rel_tol: float = KL_REL_TOL) -> dict:
    """The controller row (kind "controller") against the fixed rows (kind "fixed"): the fastest fixed choice
    whose KL is at most the controller's (within `kl_rel_tol`, relative), and whether the controller's TTFT is
    within `target` x its TTFT. `meets` is None when no fixed choice is as faithful as the controller."""
    ctrl = [r for r in rows if r["kind"] == "controller"]
    if len(ctrl) != 1:
        raise ValueError(f"verdict wants exactly one controller row, got {len(ctrl)}")
    c = ctrl[0]
    fixed = [r for r in rows if r["kind"] == "fixed"]
    if not fixed:
        raise ValueError("verdict wants at least one fixed row")
    bound = c["kl"] * (1 + kl_rel_tol)
    eligible = [r for r in fixed if r["kl"] <= bound]
    fastest = min(fixed, key=lambda r: r["ttft_ms"])
    # choices at least as fast with a KL better beyond the tolerance: quality the controller left on the table
    dominated_by = sorted((r["name"] for r in fixed if r["ttft_ms"] <= c["ttft_ms"] and r["kl"] * (1 + kl_rel_tol)
                           < c["kl"]), key=lambda n: next(r["kl"] for r in fixed if r["name"] == n))
    out = {"controller": c["name"], "controller_ttft_ms": c["ttft_ms"], "controller_kl": c["kl"],
           "target": target, "kl_rel_tol": kl_rel_tol, "fastest_fixed": fastest["name"],
           "fastest_fixed_ttft_ms": fastest["ttft_ms"], "fastest_fixed_kl": fastest["kl"],
           "dominated_by": dominated_by}
    if not eligible:
        return {**out, "best_fixed": None, "ttft_ratio": None, "meets": None,
                "text": f"no fixed choice reaches the controller's KL ({c['kl']:.4g}); the fastest fixed choice, "
                        f"{fastest['name']}, takes {fastest['ttft_ms']:.0f} ms at KL {fastest['kl']:.4g} against "
                        f"the controller's {c['ttft_ms']:.0f} ms"}
    best = min(eligible, key=lambda r: r["ttft_ms"])
    ratio = c["ttft_ms"] / best["ttft_ms"]
    meets = ratio <= target
    text = (f"controller {c['ttft_ms']:.0f} ms at KL {c['kl']:.4g} vs the best fixed choice at equal or better KL, "
            f"{best['name']}: {best['ttft_ms']:.0f} ms at KL {best['kl']:.4g} -> {ratio:.2f}x: "
            f"{'MEETS' if meets else 'MISSES'} the <= {target:.2f}x target")
    if dominated_by:
        verb = "is" if len(dominated_by) == 1 else "are"
        text += f"; but {', '.join(dominated_by)} {verb} at least as fast with a better KL"
    return {**out, "best_fixed": best["name"], "best_fixed_ttft_ms": best["ttft_ms"], "best_fixed_kl": best["kl"],
            "ttft_ratio": round(ratio, 4), "meets": meets, "text": text}


def render_markdown(res: dict) -> str:
    from ragkv.bench.common import markdown_table

    th = res["throttle"]
    how = (f"{th['delay_ms']:.1f} ms per block and layer read" if th["kind"] == "latency"
           else f"{th['mbps']:.2f} MB/s per block read")
    rotated = ", each starting at another configuration" if res.get("round_order") == "rotated" else ""
    head = (f"Loading-controller benchmark on {res['model']} ({res['dtype']}, {res['device']}, {res['threads']} "
            f"threads): {res['prompt_tokens']}-token request, {res['blocks']} cached blocks "
            f"({res['kv_bytes'] / 1e6:.1f} MB of KV), blend check layers {res['check_layers']} "
            f"(deviation {res['deviation']}{', gradual' if res['gradual'] else ''}); TTFT median of {res['repeats']} "
            f"round-robin rounds{rotated} (full: its one reference run); KL = first-token KL(full || x). "
            f"Redis: {res['redis']}. Throttled tier: {how} "
            f"({th['kind']}; loading the spread placement's throttled-only blocks takes "
            f"{res['throttled_load_ms_per_layer']['spread (blocks only there)']:.1f} ms per layer, all blocks "
            f"{res['throttled_load_ms_per_layer']['all blocks']:.1f} ms; recompute at r_min={res['r_min']} is "
            f"{res['recompute_ms_per_layer_at_r_min']:.1f} ms per layer by the profile).\n\n")
    place = "Spread placement (the controller's store): " + "; ".join(
        f"block {p['block']} ({p['tokens']} tok): {'+'.join(p['held_by'])}" for p in res["placement"]) + ".\n\n"
    rows = [[f"**{r['name']}**" if r["kind"] == "controller" else r["name"], r["kind"],
             "-" if r["ratio"] is None else f"{r['ratio']:.3f}", f"{r['ttft_ms']:.0f}", f"{r['best_ms']:.0f}",
             f"{100 * r['vs_full']:.1f}%", f"{r['kl']:.4f}", "yes" if r["top1_agrees"] else "no",
             f"{r['load_wait_ms']:.0f}", ", ".join(f"{_short(t)}: {n}" for t, n in r["reads"].items()) or "-"]
            for r in res["rows"]]
    table = markdown_table(["configuration", "kind", "r", "TTFT ms (median)", "best ms", "vs full", "KL",
                            "top-1 = full", "load wait ms", "blocks read from"], rows)
    lines = [f"- **Verdict** (vs every fixed (r, tier) choice): {res['verdict']['text']}."]
    if "verdict_vs_spread" in res:
        lines.append(f"- Against the spread placement at a fixed r: {res['verdict_vs_spread']['text']}.")
    ctrl = next(r for r in res["rows"] if r["kind"] == "controller")
    if ctrl["plan"]:
        p = ctrl["plan"]
        lines.append(f"- The controller's plan: r={p['ratio']:.3f}, predicted loading {p['load_ms_per_layer']:.1f} "
                     f"ms/layer vs recompute {p['recompute_ms_per_layer']:.1f} ms/layer; blocks read from "
                     f"{', '.join(_short(t) for t in p['tiers'])}. {p['reason']}.")
    if "plan_throttled_load_ms_per_layer" in res:
        t = res["plan_throttled_load_ms_per_layer"]
        lines.append(f"- Loading of the blocks the plan reads from the throttled tier: the controller predicted "
                     f"{t['predicted']:.1f} ms per layer, the throttle takes {t['actual']:.1f} ms (its waits).")
    lat = res.get("tier_latency_s", {})
    bws = "; ".join(f"{_short(d)}: {bw / 1e6:.1f} MB/s + {(lat.get(d) or 0) * 1e3:.3f} ms per read"
                    for d, bw in res["tier_bandwidth_bytes_per_s"].items() if bw is not None)
    lines.append(f"- Profiled tiers (what the controller plans with): {bws}.")
    return head + place + table + "\n\n" + "\n".join(lines) + "\n"


def _short(desc: str) -> str:
    for kind in ("memory", "disk", "redis", "throttled"):
        if desc.startswith(kind):
            return kind
    return desc


def plot(path: Path, res: dict) -> None:
    from ragkv.figures import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(10.5, 5))
    markers = {"memory": "o", "disk": "s", "redis": "D", "throttled": "v", "spread": "P"}
    ratios = sorted({r["ratio"] for r in res["rows"] if r["kind"] in ("fixed", "spread")})
    colors = {r: f"C{i}" for i, r in enumerate(ratios)}
    floor = min([r["kl"] for r in res["rows"] if r["kl"] > 0] or [1e-6]) / 3
    for tier, m in markers.items():
        rows = [r for r in res["rows"] if r["kind"] in ("fixed", "spread") and r["tier"] == tier]
        for r in rows:
            ax.scatter(r["ttft_ms"], max(r["kl"], floor), marker=m, color=colors[r["ratio"]], s=45, alpha=0.85,
                       label=None)
    for tier, m in markers.items():  # legend: shape = tier, color = r
        if any(r["tier"] == tier and r["kind"] in ("fixed", "spread") for r in res["rows"]):
            note = " (controller placement)" if tier == "spread" else ""
            ax.scatter([], [], marker=m, color="gray", label=f"{tier}{note}")
    for r, c in colors.items():
        ax.scatter([], [], marker="s", color=c, label=f"r={r:g}")
    ctrl = next(r for r in res["rows"] if r["kind"] == "controller")
    ax.scatter(ctrl["ttft_ms"], max(ctrl["kl"], floor), marker="*", s=400, color="red", edgecolor="black", zorder=5,
               label=f"controller (r={ctrl['ratio']:.3f})")
    full = next(r for r in res["rows"] if r["kind"] == "full")  # far to the right: named in the title instead
    v = res["verdict"]
    if v.get("best_fixed"):
        ax.axvline(v["best_fixed_ttft_ms"] * v["target"], color="red", ls="--", lw=0.8,
                   label=f"target: {v['target']:.2f}x best fixed at equal KL")
    ax.set_yscale("log")
    ax.set_xlabel("TTFT (ms, median)")
    ax.set_ylabel("first-token KL(full || x)")
    ax.set_title(f"Loading controller vs fixed (r, tier), {res['model']} {res['dtype']}, {res['prompt_tokens']} "
                 f"tokens, throttle {res['throttle']['kind']} (full: {full['ttft_ms'] / 1e3:.0f} s, KL 0)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path)
