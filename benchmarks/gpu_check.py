"""The GPU check of issue #17: pagellm on one CUDA GPU next to that GPU's own limits, measured on the spot.

    bash benchmarks/gpu_check.sh            # runs the `cuda` tests, then this (see the script)
    python benchmarks/gpu_check.py --help

Steps (about 7-9 minutes on an H200 after the tests):
1. the GPU's limits: HBM bandwidth from a 4 GiB device-to-device copy (bytes read + written per second),
   bf16 matmul TFLOP/s from 8192^3 torch.matmul; the median of 10 timed runs each (CUDA events); then
   attention alone at Llama-3 8B's shapes (benchmarks/gpu_attention.py, in its own process, about a minute
   by estimate: triton_paged, torch SDPA and FlexAttention on 64 decodes x 1,024 keys and a 2,048-token
   prompt; ms, KV GB/s or TFLOP/s and their fractions of the limits; a failing path records its error);
2. random-weight Llama-3 shapes (pagellm/bench/random_model.py: ~1.2B "llama3-1b", 8.0B "llama3-8b"), drawn
   on the GPU in bf16 and written as safetensors to /dev/shm (nothing is downloaded);
3. per model, each run in a fresh process (its GPU memory returned after): W1 (batch-1 decode: a 128-token
   prompt, 256 output tokens; TTFT and decode tok/s, with CUDA graphs and with --enforce-eager) and a W2-style
   offline run scaled to the GPU (default 1,024 requests, prompts 32-512, outputs 16-256, ignore_eos, prefix
   caching off; max_num_seqs 256, max_num_batched_tokens 8192);
4. one JSON in benchmarks/results/gpu/ with every figure next to its bound: batch-1 decode as a fraction of
   the weights-read bound (bandwidth / bytes read per token: every matrix once, plus the KV read), W2 as a
   fraction of the compute bound (the model FLOPs the run did / wall time / measured bf16 TFLOP/s).

Token-id prompts through pagellm's own LLM API; outputs are ignored (random weights) but every token is
sampled, detokenized and checked for stops as in any run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("llama3-1b", "llama3-8b")


# ---- the GPU's limits ----------------------------------------------------------------------------------
def time_cuda(fn, runs: int = 10, warmup: int = 3) -> float:
    """Median seconds of fn() on the GPU (CUDA events around each run)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def copy_seconds(n: int) -> float:
    """A device copy of n bf16 elements (n x 2 bytes read and as many written)."""
    import torch

    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return time_cuda(lambda: dst.copy_(src))


def matmul_seconds(m: int) -> float:
    import torch

    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    return time_cuda(lambda: torch.matmul(a, b), runs=20)


def measure_limits() -> dict:
    import torch

    n, m = 2 * 2**30, 8192  # 4 GiB read and 4 GiB written per copy; 1.1 TFLOP per product
    t_copy, t_mm = copy_seconds(n), matmul_seconds(m)
    torch.cuda.empty_cache()
    return {"hbm_copy_GBps": 2 * n * 2 / t_copy / 1e9, "bf16_matmul_TFLOPs": 2 * m**3 / t_mm / 1e12,
            "how": "bandwidth: 4 GiB bf16 device copy, (read + written bytes) / time; compute: 8192^3 bf16 "
                   "torch.matmul, 2 m^3 / time; medians of CUDA-event timings"}


