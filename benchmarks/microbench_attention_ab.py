"""Two builds of the native paged-attention kernel side by side in one process, calls alternating, so that the
machine's drift (5-25% between minutes on the shared VMs) falls on both alike. Decode rows over caches that
are out of the L3 cache (as many layers' caches in turn as make ~240 MB), their blocks in order and in random
order, each row at a random position in [keys / 2, keys). SmolLM2's shapes (9 query heads, 3 KV heads,
head_dim 64, 16-token blocks). Milliseconds per cache, median of 15 rounds.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/microbench_attention_ab.py \\
        OLD.so NEW.so [--cases 64x300:int8 16x1000:float16 ...]

Each library is the kernel build of one source version: check the sources out, then
`.venv/bin/python -c "from pagellm.kernels import ops; print(ops.library()._name)"` prints the cached
library's path (copy it aside; PAGELLM_CPU_ARCH=haswell builds the AVX2 variant). Run it alone: the machine
has 2 cores. The figures in benchmarks/NOTES.md (twenty-fourth session) come from it.
"""

import argparse
import ctypes
import time

import torch

from pagellm.kernels import ops
from pagellm.quant.kv_cache import quantize_rows

BS, KV, H, D = 16, 3, 9, 64
CACHE_BYTES = 240e6  # per case, over its caches: well past the L3 cache
ROUNDS = 15
DTYPES = {"int8": torch.int8, "float16": torch.float16, "float32": torch.float32}


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.pagellm_paged_attention.argtypes = ops.library().pagellm_paged_attention.argtypes
    lib.pagellm_paged_attention.restype = ops.library().pagellm_paged_attention.restype
    return lib


def case(libs: list[ctypes.CDLL], rows: int, keys: int, dtype: torch.dtype, order: str) -> list[float]:
    per = -(-keys // BS)
    blocks = torch.arange(rows * per) if order == "in order" else torch.randperm(rows * per)
    table = blocks.reshape(rows, per).contiguous()
    pos, seq, q = torch.randint(keys // 2, keys, (rows,)), torch.arange(rows), torch.randn(rows, H, D)

    def cache() -> torch.Tensor:
        c = torch.randn(2, rows * per, BS, KV, D)
        return quantize_rows(c, dtype) if dtype == torch.int8 else c.to(dtype)

    caches = [cache()]
    caches += [cache() for _ in range(max(1, int(CACHE_BYTES // (caches[0].numel() * caches[0].element_size()))))]
    out = torch.empty(rows, H, D)

    def run(lib: ctypes.CDLL) -> float:
        t = time.perf_counter()
        for c in caches:
            rc = lib.pagellm_paged_attention(
                q.data_ptr(), q.stride(0), rows, H, D, c.data_ptr(), c.shape[1], BS, KV, table.data_ptr(),
                table.stride(0), seq.data_ptr(), pos.data_ptr(), 0, 0.125, out.data_ptr(), torch.get_num_threads(),
                ops.kv_format_code(c.dtype))
            if rc:
                raise SystemExit(f"the kernel refused {dtype} (rc {rc})")
        return (time.perf_counter() - t) / len(caches) * 1e3

    times: list[list[float]] = [[], []]
    for r in range(ROUNDS):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            times[i].append(run(libs[i]))
    return [sorted(t)[len(t) // 2] for t in times]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--cases", nargs="+", default=["64x300:int8", "64x100:int8", "16x1000:int8", "4x8000:int8",
                                                    "64x300:float16", "16x1000:float16"])
    args = ap.parse_args()
    libs = [load(args.old), load(args.new)]
    for spec in args.cases:
        shape, dtype = spec.split(":")
        rows, keys = (int(v) for v in shape.split("x"))
        for order in ("in order", "random"):
            old, new = case(libs, rows, keys, DTYPES[dtype], order)
            print(f"{rows} rows x {keys} keys, {dtype} KV, blocks {order}: {old:.3f} -> {new:.3f} ms per cache "
                  f"({old / new:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
