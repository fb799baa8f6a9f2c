"""serve_bench.png (throughput vs p95 TTFT, latency per concurrency) and serve_bench.md."""

from __future__ import annotations

from pathlib import Path

from ragkv.bench.serve.peer import PEER_RATIO_KEYS
from ragkv.engine.modes import is_reference


def plot_serve_bench(cells: list[dict], path: Path) -> Path:
    """Left: throughput vs p95 TTFT per mode (and the peer). Right: mean end-to-end latency per concurrency."""
    from matplotlib.ticker import FuncFormatter

    from ragkv.figures import pyplot, save_figure

    fig, (ax, ax2) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    for mode in dict.fromkeys(c["mode"] for c in cells):
        pts = [c for c in cells if c["mode"] == mode and c["ttft_p95_ms"] is not None]
        if not pts:
            continue
        style = {"linestyle": "--", "color": "black"} if pts[0].get("system", "ragkv") != "ragkv" else {}
        ax.plot([c["requests_per_s"] for c in pts], [c["ttft_p95_ms"] / 1000 for c in pts], marker="o",
                label=mode, **style)
        for c in pts:
            ax.annotate(f"c={c['concurrency']}", (c["requests_per_s"], c["ttft_p95_ms"] / 1000), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
        lat = [c for c in pts if c.get("latency_mean_ms") is not None]
        if lat:
            ax2.plot([c["concurrency"] for c in lat], [c["latency_mean_ms"] / 1000 for c in lat], marker="o",
                     label=mode, **style)
    ax.set_yscale("log")
    ax.set_xlim(left=0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}" if f"{y:.1g}"[0] in "25" else ""))
    ax.set_xlabel("throughput (requests/s)"), ax.set_ylabel("p95 TTFT (s, client side)")
    ax.set_title("throughput vs p95 TTFT (MuSiQue passage pool)")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(sorted({c["concurrency"] for c in cells}))
    ax2.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("concurrent clients"), ax2.set_ylabel("mean end-to-end latency (s)")
    ax2.set_title("end-to-end latency (streamed answer)")
    for a in (ax, ax2):
        a.grid(True, alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend()
    return save_figure(fig, path)


def render_markdown(result: dict) -> str:
    from ragkv.bench.common import markdown_table

    cells = result["cells"]
    full = {c["concurrency"]: c["requests_per_s"] for c in cells if is_reference(c["mode"])}
    rows = [[c.get("system", "ragkv"), c["mode"], c["concurrency"], f"{c['ok']}/{c['requests']}",
             c["requests_per_s"],
             f"{c['requests_per_s'] / full[c['concurrency']]:.2f}x" if full.get(c["concurrency"]) else "-",
             c["ttft_p50_ms"], c["ttft_p95_ms"], c.get("latency_p50_ms"), c.get("latency_p95_ms"),
             c.get("latency_mean_ms"), c.get("decode_tokens_per_s"), c.get("output_tokens_per_s"),
             c["server_ttft_p50_ms"], c.get("server_cpu_s_per_request"), c["prompt_tokens"], c["reused_tokens"],
             c.get("completion_tokens"), c.get("loadavg_1m")] for c in cells]
    lines = [markdown_table(["system", "mode", "clients", "ok", "req/s", "vs full", "TTFT p50 ms", "TTFT p95 ms",
                             "e2e p50 ms", "e2e p95 ms", "e2e mean ms", "decode tok/s", "output tok/s",
                             "server prefill p50 ms", "server CPU s/req", "prompt tok", "reused tok", "out tok",
                             "load 1m"], rows)]
    for mode, r in result.get("ratios_vs_full", {}).items():
        at = ", ".join(f"{'no cell fits' if x['ratio'] is None else str(x['ratio']) + 'x'} (full c="
                       f"{x['baseline_concurrency']}, p95 <= {x['p95_ttft_budget_ms']} ms)"
                       for x in r["at_baseline_p95_ttft"])
        lines.append(f"- {mode}: requests/s vs full at full's p95 TTFT: {at}")
    shared = [(c, s) for c in cells for s in c.get("per_server", [])]
    if shared:
        urls = result["url"]
        lines += ["", f"Per server ({len(urls)} servers sharing one store, requests round-robin; only server 0 "
                      "ran the warm-up, so the others' reused tokens came from the shared tiers):", "",
                  markdown_table(["mode", "clients", "server", "ok", "TTFT p50 ms", "TTFT p95 ms", "e2e mean ms",
                                  "server prefill p50 ms", "reused tok", "recomputed tok", "misses"],
                                 [[c["mode"], c["concurrency"], f"{s['server']}: {urls[s['server']]}",
                                   f"{s['ok']}/{s['requests']}", s["ttft_p50_ms"], s["ttft_p95_ms"],
                                   s["latency_mean_ms"], s["server_ttft_p50_ms"], s["reused_tokens"],
                                   s["recomputed_tokens"], s["cache_misses"]] for c, s in shared])]
    batching = [c for c in cells if "mean_batch" in c]
    if batching:
        lines += ["", "Continuous batching inside ragkv's server per cell (prefill runs in units between decode "
                      "steps; a stall is the pause those units impose on running answers):", "",
                  markdown_table(["mode", "clients", "decode steps", "mean batch", "prefill stall ms per step",
                                  "longest stall so far ms", "KV peak MB"],
                                 [[c["mode"], c["concurrency"], c["decode_steps"], c["mean_batch"],
                                   c["prefill_stall_ms_per_step"], c["prefill_stall_ms_max_so_far"],
                                   "-" if c.get("kv_bytes_peak") is None else round(c["kv_bytes_peak"] / 1e6, 1)]
                                  for c in batching]),
                  "", "KV peak: the most KV the server held at once during the cell (/health sampled every 0.25 s): "
                      "the running answers' caches plus the pooled blocks `kv_layout=shared` reads in place (not "
                      "sampled in runs with a peer, whose cells have no such poller: `-`)."]
    rate_cells = result.get("rate_cells") or []
    if rate_cells:
        cfg = result["config"]
        lines += ["", f"Open loop (Poisson arrivals at each rate, as vLLM's serving benchmark): goodput = requests/s "
                      f"whose TTFT <= {cfg['slo_ttft_s']} s and time per output token <= {cfg['slo_tpot_s']} s:", "",
                  markdown_table(["system", "mode", "rate req/s", "ok", "goodput req/s", "in SLO", "req/s",
                                  "TTFT p50 ms", "TTFT p95 ms", "TPOT p50 ms", "e2e p95 ms", "mean batch"],
                                 [[c.get("system", "ragkv"), c["mode"], c["rate"], f"{c['ok']}/{c['requests']}",
                                   c["goodput_per_s"], c["goodput_share"], c["requests_per_s"], c["ttft_p50_ms"],
                                   c["ttft_p95_ms"], c["tpot_p50_ms"], c.get("latency_p95_ms"),
                                   c.get("mean_batch", "-")] for c in rate_cells])]
        for mode, per in (result.get("goodput_vs_peer") or {}).items():
            lines.append(f"- {mode}: goodput over {result['peer']['name']}'s: " + ", ".join(
                f"{'-' if r is None else f'{r:.2f}x'} at {rate} req/s" for rate, r in per.items()))
    ratios = result.get("ratios_vs_peer") or {}
    if ratios:
        peer = result["peer"]["name"]
        lines += ["", f"Each ragkv mode over {peer} at the same number of clients (times: below 1x is faster; "
                      "rates: above 1x is more):", ""]
        fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        lines.append(markdown_table(
            ["mode", "clients", "TTFT p50", "e2e p50", "e2e mean", "req/s", "decode tok/s", "output tok/s"],
            [[mode, c, *(fmt(r[k]) for k in PEER_RATIO_KEYS)] for mode, per in ratios.items()
             for c, r in per.items()]))
        lines.append("")
        for mode, per in ratios.items():
            parts = []
            first = min(per, key=int)
            if per[first]["latency_mean"] is not None:
                parts.append(f"end-to-end mean {fmt(per[first]['latency_mean'])} {peer}'s at {first} client(s)")
            for c, r in per.items():
                if int(c) > 1 and r["requests_per_s"] is not None:
                    parts.append(f"{fmt(r['requests_per_s'])} its req/s at {c} clients")
            if parts:
                lines.append(f"- {mode}: " + ", ".join(parts))
        p = result["peer"]
        lines.append(f"- {peer}: {p.get('version') or '?'}, {p.get('threads') or '?'} threads, greedy with "
                     f"{p['sampling']}; prompt tokens of the first request {p['prompt_tokens_reported']} (server) "
                     f"vs {p['prompt_tokens_counted']} (tokenizer); its answer tokens are counted with the "
                     "model's tokenizer (its streams report no usage)")
    probes = [(w, result.get("machine", {}).get(f"probe_{w}")) for w in ("before", "after")]
    if any(p for _, p in probes):  # the rate the machine gave around the cells (its speed drifts)
        lines += ["", "Machine probe: " + "; ".join(
            f"{w}: {p['dtype']} {p['gemm_n']}^3 product {p['gemm_gflops']} GFLOP/s, {p['copy_mib']} MiB copy "
            f"{p['copy_gb_per_s']} GB/s" for w, p in probes if p)]
    return "\n".join(lines)