def run_attention(timeout: int, limits: dict) -> dict:
    """benchmarks/gpu_attention.py in a child process (its compilations and GPU memory go with it); what it
    wrote before a failure or a timeout is kept, with the error."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    result: dict = {}
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "attention", "--json", out],
                           capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if r.returncode:
            result.update(error=f"exit code {r.returncode}", stderr_tail=r.stderr[-4000:])
    except subprocess.TimeoutExpired:
        result["error"] = f"timed out after {timeout} s"
    try:
        with open(out) as f:
            result.update(json.load(f))
    except (OSError, ValueError):
        pass
    os.unlink(out)
    for path in attention_paths(result):
        if "kv_GBps" in path:
            path["fraction_of_hbm_copy"] = path["kv_GBps"] / limits["hbm_copy_GBps"]
        if "TFLOPs" in path:
            path["fraction_of_bf16_matmul"] = path["TFLOPs"] / limits["bf16_matmul_TFLOPs"]
    return result


def attention_paths(result: dict, named: bool = False):
    """Each case's paths' entries (or (case, path, entry) with named)."""
    for case, r in result.items():
        for path, entry in (r.get("paths", {}) if isinstance(r, dict) else {}).items():
            yield (case, path, entry) if named else entry


def attention_summary(result: dict) -> str:
    lines = ["attention" + (f": ERROR {result['error']}" if "error" in result else "")]
    for case, path, r in attention_paths(result, named=True):
        if "ms" not in r:
            lines.append(f"  {case} {path}: ERROR {r.get('error', '?')[:200]}")
            continue
        rate = f"{r['kv_GBps']:.0f} GB/s" if "kv_GBps" in r else f"{r['TFLOPs']:.0f} TFLOP/s"
        lines.append(f"  {case} {path}: {r['ms']:.3f} ms, {rate}")
    return "\n".join(lines)


# ---- the workloads, each in its own process --------------------------------------------------------------
def run_child(model_dir: str, workload: str, options: dict, requests: int, timeout: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "workload", "--model", model_dir, "--name", workload,
           "--options", json.dumps(options), "--requests", str(requests), "--json", out]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "options": options}
    try:
        with open(out) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {"error": f"exit code {r.returncode}", "stderr_tail": r.stderr[-4000:], "options": options}
    finally:
        if os.path.exists(out):
            os.unlink(out)
    startup = [ln for ln in r.stderr.splitlines() if "GPU memory:" in ln or "captured" in ln or "platform:" in ln]
    result.update(process_seconds=round(time.perf_counter() - t0, 1), startup_log=startup)
    return result


def workload_main(ns: argparse.Namespace) -> None:
    """Child process: one engine, one workload, its figures as JSON."""
    import logging

    from pagellm import LLM, SamplingParams
    from pagellm.bench.workload import random_workload

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options = json.loads(ns.options)
    t0 = time.perf_counter()
    llm = LLM(ns.model, device=ns.device, dtype="auto", **options)
    eng = llm.engine
    ready = time.perf_counter() - t0
    cfg = eng.model_config
    llm.generate([[100 + i for i in range(16)]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    result = {"workload": ns.name, "options": options, "ready_s": round(ready, 2),
              "weights_bytes": eng.weights_bytes, "kv_blocks": eng.kv_cache.num_blocks,
              "kv_bytes_per_token": eng.bytes_per_block // eng.kv_cache.block_size,
              "attention_backend": eng.runner.backend.name,
              "decode_graphs": list(getattr(eng.runner.compiled_decoder, "sizes", ()) or ())}
    if ns.name == "w1":
        result.update(w1(eng, cfg))
    else:
        wl = random_workload(ns.requests, cfg.vocab_size, (32, 512), (16, 256), seed=0)
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in wl]
        t = time.perf_counter()
        outs = llm.generate([r.prompt_token_ids for r in wl], params, use_tqdm=False)
        wall = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(r.prompt_token_ids) for r in wl)
        result.update(requests=len(wl), prompt_tokens=n_in, output_tokens=n_out, wall_s=round(wall, 2),
                      output_tok_s=n_out / wall, total_tok_s=(n_in + n_out) / wall,
                      model_flops=workload_flops(cfg, [(len(r.prompt_token_ids), r.output_len) for r in wl]),
                      preemptions=eng.scheduler.stats.num_preemptions)
    kv = eng.kv_cache
    result["kv_blocks_free_after"] = kv.pool.num_free
    with open(ns.json, "w") as f:
        json.dump(result, f, indent=1)


def w1(eng, cfg, runs: int = 3) -> dict:
    """Batch-1 decode: a 128-token prompt, 256 output tokens; TTFT and decode tok/s (tokens after the first
    over the time after the first), medians of `runs`."""
    from pagellm import SamplingParams

    ttft, decode = [], []
    for i in range(runs):
        prompt = [(1000 + 37 * (j + i)) % cfg.vocab_size for j in range(128)]
        t0 = time.perf_counter()
        eng.add_request(f"w1-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True))
        first = None
        n = 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                n = len(out.outputs[0].token_ids)
                if first is None and n:
                    first = time.perf_counter()
        end = time.perf_counter()
        ttft.append(first - t0)
        decode.append((n - 1) / (end - first))
    return {"ttft_ms": 1000 * statistics.median(ttft), "decode_tok_s": statistics.median(decode),
            "decode_tok_s_runs": decode}


def workload_flops(cfg, lengths: list[tuple[int, int]]) -> float:
    """The model FLOPs of a run: 2 x the layers' matrix parameters per token computed (prompt and output
    tokens but the last), 2 x the LM head's per sampled token, and attention's QK^T and PV: 4 x heads x
    head_dim per layer per (query, key) pair."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_token = 2 * layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size)
    flops = 0.0
    for prompt, output in lengths:
        tokens = prompt + output - 1  # the last sampled token is never fed back
        pairs = tokens * (tokens + 1) / 2  # token at position p attends to p + 1 keys
        flops += per_token * tokens + 2 * h * cfg.vocab_size * output + 4 * layers * q * pairs
    return flops


