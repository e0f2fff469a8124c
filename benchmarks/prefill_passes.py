"""The twenty-ninth session's prefill figures (benchmarks/NOTES.md): 64 random prompts of 256 tokens, one output
token each, prefix caching off, `--dtype auto`: eight steps of 2,048 prompt tokens.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/prefill_passes.py steps
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/prefill_passes.py best [N]
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/prefill_passes.py norm

steps: the wall time of each module's calls summed over one run of the workload (where a 2,048-token step goes);
best: the workload N times (default 10) in one engine, best and median seconds (A/B of a change: builds in turn);
norm: a [2,048, 576] norm and its cast to bf16 against ops.rmsnorm_to_bf16, microseconds per call.
"""

import collections
import statistics
import sys
import time

import torch


def _engine():
    from pagellm import LLM, SamplingParams
    from pagellm.bench.workload import random_workload

    llm = LLM(None, enable_prefix_caching=False, dtype="auto")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    workload = random_workload(64, llm.engine.model_config.vocab_size, (256, 256), (1, 1), 0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return lambda: llm.generate([r.prompt_token_ids for r in workload], [params] * 64, use_tqdm=False)


def steps() -> None:
    from pagellm.model.attention import base
    from pagellm.model.layers import activation, linear, norm, rotary

    spent, calls, on = collections.defaultdict(float), collections.Counter(), [False]

    def timed(cls, name, label):
        fn = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            if not on[0]:
                return fn(self, *args, **kwargs)
            t = time.perf_counter()
            out = fn(self, *args, **kwargs)
            key = label(self)
            spent[key] += time.perf_counter() - t
            calls[key] += 1
            return out

        setattr(cls, name, wrapper)

    timed(linear.Linear, "forward", lambda s: f"linear {s.in_features}->{s.out_features}")
    timed(norm.RMSNorm, "forward_cpu", lambda s: "rmsnorm")
    timed(activation.SiluAndMul, "forward_cpu", lambda s: "silu_mul")
    timed(rotary.RotaryEmbedding, "forward_cpu", lambda s: "rope (within attention)")
    timed(base.AttentionBackend, "forward_qkv", lambda s: "attention: rope, KV write, attend")
    run = _engine()
    run()
    on[0] = True
    t = time.perf_counter()
    run()
    print(f"workload {time.perf_counter() - t:.3f} s")
    for key, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"{s * 1e3:8.1f} ms {calls[key]:5d} calls  {key}")


def best(n: int) -> None:
    run = _engine()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    print(f"16,384 prompt tokens: best {min(times):.3f} s, median {statistics.median(times):.3f} s")


def norm_microbench() -> None:
    from pagellm.kernels import ops

    torch.set_num_threads(2)
    x, residual, weight = torch.randn(2048, 576).bfloat16(), torch.randn(2048, 576), torch.randn(576)

    def us(fn, n=200):
        for _ in range(10):
            fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    print(f"norm then cast {us(lambda: ops.add_bf16_rmsnorm(x, residual, weight, 1e-5).bfloat16()):.0f} us, "
          f"rmsnorm_to_bf16 {us(lambda: ops.rmsnorm_to_bf16(x, residual, weight, 1e-5)):.0f} us")


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "steps"
    if mode == "steps":
        steps()
    elif mode == "best":
        best(int(sys.argv[2]) if len(sys.argv) > 2 else 10)
    elif mode == "norm":
        norm_microbench()
    else:
        raise SystemExit(f"unknown mode {mode!r}: steps, best or norm")
