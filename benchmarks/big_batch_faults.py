"""Steps with many sampling rows under glibc's mmap threshold as loading() leaves it (128) or at its old 32 MiB
(32). SmolLM2's float32 logits pass 32 MiB from 164 rows; at the old threshold each step mapped them anew.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/big_batch_faults.py 32|128 [head]

By default: 256 requests of 32 prompt tokens x 64 greedy tokens in one engine with max_num_seqs 256 (decode steps of
256 rows): wall time, output tok/s, minor page faults and peak RSS. head: the logits head alone at 128, 192 and 256
rows, bf16 rows in, as `--dtype auto` calls it (on AMX tiles where the platform chose them, float32 out), against
oneDNN's bf16 product on the bf16 copy plus its float32 cast; median of 9 calls and the page faults a call. The
forty-third session's figures (benchmarks/NOTES.md) come from these, alternating 32 and 128.
"""

import random
import resource
import statistics
import sys
import time

import torch

from pagellm import LLM, SamplingParams
from pagellm.platforms.cpu_memory import M_MMAP_THRESHOLD, mallopt


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def workload(llm: LLM, threshold: str) -> None:
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(32)]} for _ in range(256)]
    sp = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    llm.generate(prompts[:8], sp)
    f0, t = faults(), time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt, f1 = time.perf_counter() - t, faults()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"mmap threshold {threshold} MiB: 256 requests x 64 tokens, {dt:.2f} s, {n / dt:.1f} output tok/s, "
          f"{f1 - f0} faults, peak RSS {rss:.2f} GiB", flush=True)


def head(llm: LLM, threshold: str) -> None:
    lm_head = llm.engine.model.lm_head
    method = lm_head.quant_method

    def timed(fn) -> tuple[float, float]:
        ms, f0 = [], faults()
        for _ in range(9):
            t = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ms), (faults() - f0) / 9

    for rows in (128, 192, 256):
        x = torch.randn(rows, lm_head.in_features).to(torch.bfloat16)
        path_ms, path_faults = timed(lambda x=x: lm_head(x))
        line = f"mmap threshold {threshold} MiB, head at {rows} rows: as the engine calls it {path_ms:.2f} ms " \
               f"({path_faults:.0f} faults a call)"
        if lm_head.weight_bf16 is not None:
            onednn_ms, _ = timed(lambda x=x: method.bf16_matmul(lm_head, x).float())
            line += f", oneDNN bf16 + float32 cast {onednn_ms:.2f} ms"
        print(line, flush=True)


def main() -> None:
    threshold = sys.argv[1]
    llm = LLM(None, dtype="auto", max_num_seqs=256, enable_prefix_caching=False)
    if threshold == "32":
        mallopt(M_MMAP_THRESHOLD, 32 << 20)
    (head if sys.argv[2:] == ["head"] else workload)(llm, threshold)


if __name__ == "__main__":
    main()
