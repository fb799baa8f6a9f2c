"""soak.md: the figures (target: all zero), per-phase load and latency, and samples of what went wrong."""

from __future__ import annotations

import json

FIGURE_LABELS = {
    "crashes": "crashes (server process exited)",
    "http_5xx": "HTTP 5xx",
    "other_non_2xx": "other non-2xx, by status",
    "transport_errors": "transport errors (timeouts, refused connections)",
    "stream_errors": "errors inside 200 streams",
    "lost_documents": "lost acknowledged documents (end)",
    "lost_documents_after_restart": "lost acknowledged documents (after a restart on the same cache folder)",
    "deleted_documents_listed_again": "deleted documents listed again",
    "cross_tenant_reads": "cross-tenant reads (another tenant's marker in a response or listing)",
    "differing_answers": "probe answers differing from the fault-free greedy run (during faults, after, after "
                         "restart)",
    "unclean_shutdown": "SIGTERM exit code not 0",
    "fuzz_5xx": "fuzzer: HTTP 5xx",
    "fuzz_bodiless_4xx": "fuzzer: 4xx without an error body",
    "fuzz_no_answer": "fuzzer: no answer (timeout = hang, or a dropped connection)",
    "fuzz_rounds_failed": "fuzzer: rounds that could not run",
    "rss_over_budget": "abuse phase: RSS rose over its pre-phase level by more than memory tier + KV limit + slack",
    "rss_not_returned": "abuse phase: RSS not back within the return margin of its pre-phase level in time",
}


