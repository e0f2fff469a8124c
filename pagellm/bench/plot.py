"""Charts of benchmark reports (matplotlib, imported only here; install the `dev` extra).

Built on `matplotlib.figure.Figure` rather than pyplot, so drawing keeps no global state and needs no
display.
"""

from __future__ import annotations

LATENCY_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E"}
COLORS = {"ttft": "tab:blue", "tpot": "tab:orange", "itl": "tab:green", "e2el": "tab:red"}


def percentile_bars(ax, results: dict, keys=tuple(LATENCY_LABELS), stats=("median", "p90", "p99")) -> None:
    """Grouped bars: one group per latency metric, one bar per percentile; log scale, since TTFT and
    E2E are often 100x TPOT and ITL."""
    width = 0.8 / len(stats)
    shades = (0.45, 0.7, 1.0)
    for i, key in enumerate(keys):
        for j, stat in enumerate(stats):
            value = results[f"{stat}_{key}_ms"]
            x = i + (j - (len(stats) - 1) / 2) * width
            ax.bar(x, max(value, 1e-3), width, color=COLORS[key], alpha=shades[j % len(shades)],
                   edgecolor="black", linewidth=0.5)
            ax.annotate(_fmt_ms(value), (x, max(value, 1e-3)), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(keys)), [LATENCY_LABELS[k] for k in keys])
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_title("latency percentiles: " + " / ".join("p50" if s == "median" else s for s in stats)
                 + " (light to dark)")
    ax.grid(axis="y", which="major", alpha=0.3)


def latency_timeline(ax, requests: list[dict], slos: dict | None = None) -> None:
    """Each request's TTFT, TPOT and E2E latency at the time it was sent, with the SLOs as dashed
    lines: queueing under load shows as a rising trend."""
    ok = [r for r in requests if r.get("e2el_ms") is not None]
    for key in ("e2el", "ttft", "tpot"):
        ax.scatter([r["start_s"] for r in ok], [max(r[f"{key}_ms"], 1e-3) for r in ok], s=14,
                   color=COLORS[key], label=LATENCY_LABELS[key], alpha=0.8)
        if slos and key in slos:
            ax.axhline(slos[key], color=COLORS[key], linestyle="--", linewidth=1,
                       label=f"{LATENCY_LABELS[key]} SLO")
    failed = [r["start_s"] for r in requests if r.get("e2el_ms") is None]
    if failed:
        ax.scatter(failed, [1.0] * len(failed), marker="x", color="black", label="failed")
    ax.set_yscale("log")
    ax.set_xlabel("request sent at (s since start)")
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_title("per-request latency over the run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def plot_serve(report: dict, path: str) -> None:
    from matplotlib.figure import Figure

    res = report["results"]
    fig = Figure(figsize=(13, 5), layout="constrained")
    left, right = fig.subplots(1, 2)
    percentile_bars(left, res)
    latency_timeline(right, report["requests"], report.get("goodput_slo_ms"))
    goodput = res.get("request_goodput")
    fig.suptitle(f"pagellm bench serve: {report['model']}, {report['num_prompts']} prompts, "
                 f"rate {report['request_rate']}/s, burstiness {report['burstiness']}, "
                 f"max concurrency {report['max_concurrency'] or 'inf'}\n"
                 f"{res['request_throughput']:.2f} req/s"
                 + (f" (goodput {goodput:.2f})" if goodput is not None else "")
                 + f", {res['output_throughput']:.1f} output tok/s, "
                 f"{res['completed']} ok / {res['failed']} failed in {res['duration']:.1f} s", fontsize=10)
    fig.savefig(path, dpi=110)


def _fmt_ms(ms: float) -> str:
    return f"{ms / 1000:.2f}s" if ms >= 1000 else f"{ms:.0f}" if ms >= 10 else f"{ms:.1f}"
