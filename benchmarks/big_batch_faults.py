"""256 requests of 32 prompt tokens x 64 greedy tokens in one engine with max_num_seqs 256 (decode steps of 256 rows,
whose float32 logits are 48 MiB), with glibc's mmap threshold as loading() leaves it (128) or at its old 32 MiB (32):
wall time, output tok/s, minor page faults and peak RSS. The forty-third session's figures (benchmarks/NOTES.md)
come from, alternating:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/big_batch_faults.py 32|128
"""

import random
import resource
import sys
import time

from pagellm import LLM, SamplingParams
from pagellm.platforms.cpu_memory import M_MMAP_THRESHOLD, mallopt

llm = LLM(None, dtype="auto", max_num_seqs=256, enable_prefix_caching=False)
if sys.argv[1] == "32":
    mallopt(M_MMAP_THRESHOLD, 32 << 20)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(32)]} for _ in range(256)]
sp = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
llm.generate(prompts[:8], sp)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = time.perf_counter()
outs = llm.generate(prompts, sp)
dt = time.perf_counter() - t
f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
n = sum(len(o.outputs[0].token_ids) for o in outs)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(f"mmap threshold {sys.argv[1]} MiB: 256 requests x 64 tokens, {dt:.2f} s, {n / dt:.1f} output tok/s, "
      f"{f1 - f0} faults, peak RSS {rss:.2f} GiB", flush=True)