def render_markdown(out: dict) -> str:
    from ragkv.bench.common import markdown_table

    figs = out.get("figures", {})
    lines = [f"# ragkv bench soak: {'all zero' if out.get('all_zero') else 'NOT all zero'}", ""]
    if out.get("error"):
        lines += [f"**The soak stopped on an error:** {out['error']}", ""]
    lines.append(markdown_table(["figure (target 0)", "value"],
                                [[label, figs.get(k, "-") if not isinstance(figs.get(k), dict) else (
                                    json.dumps(figs[k]) if figs[k] else 0)] for k, label in FIGURE_LABELS.items()]))
    req = out.get("requests", {})
    ph, probe_ph = req.get("phases", {}), out.get("probes", {}).get("phases", {})
    dash = lambda x: "-" if x is None else x  # noqa: E731
    rows = [[p, v["chat_requests"], v["ok"], dash(v["wall_s"]), dash(v["requests_per_s"]), dash(v["latency_p50_ms"]),
             dash(v["latency_p99_ms"]), f"{probe_ph.get(p, {}).get('differ', 0)}/{probe_ph.get(p, {}).get('sent', 0)}"]
            for p, v in ph.items()]  # baseline: the reference itself; the other quiet phases: one probe at a time
    lines += ["", markdown_table(["phase", "chat requests", "ok", "wall s", "req/s", "latency p50 ms",
                                  "latency p99 ms", "probes differing/sent"], rows)]
    m, m2 = out.get("metrics") or {}, out.get("metrics_after_restart") or {}
    cfg = out.get("config", {})
    lines += ["", f"- faults injected: {out.get('faults_injected')}; redis-server starts: {out.get('redis_starts')}; "
                  f"Redis after the last restart: {out.get('redis_at_end')}",
              f"- server /metrics at the end: tier faults {m.get('tier_faults')}, fault requests "
              f"{m.get('fault_requests')}, uncached blocks {m.get('uncached_blocks')}, requests by status "
              f"{m.get('requests_by_status')}",
              f"- after the restart: tier faults {m2.get('tier_faults')}, fault requests {m2.get('fault_requests')}, "
              f"uncached blocks {m2.get('uncached_blocks')}",
              f"- answers the server marked store_fault (client side): {req.get('client_store_fault_answers')}, "
              f"uncached blocks reported in usage: {req.get('client_uncached_blocks')}",
              f"- documents: end {out.get('documents_end', {}).get('ledger')}, SIGTERM {out.get('shutdown')}",
              f"- {cfg.get('clients')} clients, {cfg.get('minutes')} min of faults every ~{cfg.get('fault_interval_s')}"
              f" s after {cfg.get('calm_s')} s calm, seed {cfg.get('seed')}, {cfg.get('model')} {cfg.get('dtype')}; "
              f"store {out.get('store')}; {out.get('machine', {}).get('cpus')} CPUs, load "
              f"{out.get('machine', {}).get('loadavg_at_start')} -> {out.get('machine', {}).get('loadavg_at_end')}",
              f"- server logs: {', '.join(out.get('server_logs', []))}"]
    if out.get("fuzz"):
        f = out["fuzz"]
        lines.append(f"- fuzzer ({cfg.get('fuzz_clients')} threads, during the faults): {f['requests']} generated "
                     f"requests in {f['rounds']} rounds, statuses {f['statuses']}")
    if out.get("long_ape", {}).get("sent"):
        la = out["long_ape"]
        lines.append(f"- long `ape` requests ({cfg.get('long_ape_documents')} documents x "
                     f"{cfg.get('long_ape_words')} words, one per {cfg.get('long_ape_every_s')} s): {la['sent']} sent, "
                     f"answers {la['statuses']}, seconds {la['seconds']}")
        lane = la.get("lane_log", [])
        if lane:  # every tenant's long prefills, as the server logged them; the ones that did not end well in full
            counts = {w: sum(f"long prefill {w}" in line for line in lane) for w in ("admitted", "refused", "prefilled")}
            lines.append(f"- the server's long prefills (all tenants): {counts}; not prefilled:")
            lines += [f"  - `{line}`" for line in lane if "WARNING" in line][:20]
    abuse = out.get("abuse")
    if abuse:
        v = abuse["rss"]
        lines += ["", "## Memory under the abuse phase", "",
                  markdown_table(["RSS MiB: pre-phase", "peak", "allowed peak", "after the phase",
                                  "return target", "back after s"],
                                 [[v["pre_phase_mib"], v["peak_mib"], v["allowed_peak_mib"], v["after_phase_mib"],
                                   v["return_target_mib"], dash(v["returned_after_s"])]]), "",
                  f"- {abuse['sent']}/{abuse['requests']} abuse requests sent in {abuse['wall_s']} s "
                  f"(n={cfg.get('abuse_n')}, max_tokens {cfg.get('abuse_max_tokens')}, {cfg.get('abuse_clients')} "
                  f"clients); answers by kind and status: {json.dumps(abuse['answers'])}",
                  f"- replies with a contract: {abuse.get('contracts', 0)}, broken: {len(abuse.get('broken', []))}"
                  + "".join(f"\n  - {b['kind']}: {b['why']}" for b in abuse.get("broken", [])[:10]),
                  f"- budget (MiB): {v['budget_mib']}; RSS over the run: soak.json `rss_series_mib`", ""]
    lines.append(f"- the leak detector's reach: responses holding their own tenant's marker, by kind: "
                 f"{out.get('own_marker_responses')}")
    noise = out.get("fault_free_differences") or {}
    if noise:
        lines.append(f"- fault-free noise floor (not counted above): {noise}")
    for title, items in (("Probe differences", out.get("probes", {}).get("examples")),
                         ("Error samples", req.get("error_samples")),
                         ("Cross-tenant reads", out.get("cross_tenant_samples")),
                         ("Lost documents", (out.get("documents_end", {}).get("lost", [])
                                             + out.get("documents_after_restart", {}).get("lost", []))),
                         ("Document notes", out.get("document_notes")),
                         ("Crashes", [{k: v for k, v in c.items() if k != "log"} for c in out.get("crash_reports", [])])):
        if items:
            lines += ["", f"## {title}", ""] + [f"- `{json.dumps(x, ensure_ascii=False)[:600]}`" for x in items]
    return "\n".join(lines)
