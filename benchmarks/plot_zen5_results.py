"""Draws benchmarks/results/zen5/summary.png from the JSON reports in that folder: the platform-layer
refactor's offline throughput and batch-1 decode, before (50d21be) and after, run by run; n-gram
speculation's speed-up by batch size with every draft verified vs adaptive drafting; offline throughput
with --dtype float32 vs auto.

    .venv/bin/python benchmarks/plot_zen5_results.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DIR = Path(__file__).parent / "results" / "zen5"


def load(name: str) -> dict:
    return json.loads((DIR / f"{name}.json").read_text())


def main() -> None:
    fig, (a, b, c, d) = plt.subplots(1, 4, figsize=(20, 4))
    runs = range(1, 5)
    old = [load(f"refactor_old_tp_{i}")["results"][0]["output_tokens_per_s"] for i in runs]
    new = [load(f"refactor_new_tp_{i}")["results"][0]["output_tokens_per_s"] for i in runs]
    xs = list(runs)
    a.bar([x - 0.2 for x in xs], old, 0.4, label="before (50d21be)")
    a.bar([x + 0.2 for x in xs], new, 0.4, label="after")
    a.set(title="offline throughput (64 requests)", xlabel="pair (run in turn)", ylabel="output tok/s", xticks=xs)
    a.legend()
    lat_old = [load(f"refactor_old_lat_{i}")["results"][0]["baseline"]["decode_tok_s"] for i in (1, 2)]
    lat_new = [load(f"refactor_new_lat_{i}")["results"][0]["baseline"]["decode_tok_s"] for i in (1, 2)]
    b.bar([0.8, 1.8], lat_old, 0.4, label="before")
    b.bar([1.2, 2.2], lat_new, 0.4, label="after")
    b.set(title="batch-1 decode (128-token prompt, 256 out)", xlabel="pair", ylabel="decode tok/s", xticks=[1, 2])
    b.legend()
    for name, style in [("always_grounded", "o--"), ("adaptive_grounded", "o-"), ("always_random", "s--"),
                        ("adaptive_random", "s-")]:
        rows = load(f"ngram_{name}")["results"]
        c.plot([str(r["batch_size"]) for r in rows], [r["speculative"]["speedup"] for r in rows], style,
               label=name.replace("_", ", "))
    c.axhline(1.0, color="gray", lw=0.8)
    c.set(title="n-gram K=4 speed-up over plain decoding", xlabel="batch size", ylabel="speed-up")
    c.legend()
    f32 = [load(f"dtype_float32_tp_{i}")["results"][0]["output_tokens_per_s"] for i in (1, 2)]
    auto = [load(f"dtype_auto_tp_{i}")["results"][0]["output_tokens_per_s"] for i in (1, 2)]
    d.bar([0.8, 1.8], f32, 0.4, label="--dtype float32")
    d.bar([1.2, 2.2], auto, 0.4, label="--dtype auto (bf16 many-row GEMMs)")
    d.set(title="offline throughput by dtype", xlabel="pair", ylabel="output tok/s", xticks=[1, 2])
    d.legend()
    fig.suptitle("2-core AMD EPYC Zen 5 (family 26), AVX-512 F/BW/BF16/VNNI, float32, SmolLM2-135M Q4_1")
    fig.tight_layout()
    fig.savefig(DIR / "summary.png", dpi=110)
    print(f"wrote {DIR / 'summary.png'}")


if __name__ == "__main__":
    main()
