"""Speculation against plain decoding on long prompts that share steps with decode rows: BATCH prompts of
300-700 tokens of English text (pagellm.bench.workload.text_prompts, as tests/test_spec_decode.py), 32
greedy tokens each, plain once, then n-gram k = 4 and k = 16 without adaptive drafting; prints the sequences that
parted and how far the first token's logprob moved (a prompt computed differently in the two runs). The
thirty-ninth session's figures in benchmarks/NOTES.md (8 and 16 prompts) come from:

    .venv/bin/python benchmarks/spec_long_prompts.py 8
    .venv/bin/python benchmarks/spec_long_prompts.py 16

the forty-first session's (an AVX2 CPU stood in) from
    PAGELLM_CPU_ISA=avx2 OPENBLAS_CORETYPE=Haswell .venv/bin/python benchmarks/spec_long_prompts.py 16
"""

import sys

from pagellm import LLM, SamplingParams
from pagellm.bench.workload import text_prompts


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    opts = dict(dtype="auto", enable_prefix_caching=False, kv_cache_memory="512MiB")
    plain = LLM(**opts)
    prompts = [{"prompt_token_ids": p} for p in text_prompts(plain.get_tokenizer(), batch, (300, 700), seed=3)]
    base = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.shutdown()
    for k in (4, 16):
        spec = LLM(**opts, speculative_method="ngram", num_speculative_tokens=k, speculative_adaptive=False)
        out = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
        parted = [i for i in range(batch) if out[i].token_ids != base[i].token_ids]
        # the first token comes from the prompt alone: its logprob moves only if the prompt's rows did
        first = max(abs(a.logprobs[0][a.token_ids[0]].logprob - b.logprobs[0][a.token_ids[0]].logprob)
                    for a, b in zip(base, out, strict=True) if a.token_ids[0] == b.token_ids[0])
        print(f"batch {batch}, k = {k}: {len(parted)} of {batch} parted {parted}, "
              f"{spec.engine.scheduler.stats.num_accepted_tokens} drafts accepted; the first token's logprob "
              f"moved by up to {first:.1e} nats", flush=True)
        spec.shutdown()


if __name__ == "__main__":
    main()
