"""`pagellm bench soak`'s figures: counts by outcome, the must-be-zero checks, latency windows, the printout
and the plot (matplotlib, imported only in plot_soak)."""

from __future__ import annotations

from collections import Counter

from pagellm.bench.soak_traffic import Outcome

MAX_EXAMPLES = 20  # failures kept verbatim in the JSON, per kind of failure


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return round(float(np.percentile(np.asarray(values) * 1000, q)), 2)


def _example(o: Outcome, why: str) -> dict:
    return {"kind": o.kind, "start_s": round(o.start, 2), "stream": o.stream, "status": o.status, "why": why,
            "error": o.error or None}


def _windows(outs: list[Outcome], end: float) -> list[dict]:
    """Latency and outcomes in fixed windows of the whole timeline (about 40 of them, at least 5 s)."""
    width = max(5.0, round(end / 40))
    rows = []
    for k in range(int(end // width) + 1):
        lo, hi = k * width, (k + 1) * width
        inside = [o for o in outs if lo <= o.start < hi]
        ttft = [o.ttft for o in inside if o.ttft is not None]
        itl = [x for o in inside for x in o.itl]
        rows.append({"start_s": lo, "end_s": hi, "sent": len(inside),
                     "completed": sum(o.accepted and o.final and not o.abandoned for o in inside),
                     "abandoned": sum(bool(o.abandoned) for o in inside),
                     "rejected_503": sum(o.status == 503 for o in inside),
                     "rejected_4xx": sum(o.status is not None and 400 <= o.status < 500 for o in inside),
                     "p50_ttft_ms": _pct(ttft, 50), "p99_ttft_ms": _pct(ttft, 99),
                     "p50_itl_ms": _pct(itl, 50), "p99_itl_ms": _pct(itl, 99)})
    return rows


def summarize(raw: dict) -> dict:
    outs = [o for _, o in raw["outcomes"]]
    soak = [o for phase, o in raw["outcomes"] if phase == "soak"]
    lost = [o for o in outs if not o.abandoned and (o.status is None or (o.accepted and not o.final))]
    errors_5xx = [o for o in outs if o.status is not None and o.status >= 500 and o.status != 503]
    no_retry = [o for o in outs if o.status == 503 and not o.retry_after]
    invalid = [o for o in outs if o.problem]
    malformed = [o for o in outs if o.kind.startswith("malformed:")]
    malformed_accepted = [o for o in malformed if o.status == 200 and not o.expected_status]
    unexpected = Counter(f"{o.kind} -> {o.status}" for o in outs if o.status is not None and not o.expected_status)
    ref = raw["reference"]
    canaries = [(phase, o) for phase, o in raw["outcomes"] if o.kind == "canary" and phase != "canary-reference"]
    compared = [o for _, o in canaries if o.answer is not None]
    mismatches = [o for o in compared if o.answer != ref.get(o.canary)]
    phases = raw["phases"]
    start, warm, end = (phases[k].get("rss_bytes") for k in ("start", "after_warmup", "after_drain"))
    drained = phases["after_drain"]
    bursts_503 = sum(o.kind == "burst" and o.status == 503 for o in outs)
    timeline_end = max([o.end for o in outs] + [1.0])
    return {
        "totals": {
            "sent": raw["sent"], "accepted": sum(o.accepted for o in outs),
            "completed": sum(o.accepted and o.final and not o.abandoned for o in outs),
            "rejected_by_status": dict(sorted(Counter(str(o.status) for o in outs
                                                      if o.status not in (None, 200)).items())),
            "disconnected_mid_stream": sum(o.abandoned == "disconnect" for o in outs),
            "cancelled_before_first_token": sum(o.abandoned == "cancel" for o in outs),
            "lost": len(lost), "server_errors_5xx": len(errors_5xx),
            "unavailable_without_retry_after": len(no_retry), "invalid_answers": len(invalid),
            "malformed_sent": len(malformed), "malformed_accepted": len(malformed_accepted),
            "burst_sent": sum(o.kind == "burst" for o in outs), "burst_503": bursts_503,
            "streams": sum(o.stream for o in outs),
        },
        "by_kind": dict(sorted(Counter(o.kind for o in outs).items())),
        "unexpected_status": dict(sorted(unexpected.items())),
        "canaries": {"reference": {str(k): v for k, v in ref.items()}, "sent": len(canaries),
                     "compared": len(compared), "rejected": sum(o.status == 503 for _, o in canaries),
                     "mismatches": len(mismatches),
                     "mismatch_examples": [{"canary": o.canary, "start_s": round(o.start, 2), "got": o.answer,
                                            "reference": ref.get(o.canary)} for o in mismatches[:MAX_EXAMPLES]]},
        "after_drain": {k: drained.get(k) for k in ("running", "waiting", "kv_usage", "blocks_in_use", "num_blocks",
                                                    "drain_s")},
        "rss": {"start_bytes": start, "after_warmup_bytes": warm, "after_drain_bytes": end,
                "drift": round((end - warm) / warm, 4) if warm and end else None},
        "latency_soak_phase": {"p50_ttft_ms": _pct([o.ttft for o in soak if o.ttft is not None], 50),
                               "p99_ttft_ms": _pct([o.ttft for o in soak if o.ttft is not None], 99),
                               "p50_itl_ms": _pct([x for o in soak for x in o.itl], 50),
                               "p99_itl_ms": _pct([x for o in soak for x in o.itl], 99)},
        "phases": dict(phases),
        "windows": _windows(outs, timeline_end),
        "metrics_samples": raw["samples"],
        "failures": {"lost": [_example(o, "no final answer") for o in lost[:MAX_EXAMPLES]],
                     "server_errors_5xx": [_example(o, "5xx") for o in errors_5xx[:MAX_EXAMPLES]],
                     "invalid_answers": [_example(o, o.problem) for o in invalid[:MAX_EXAMPLES]],
                     "malformed_accepted": [_example(o, "accepted") for o in malformed_accepted[:MAX_EXAMPLES]]},
    }


def checks(report: dict, max_drift: float) -> dict:
    """name -> {"value", "ok"}: everything that must be zero, plus the RSS drift bound."""
    t, d, c, rss = report["totals"], report["after_drain"], report["canaries"], report["rss"]
    zero = {"lost": t["lost"], "server_errors_5xx": t["server_errors_5xx"],
            "unavailable_without_retry_after": t["unavailable_without_retry_after"],
            "invalid_answers": t["invalid_answers"], "malformed_accepted": t["malformed_accepted"],
            "canary_mismatches": c["mismatches"], "running_after_drain": d["running"],
            "waiting_after_drain": d["waiting"], "blocks_in_use_after_drain": d["blocks_in_use"]}
    out = {k: {"value": v, "ok": v == 0} for k, v in zero.items()}
    drift = rss["drift"]
    out["rss_drift"] = {"value": drift, "max": max_drift, "ok": drift is not None and drift <= max_drift}
    return out


def print_summary(report: dict) -> None:
    t, c, rss, lat = report["totals"], report["canaries"], report["rss"], report["latency_soak_phase"]
    print("{s:{c}^64}".format(s=" Soak Result ", c="="))
    for name in ("sent", "accepted", "completed", "disconnected_mid_stream", "cancelled_before_first_token",
                 "malformed_sent", "burst_sent", "burst_503", "streams"):
        print(f"{name:<40}{t[name]:>24}")
    print(f"{'rejected by status':<40}{str(t['rejected_by_status']):>24}")
    print(f"{'canaries compared / rejected':<40}{c['compared']:>18} / {c['rejected']:>3}")
    mib = [f"{v / 2**20:.1f}" if v else "-" for v in (rss["start_bytes"], rss["after_warmup_bytes"],
                                                       rss["after_drain_bytes"])]
    print(f"{'server RSS MiB start / warm / drained':<40}{' / '.join(mib):>24}")
    for k, v in lat.items():
        print(f"{k + ' (soak phase)':<40}{'-' if v is None else v:>24}")
    for k, v in report["unexpected_status"].items():
        print(f"unexpected status: {k} x{v}")
    print("-" * 64)
    for name, chk in report["checks"].items():
        print(f"{name:<40}{str(chk['value']):>18}  {'ok' if chk['ok'] else 'FAIL'}")
    print("=" * 64)


def plot_soak(report: dict, path: str) -> None:
    from matplotlib.figure import Figure

    rows = report["windows"]
    mid = [(r["start_s"] + r["end_s"]) / 2 for r in rows]
    fig = Figure(figsize=(14, 9), layout="constrained")
    (ttft, itl), (counts, server) = fig.subplots(2, 2)
    for ax, key, title in ((ttft, "ttft", "TTFT (streams)"), (itl, "itl", "ITL (single-choice streams)")):
        for q, style in (("p50", "-o"), ("p99", "--s")):
            pts = [(x, r[f"{q}_{key}_ms"]) for x, r in zip(mid, rows, strict=True) if r[f"{q}_{key}_ms"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, markersize=3, label=q)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log scale)")
        ax.set_title(f"{title} per window of {rows[0]['end_s']:.0f} s")
    width = rows[0]["end_s"] * 0.9
    bottom = [0] * len(rows)
    for key, color in (("completed", "tab:green"), ("abandoned", "tab:gray"), ("rejected_4xx", "tab:orange"),
                       ("rejected_503", "tab:red")):
        vals = [r[key] for r in rows]
        counts.bar(mid, vals, width, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    counts.set_ylabel("requests sent in the window")
    counts.set_title("outcomes by the time the request was sent")
    samples = [s for s in report["metrics_samples"] if "rss_bytes" in s]
    server.plot([s["s"] for s in samples], [s["rss_bytes"] / 2**20 for s in samples], "-", color="tab:purple",
                label="server RSS (MiB)")
    server.set_ylabel("RSS (MiB)")
    kv = server.twinx()
    kv.plot([s["s"] for s in samples], [100 * s.get("kv_usage", 0) for s in samples], ":", color="tab:blue",
            label="KV blocks in use (%)")
    kv.set_ylabel("KV blocks in use (%)")
    server.set_title("server /metrics samples")
    soak_start = report["phases"]["soak_start_s"]
    for ax in (ttft, itl, counts, server):
        ax.axvline(soak_start, color="black", linewidth=0.8, linestyle="--")
        for _, at in report["settings"]["bursts"]:
            ax.axvline(soak_start + at, color="tab:red", linewidth=0.8, linestyle=":")
        ax.set_xlabel("seconds since the soak began (dashed: warm-up ends; dotted red: bursts)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    kv.legend(fontsize=8, loc="upper right")
    t, ok = report["totals"], all(c["ok"] for c in report["checks"].values())
    fig.suptitle(f"pagellm bench soak: {report['model']}, {report['settings']['duration_s']:.0f} s at "
                 f"{report['settings']['rate']}/s on {report['machine'].get('cpu_model')}\n"
                 f"sent {t['sent']}, completed {t['completed']}, rejected {t['rejected_by_status']}, "
                 f"lost {t['lost']}, 5xx {t['server_errors_5xx']}, canary mismatches "
                 f"{report['canaries']['mismatches']}, RSS drift {report['rss']['drift']}: "
                 f"{'all checks pass' if ok else 'CHECKS FAIL'}", fontsize=10)
    fig.savefig(path, dpi=100)
