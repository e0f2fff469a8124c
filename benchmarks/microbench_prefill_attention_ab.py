"""Two builds of the bf16 prefill-attention kernel side by side in one process, calls alternating, so that the
machine's drift falls on both alike (the decode kernel's twin: microbench_attention_ab.py): the vdpbf16ps items
(`ops.prefill_attention_bf16(tiles=False)`), or with --tiles the AMX items. Whole prompts of SmolLM2's shapes (9
query heads, 3 KV heads, head_dim 64, 16-token blocks in order), a float16 or int8 cache. Milliseconds, the
minimum and the median of the rounds, and new / old.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/microbench_prefill_attention_ab.py \\
        OLD.so NEW.so [--cases 272:float16 2048:int8 ...] [--tiles]

Each library is the kernel build of one source version (`.venv/bin/python -c "from pagellm.kernels import ops;
print(ops.library()._name)"` prints the cached library's path; copy it aside). Run it alone: the machine has 2
cores. The figures in benchmarks/NOTES.md (twenty-fifth and thirty-first sessions) come from it.
"""

import argparse
import ctypes
import statistics
import time

import torch

from pagellm.kernels import ops
from pagellm.quant.kv_cache import quantize_rows

BS, KV, H, D = 16, 3, 9, 64
DTYPES = {"int8": torch.int8, "float16": torch.float16}


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    fn, ref = lib.pagellm_prefill_attention_bf16, ops.library().pagellm_prefill_attention_bf16
    fn.argtypes, fn.restype = ref.argtypes, ref.restype
    return lib


def cache_of(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    blocks = -(-tokens // BS)
    kv = torch.randn(2, blocks, BS, KV, D)
    return quantize_rows(kv, dtype) if dtype == torch.int8 else kv.to(dtype)


def case(libs: list[ctypes.CDLL], tokens: int, dtype: torch.dtype, rounds: int, tiles: bool) -> list[list[float]]:
    cache = cache_of(tokens, dtype)
    table = torch.arange(cache.shape[1], dtype=torch.int64)
    q = torch.randn(tokens, H, D)
    out = torch.empty(tokens, H, D)
    outs = []
    times: list[list[float]] = [[] for _ in libs]
    for r in range(rounds + 1):
        for i, lib in enumerate(libs):
            t0 = time.perf_counter()
            rc = lib.pagellm_prefill_attention_bf16(
                q.data_ptr(), q.stride(0), tokens, H, D, cache.data_ptr(), cache.shape[1], BS, KV, table.data_ptr(),
                tokens, D ** -0.5, out.data_ptr(), H * D, torch.get_num_threads(), ops.kv_format_code(dtype),
                int(tiles))
            elapsed = time.perf_counter() - t0
            if rc:
                raise SystemExit(f"library {i} refused the case")
            if r == 0:
                outs.append(out.clone())
            else:
                times[i].append(elapsed * 1e3)
    diff = (outs[0] - outs[-1]).abs().max().item()
    print(f"  (largest difference between the builds' outputs: {diff:.3g})")
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("libs", nargs=2, metavar="LIB.so")
    p.add_argument("--cases", nargs="+", default=["128:float16", "272:float16", "512:float16", "2048:float16",
                                                  "272:int8", "2048:int8"])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--tiles", action="store_true", help="the AMX items (where the CPU and the builds have them)")
    ns = p.parse_args()
    torch.manual_seed(0)
    libs = [load(path) for path in ns.libs]
    for spec in ns.cases:
        tokens, dtype = spec.split(":")
        rounds = ns.rounds if int(tokens) < 1024 else max(5, ns.rounds // 3)
        old, new = case(libs, int(tokens), DTYPES[dtype], rounds, ns.tiles)
        print(f"{tokens} tokens, {dtype}: min {min(old):.3f} -> {min(new):.3f} ms ({min(old) / min(new):.2f}x), "
              f"median {statistics.median(old):.3f} -> {statistics.median(new):.3f} ms "
              f"({statistics.median(old) / statistics.median(new):.2f}x)", flush=True)


if __name__ == "__main__":
    main()
