"""The decode step's small native ops alone, 2 threads, milliseconds (median of 7): `silu_mul` on a bf16 gate/up
of 2,048 x 2 x 1,536 (a prefill step's MLP), and the sampler's greedy pick over 1 / 33 / 64 rows of 49,152
float32 logits, `ops.argmax_rows` against torch's `max(dim).indices` (what `sample/logprobs.argmax_rows` ran
before). The figures in benchmarks/NOTES.md (seventeenth session) come from this build and from an AVX2-only one
of the same sources (its `silu_mul_bf16` is the 8-lane loop the AVX-512 one replaced, with the same bits):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/microbench_small_ops.py
    PAGELLM_CPU_ARCH=haswell PAGELLM_CACHE_DIR=/tmp/pagellm-haswell env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
        .venv/bin/python benchmarks/microbench_small_ops.py

Run it alone: the machine has 2 cores.
"""

import torch
from timing import median_ms

from pagellm.kernels import ops
from pagellm.kernels.build import build_info


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    print("kernel paths:", " ".join(build_info()["paths"]))
    gate_up = (torch.randn(2048, 2 * 1536) * 4).to(torch.bfloat16)
    print(f"silu_mul bf16 2,048 x 1,536: {median_ms(lambda: ops.silu_mul(gate_up)):.3f} ms")
    for rows in (1, 33, 64):
        logits = torch.randn(rows, 49152)
        torch_ms = median_ms(lambda x=logits: x.max(dim=-1).indices)
        native_ms = median_ms(lambda x=logits: ops.argmax_rows(x))
        print(f"argmax {rows} x 49,152: torch max(dim) {torch_ms:.3f} ms, native {native_ms:.3f} ms")


if __name__ == "__main__":
    main()
