"""One layer's paged attention for a prompt of N rows (default 2048) in one chunk: SmolLM2's shape (9 query heads on
3 KV heads, head size 64, 16-token blocks in random order), each KV format given (f16, f32, i8), median and best of 6
calls after one warm-up, milliseconds. Many-row steps take the grouped paths (attention_grouped.h on AVX-512 builds,
attention_grouped8.h on AVX2 builds). To compare two versions of the kernels, run it from each tree in turn with
PYTHONPATH set to that tree. The forty-second session's figures in benchmarks/NOTES.md come from

    PAGELLM_CPU_ISA=avx2 PYTHONPATH=TREE .venv/bin/python benchmarks/microbench_grouped_attention.py 2048 f16,f32,i8
    (and without PAGELLM_CPU_ISA for the native build); the per-head path: the tree of commit 2bfa4c2~1
"""

import statistics
import sys
import time

import torch

from pagellm.kernels import ops
from pagellm.quant.kv_cache import quantize_rows

DTYPES = {"f16": torch.float16, "f32": torch.float32, "i8": torch.int8}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else list(DTYPES)
    kv_heads, heads, d, bs = 3, 9, 64, 16
    torch.manual_seed(0)
    out = []
    for name in kinds:
        dt = DTYPES[name]
        nb = n // bs + 2
        values = torch.randn(2, nb, bs, kv_heads, d)
        cache = quantize_rows(values, dt) if dt == torch.int8 else values.to(dt)
        table = torch.randperm(nb)[: -(-n // bs)].reshape(1, -1)
        q, pos, seq = torch.randn(n, heads, d), torch.arange(n), torch.zeros(n, dtype=torch.long)
        ms = []
        for _ in range(7):
            t = time.perf_counter()
            ops.paged_attention(q, cache, table, seq, pos, None, 0.125)
            ms.append((time.perf_counter() - t) * 1e3)
        out.append(f"{name} median {statistics.median(ms[1:]):.1f} best {min(ms[1:]):.1f}")
    print(f"{n} rows, one layer ({ops.__file__.rsplit('/pagellm/', 1)[0]}): " + " | ".join(out))


if __name__ == "__main__":
    main()