# ---- the report ----------------------------------------------------------------------------------------
def bounds(model: dict, cfg, limits: dict) -> None:
    """Adds each workload's fraction of its bound, in place."""
    bw, peak = limits["hbm_copy_GBps"] * 1e9, limits["bf16_matmul_TFLOPs"] * 1e12
    for key in ("w1", "w1_eager"):
        r = model.get(key, {})
        if "decode_tok_s" not in r:
            continue
        # every matrix is read once per token; the embedding lookup reads one row (an untied embedding's
        # matrix is not read); plus the KV of the ~256 tokens before it on average (128 prompt + 128)
        embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 2
        read = r["weights_bytes"] - embed + r["kv_bytes_per_token"] * 256
        r["bytes_read_per_token"] = read
        r["weights_read_bound_tok_s"] = bw / read
        r["fraction_of_bound"] = r["decode_tok_s"] / r["weights_read_bound_tok_s"]
    r = model.get("w2", {})
    if "model_flops" in r:
        r["achieved_TFLOPs"] = r["model_flops"] / r["wall_s"] / 1e12
        r["fraction_of_compute_bound"] = r["model_flops"] / r["wall_s"] / peak


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return "unknown"


def workdir(need_bytes: int) -> str:
    """/dev/shm when it has room (writing and reading 16 GB there takes seconds), else the temp dir."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > need_bytes:
        return tempfile.mkdtemp(prefix="pagellm-gpu-check-", dir=shm)
    return tempfile.mkdtemp(prefix="pagellm-gpu-check-")


def main_check(ns: argparse.Namespace) -> int:
    import torch

    from pagellm.bench.random_model import SHAPES, write_random_llama
    from pagellm.model_config import ModelConfig

    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU here", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    report = {"check": "pagellm GPU check (issue #17)", "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "git_commit": git_commit(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "gpu": {"name": props.name, "capability": f"{props.major}.{props.minor}",
                      "memory_GiB": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count}}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    if ns.tests_log:
        with open(ns.tests_log) as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
        report["tests"] = {"rc": ns.tests_rc, "summary": lines[-1] if lines else "", "log": ns.tests_log}
    print("measuring the GPU's limits ...", flush=True)
    report["limits"] = limits = measure_limits()
    print(f"  HBM copy {limits['hbm_copy_GBps']:.0f} GB/s, bf16 matmul {limits['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print("attention paths alone ...", flush=True)
    report["attention"] = run_attention(min(ns.child_timeout, 240), limits)
    print(attention_summary(report["attention"]), flush=True)
    report["models"] = {}
    base = workdir(20 * 2**30)
    try:
        for name in ns.models.split(","):
            shape = SHAPES[name]
            cfg = ModelConfig(**shape)
            path = os.path.join(base, name)
            t = time.perf_counter()
            write_random_llama(path, **shape, device="cuda", dtype=torch.bfloat16)
            torch.cuda.empty_cache()
            model = report["models"][name] = {"params": cfg.num_params, "shape": shape,
                                              "write_s": round(time.perf_counter() - t, 1)}
            print(f"{name}: {cfg.num_params / 1e9:.2f}B parameters written in {model['write_s']} s", flush=True)
            w1_opts = {"max_num_seqs": 8, "max_model_len": 2048}
            model["w1"] = run_child(path, "w1", w1_opts, 0, ns.child_timeout)
            model["w1_eager"] = run_child(path, "w1", dict(w1_opts, enforce_eager=True), 0, ns.child_timeout)
            w2_opts = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 2048,
                       "enable_prefix_caching": False}
            model["w2"] = run_child(path, "w2", w2_opts, ns.w2_requests, ns.child_timeout)
            bounds(model, cfg, limits)
            shutil.rmtree(path, ignore_errors=True)
            print(summary(name, model), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    os.makedirs(ns.out, exist_ok=True)
    tag = props.name.replace(" ", "_").replace("/", "_")
    out = os.path.join(ns.out, f"gpu_check_{tag}_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {out}")
    errors = [f"{name}/{key}" for name, m in report["models"].items() for key, r in m.items()
              if isinstance(r, dict) and "error" in r]
    if errors:
        print(f"gpu_check: failed runs: {', '.join(errors)} (their errors are in the JSON)", file=sys.stderr)
    return 1 if errors else 0


def summary(name: str, m: dict) -> str:
    def w1_line(key):
        r = m.get(key, {})
        if "error" in r:
            return f"  {key}: ERROR {r['error']}"
        return (f"  {key}: TTFT {r['ttft_ms']:.1f} ms, decode {r['decode_tok_s']:.1f} tok/s = "
                f"{r['fraction_of_bound']:.0%} of the weights-read bound {r['weights_read_bound_tok_s']:.0f} tok/s")

    r = m.get("w2", {})
    w2 = (f"  w2: ERROR {r['error']}" if "error" in r else
          f"  w2: {r['requests']} requests in {r['wall_s']} s: {r['output_tok_s']:.0f} output tok/s, "
          f"{r['total_tok_s']:.0f} total tok/s, {r['achieved_TFLOPs']:.0f} TFLOP/s = "
          f"{r['fraction_of_compute_bound']:.1%} of the bf16 matmul peak")
    return "\n".join([name, w1_line("w1"), w1_line("w1_eager"), w2])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Run on a machine with a CUDA GPU, best through benchmarks/gpu_check.sh.")
    sub = p.add_subparsers(dest="command")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated shapes (default {','.join(MODELS)})")
    p.add_argument("--w2-requests", type=int, default=1024, help="requests of the W2-style run (default 1024)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu"),
                   help="where the JSON goes (default benchmarks/results/gpu)")
    p.add_argument("--child-timeout", type=int, default=300, help="seconds per workload process (default 300)")
    p.add_argument("--tests-log", default=None, help="the cuda tests' output (gpu_check.sh passes it)")
    p.add_argument("--tests-rc", type=int, default=None, help="the cuda tests' exit code")
    w = sub.add_parser("workload", help="(internal) one workload in this process")
    w.add_argument("--model", required=True)
    w.add_argument("--name", choices=["w1", "w2"], required=True)
    w.add_argument("--options", default="{}", help="engine options as JSON")
    w.add_argument("--requests", type=int, default=1024)
    w.add_argument("--json", required=True)
    w.add_argument("--device", default="cuda", help="cuda; cpu only to try the workload code on a tiny model")
    a = sub.add_parser("attention", help="(internal) the attention paths alone in this process (gpu_attention.py)")
    a.add_argument("--json", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "workload":
        workload_main(ns)
        return 0
    if ns.command == "attention":
        import gpu_attention

        # a loop of 10 calls per timed run: one call of a decode kernel is tens of microseconds
        gpu_attention.main(ns.json, lambda fn: time_cuda(lambda: [fn() for _ in range(10)]) / 10)
        return 0
    for name in ns.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"--models: unknown shape {name!r} (known: {', '.join(MODELS)})")
    return main_check(ns)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)  # run from a checkout without installing
    sys.exit(main())
