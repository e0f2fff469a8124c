"""`pagellm plan` tables for Llama-3-8B/70B on H100 and H200 at TP 1/2/4/8 (bf16 weights and KV, 8,192-token
sequences): writes benchmarks/results/plan_tables.json and .md. Pure arithmetic, runs anywhere:
    .venv/bin/python benchmarks/plan_tables.py
"""

from __future__ import annotations

import json
from pathlib import Path

from pagellm.plan import plan_memory
from pagellm.plan.presets import GPUS, preset_config

OUT = Path(__file__).parent / "results"


def main() -> None:
    rows = []
    for model in ("llama-3-8b", "llama-3-70b"):
        cfg = preset_config(model)
        for gpu in ("h100-80gb", "h200-141gb"):
            for tp in (1, 2, 4, 8):
                p = plan_memory(cfg, model, GPUS[gpu], tp=tp, dtype="bfloat16", max_model_len=8192)
                rows.append({"gpu": gpu, **p.to_dict()})
    (OUT / "plan_tables.json").write_text(json.dumps({"command": "python benchmarks/plan_tables.py",
                                                      "rows": rows}, indent=1))
    lines = ["| model | GPU | TP | weights/rank GB | KV/token/rank B | KV GB/rank | KV tokens | seqs @8192 | fits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['gpu']} | {r['tensor_parallel_size']} "
                     f"| {r['weights_bytes_per_rank'] / 1e9:.2f} "
                     f"| {r['kv_bytes_per_token_per_rank']} | {max(0, r['kv_cache_bytes_per_rank']) / 1e9:.1f} "
                     f"| {r['kv_tokens']} | {r['max_batch_at_max_model_len']} | {'yes' if r['fits'] else 'no'} |")
    (OUT / "plan_tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
