"""One prompt of N random tokens at a time (default 2048, six prompts), max_tokens 1, under --dtype auto: marked
prompt chunks through the paged kernel row by row (CpuPagedAttention._paged_prompts, on AVX2) against float32 SDPA
(the same engine with _paged_prompts returning None), alternating, median and best seconds. KV: the auto cache, or
the --kv-cache-dtype given second. The forty-first session's figures in benchmarks/NOTES.md come from

    PAGELLM_CPU_ISA=avx2 OPENBLAS_CORETYPE=Haswell env -u OPENBLAS_L2_SIZE \\
        .venv/bin/python benchmarks/prompt_attention_ab.py 2048      (and 512)
"""

import random
import statistics
import sys
import time

from pagellm import LLM, SamplingParams
from pagellm.model.attention.cpu_paged import CpuPagedAttention


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    kv = {"kv_cache_dtype": sys.argv[2]} if len(sys.argv) > 2 else {}
    llm = LLM(None, dtype="auto", enable_prefix_caching=False, **kv)
    rnd = random.Random(1)
    prompts = [{"prompt_token_ids": [rnd.randrange(1000, 20000) for _ in range(n)]} for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=1)
    paged = CpuPagedAttention._paged_prompts
    modes = {"paged": paged, "sdpa": lambda self, meta: None}
    seconds = {name: [] for name in modes}
    for i, prompt in enumerate(prompts):
        for name in sorted(modes, reverse=i % 2 == 1):
            CpuPagedAttention._paged_prompts = modes[name]
            t = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - t)
    CpuPagedAttention._paged_prompts = paged
    for name, s in seconds.items():
        print(f"{n} tokens, {name}: median {statistics.median(s):.3f} s, best {min(s):.3f}", flush=True)


if __name__ == "__main__":
    main()
