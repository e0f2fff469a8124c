"""`pagellm bench serve`: an online benchmark against a running OpenAI-compatible server.

The semantics are vLLM's `benchmark_serving.py`, so numbers compare across engines: gamma-distributed arrivals
(shape = burstiness; 1 is Poisson), one streaming /v1/completions request per prompt with `ignore_eos`, a fixed
`max_tokens` and no temperature unless --temperature (the server's default), and per request TTFT (first
streamed chunk), TPOT ((e2e - ttft) / (output_tokens - 1)), ITL (gaps between chunks) and E2E latency; goodput
counts requests that meet every SLO given. Token counts come from the stream's usage chunk, not from counting
chunks.
With `--peer pagellm|vllm` instead of `--url`, the benchmark starts the servers itself, one after the
other, and compares them (`pagellm.bench.serve_launch`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field

from pagellm import cli_types
from pagellm.bench.common import print_platform_line, served_model, sse_data
from pagellm.bench.report import check_outputs, plot_written, write_json
from pagellm.bench.workload import BenchRequest, random_workload

SLO_KEYS = ("ttft", "tpot", "e2el")
LATENCY_KEYS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)  # mean and median are always reported, as in vLLM
LOW_TOKEN_ID = 100  # random prompts avoid the low ids, where tokenizers keep their special tokens

MAX_SEND_WINDOW_S = 86400.0  # --request-rate x --num-prompts may spread the arrivals over at most a day


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None,
                   help="server base URL, e.g. http://127.0.0.1:8000 (or --peer: start the servers here)")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the served model's tokenizer (a .gguf file or Hugging Face directory): random prompts "
                        "draw ids from its vocabulary and sharegpt prompts are tokenized locally. Needed for a "
                        "server without pagellm's /tokenize and /detokenize (vLLM's accepts any token id)")
    p.add_argument("--api-key", default=os.environ.get("PAGELLM_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $PAGELLM_API_KEY)")
    p.add_argument("--num-prompts", type=cli_types.positive_int, default=64, help="requests (default 64)")
    p.add_argument("--request-rate", type=cli_types.rate, default=float("inf"), metavar="R",
                   help="mean requests/s, or inf to send all at once (default inf)")
    p.add_argument("--burstiness", type=cli_types.positive_number, default=1.0, metavar="B",
                   help="gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier, >1 steadier")
    p.add_argument("--max-concurrency", type=cli_types.positive_int, default=None, metavar="C",
                   help="at most C requests in flight; later arrivals wait (default: unbounded)")
    p.add_argument("--dataset", nargs="+", default=["random"], metavar="KIND",
                   help="'random' (token-id prompts) or 'sharegpt-json PATH' (default random)")
    p.add_argument("--input-len", type=cli_types.positive_int, default=128,
                   help="random: prompt tokens (default 128)")
    p.add_argument("--output-len", type=cli_types.positive_int, default=64,
                   help="random: output tokens (default 64)")
    p.add_argument("--range-ratio", type=cli_types.fraction_below_one, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset sample and the arrival times")
    p.add_argument("--temperature", type=cli_types.nonnegative_number, default=None, metavar="T",
                   help="sent with every request (0: greedy); default: none, as vLLM's bench serve, so the "
                        "server's default applies (1 for an OpenAI server: random sampling)"),
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in ms for goodput, keys ttft, tpot, e2el; e.g. ttft:2000 tpot:100")
    p.add_argument("--timeout", type=cli_types.positive_seconds, default=600.0,
                   help="per-request timeout in seconds")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="draw the latencies (needs matplotlib)")
    from pagellm.bench.serve_launch import add_launch_args

    add_launch_args(p)


@dataclass
class RequestRecord:
    prompt_len: int
    output_len: int  # asked for
    start: float = 0.0  # seconds since the benchmark began, when the request was actually sent
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    prompt_tokens: int = 0  # as the server reported them
    output_tokens: int = 0
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error and self.ttft is not None

    @property
    def tpot(self) -> float:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            raise ValueError(f"--goodput: unknown key {key!r} in {item!r}; use {', '.join(SLO_KEYS)}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r} is not KEY:MILLISECONDS") from None
        if not 0 < slos[key] < float("inf"):  # nan too
            raise ValueError(f"--goodput: {item!r} must be a positive number of milliseconds")
    return slos


def parse_dataset(words: list[str]) -> tuple[str, str | None]:
    if words == ["random"]:
        return "random", None
    if len(words) == 2 and words[0] == "sharegpt-json":
        return "sharegpt-json", words[1]
    raise ValueError(f"--dataset: expected 'random' or 'sharegpt-json PATH', got {' '.join(words)!r}")


def send_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Offsets (s) at which the requests are sent. Gamma gaps with scale 1/(rate*burstiness) keep the
    mean rate whatever the shape; the schedule is absolute so a slow event loop does not drift it."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, theta)
    return times


def _len_range(length: int, ratio: float) -> tuple[int, int]:
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


PROBE_LIMIT = 1 << 22  # no served vocabulary is this large: a server that decodes it checks no range


async def _vocab_size(client, base: str) -> int:
    """The API does not report the vocabulary size, but pagellm's /detokenize rejects out-of-range ids: bisect
    it (22 requests). A server that decodes any id (vLLM's) or has no /detokenize gives no answer: then the
    tokenizer must come from --tokenizer."""
    hint = "pass the served model's tokenizer with --tokenizer PATH"
    r = await client.post(base + "/detokenize", json={"tokens": [PROBE_LIMIT]})
    if r.status_code == 200:
        raise ValueError(f"{base}/detokenize accepts token id {PROBE_LIMIT}, so the vocabulary size cannot be "
                         f"probed there: {hint}")
    if (await client.post(base + "/detokenize", json={"tokens": [LOW_TOKEN_ID]})).status_code != 200:
        raise ValueError(f"{base}/detokenize does not decode token id {LOW_TOKEN_ID}: {hint}")
    lo, hi = LOW_TOKEN_ID, PROBE_LIMIT
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = await client.post(base + "/detokenize", json={"tokens": [mid]})
        lo, hi = (mid, hi) if r.status_code == 200 else (lo, mid)
    return hi


class _ServerTokenizer:
    """Token counts from the server's /tokenize (pagellm's and vLLM's take the same body)."""

    def __init__(self, client, base: str):
        self.client, self.base = client, base

    async def encode(self, text: str, special: bool) -> list[int]:
        r = await self.client.post(self.base + "/tokenize", json={"prompt": text, "add_special_tokens": special})
        r.raise_for_status()
        return r.json()["tokens"]


class _LocalTokenizer:
    def __init__(self, path: str):
        from pagellm.tokenizer import Tokenizer

        self.tok = Tokenizer.from_path(path)

    async def encode(self, text: str, special: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=special)


def _sharegpt_conversations(path: str) -> list[list[dict]]:
    """Each entry's "conversations" list (ShareGPT's layout: [{"conversations": [{"from": "human", "value":
    ...}, ...]}, ...]); a file of another shape is one ValueError naming the file, not a traceback."""
    what = f"--dataset sharegpt-json {path}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{what}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what}: not JSON ({e})") from None
    entry = '{"conversations": [{"from": ..., "value": ...}, ...]}'
    if not isinstance(data, list):
        raise ValueError(f"{what}: expected a JSON list of {entry} objects")
    convs = []
    for i, item in enumerate(data):
        conv = (item.get("conversations") or []) if isinstance(item, dict) else None
        if not isinstance(conv, list) or not all(isinstance(t, dict) and isinstance(t.get("value", ""), str)
                                                 for t in conv):
            raise ValueError(f"{what}: entry {i} is not an object like {entry}")
        convs.append(conv)
    return convs


async def _sharegpt(tokenizer, path: str, n: int, seed: int, max_model_len: int) -> list[BenchRequest]:
    """First human turn as the prompt, the first gpt turn's token count as the output length. Like vLLM,
    very short answers (< 4 tokens) and pairs that do not fit the context are skipped."""
    convs = _sharegpt_conversations(path)
    random.Random(seed).shuffle(convs)
    out: list[BenchRequest] = []
    for conv in convs:
        human = next((t.get("value") for t in conv if t.get("from") == "human"), None)
        gpt = next((t.get("value") for t in conv if t.get("from") == "gpt"), None)
        if not human or not gpt:
            continue
        prompt = await tokenizer.encode(human, True)
        n_out = len(await tokenizer.encode(gpt, False))
        if n_out >= 4 and len(prompt) + n_out <= max_model_len:
            out.append(BenchRequest(prompt, n_out))
            if len(out) == n:
                return out
    raise ValueError(f"{path}: only {len(out)} usable conversations, --num-prompts asks for {n}")


async def _send(client, base: str, model: str, req: BenchRequest, t0: float,
                temperature: float | None = None) -> RequestRecord:
    rec = RequestRecord(len(req.prompt_token_ids), req.output_len)
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if temperature is not None:  # else the server's default, as vLLM's client (1 for an OpenAI server)
        body["temperature"] = temperature
    st = time.perf_counter()
    rec.start = st - t0
    last = st
    try:
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return rec
            async for data in sse_data(r.aiter_text()):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    return rec
                if chunk.get("choices"):
                    if rec.ttft is None:
                        rec.ttft = now - st
                    else:
                        rec.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # a failed request is a result to report, not a reason to stop the run
        why = str(e) or ("no data within --timeout" if "Timeout" in type(e).__name__ else "")  # httpx's are empty
        rec.error = f"{type(e).__name__}: {why}"[:300]
        return rec
    rec.e2el = last - st  # the last token's arrival; the usage chunk and [DONE] are bookkeeping
    if rec.ttft is None or not rec.output_tokens:
        rec.error = "the stream ended without tokens or without a usage chunk"
    return rec


async def _run(ns, requests: list[BenchRequest], client, base: str, model: str) -> tuple[list, float]:
    times = send_times(len(requests), ns.request_rate, ns.burstiness, ns.seed)
    sem = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None

    async def one(req: BenchRequest, at: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        if sem is None:
            return await _send(client, base, model, req, t0, ns.temperature)
        async with sem:
            return await _send(client, base, model, req, t0, ns.temperature)

    from tqdm import tqdm

    bar = tqdm(total=len(requests), desc="requests", disable=None)
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(one(r, at)) for r, at in zip(requests, times, strict=True)]
    for task in tasks:
        task.add_done_callback(lambda _: bar.update(1))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return records, duration


def summarize(records: list[RequestRecord], duration: float, slos: dict[str, float]) -> dict:
    import numpy as np

    ok = [r for r in records if r.success]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    res: dict = {"duration": duration, "completed": len(ok), "failed": len(records) - len(ok),
                 "total_input_tokens": n_in, "total_output_tokens": n_out,
                 "request_throughput": len(ok) / duration,
                 "request_goodput": None, "output_throughput": n_out / duration,
                 "total_token_throughput": (n_in + n_out) / duration}
    if slos:
        good = sum(all(getattr(r, k) * 1000 <= ms for k, ms in slos.items()) for r in ok)
        res["request_goodput"] = good / duration
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.e2el for r in ok]}
    for key in LATENCY_KEYS:
        ms = np.asarray(values[key] or [0.0]) * 1000
        res[f"mean_{key}_ms"] = float(ms.mean())
        res[f"median_{key}_ms"] = float(np.median(ms))
        res[f"std_{key}_ms"] = float(ms.std())
        for p in PERCENTILES:
            res[f"p{p}_{key}_ms"] = float(np.percentile(ms, p))
    return res


def _per_request(records: list[RequestRecord]) -> list[dict]:
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 2)

    return [{"start_s": round(r.start, 3), "prompt_tokens": r.prompt_tokens or r.prompt_len,
             "output_tokens": r.output_tokens, "ttft_ms": ms(r.ttft),
             "tpot_ms": ms(r.tpot) if r.success else None, "e2el_ms": ms(r.e2el) if r.success else None,
             "error": r.error or None} for r in records]


def _print(res: dict) -> None:
    print("{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="))
    rows = [("Successful requests", res["completed"]), ("Failed requests", res["failed"]),
            ("Benchmark duration (s)", res["duration"]), ("Total input tokens", res["total_input_tokens"]),
            ("Total generated tokens", res["total_output_tokens"]),
            ("Request throughput (req/s)", res["request_throughput"]),
            ("Request goodput (req/s)", res["request_goodput"]),
            ("Output token throughput (tok/s)", res["output_throughput"]),
            ("Total token throughput (tok/s)", res["total_token_throughput"])]
    for key, title in zip(LATENCY_KEYS, ("Time to First Token", "Time per Output Token (excl. 1st token)",
                                         "Inter-token Latency", "End-to-end Latency"), strict=True):
        rows.append((f"-{title}-", None))
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            rows.append((f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {key.upper()} (ms)",
                         res[f"{stat}_{key}_ms"]))
    for name, value in rows:
        if name.startswith("-"):
            print("{s:{c}^60}".format(s=name[1:-1], c="-"))
        elif value is not None:
            print(f"{name:<44}{value:>16.2f}" if isinstance(value, float) else f"{name:<44}{value:>16}")
    print("=" * 60)


async def make_requests(ns, client, base: str | None, kind: str, path: str | None,
                        max_len: int) -> list[BenchRequest]:
    """The workload, from --tokenizer (then no server is asked anything) or from the server's endpoints."""
    if kind == "random":
        lens_in, lens_out = _len_range(ns.input_len, ns.range_ratio), _len_range(ns.output_len, ns.range_ratio)
        if lens_in[1] + lens_out[1] > max_len:
            raise ValueError(f"input + output length up to {lens_in[1] + lens_out[1]} exceeds the server's "
                             f"max_model_len {max_len}")
        local = _LocalTokenizer(ns.tokenizer) if ns.tokenizer else None
        vocab = local.tok.vocab_size if local else await _vocab_size(client, base)
        return random_workload(ns.num_prompts, vocab, lens_in, lens_out, ns.seed, LOW_TOKEN_ID)
    tokenizer = _LocalTokenizer(ns.tokenizer) if ns.tokenizer else _ServerTokenizer(client, base)
    return await _sharegpt(tokenizer, path, ns.num_prompts, ns.seed, max_len)


async def _bench(ns, slos: dict[str, float], kind: str, path: str | None, url: str | None = None,
                 requests: list[BenchRequest] | None = None) -> dict:
    """One run against `url` (default --url): `requests`, else a workload from make_requests."""
    import httpx

    base = (url or ns.url).rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    # No pool limit: a request waiting for a free connection would count the wait as TTFT. --timeout bounds
    # each connect and each wait for data, not a whole stream (a late request of a long run streams for minutes).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(ns.timeout), limits=limits, headers=headers) as client:
        model, max_len = await served_model(client, base, ns.model, 1 << 30)
        if requests is None:
            requests = await make_requests(ns, client, base, kind, path, max_len)
        elif (longest := max(len(r.prompt_token_ids) + r.output_len for r in requests)) > max_len:
            raise ValueError(f"a request of {longest} tokens exceeds {base}'s max_model_len {max_len}")
        # One short request first: fails fast on a misconfigured server and warms it up, outside the timing.
        # Its prompt is the first one reversed: the same length, but no prefix a server's cache could reuse.
        warm_prompt = requests[0].prompt_token_ids[::-1]
        warm = await _send(client, base, model, BenchRequest(warm_prompt, 1), time.perf_counter(), ns.temperature)
        if not warm.success:
            raise ValueError(f"the warm-up request failed: {warm.error}")
        cpu0 = time.process_time()
        records, duration = await _run(ns, requests, client, base, model)
        client_cpu = time.process_time() - cpu0  # what the client took from a server on the same machine
    return {"benchmark": "serve", "date": time.strftime("%Y-%m-%d"),
            "command": "pagellm " + " ".join(sys.argv[1:]),
            "client": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "python": platform.python_version(), "cpu_s_during_run": round(client_cpu, 3)},
            "url": base, "model": model, "tokenizer": ns.tokenizer,
            "dataset": {"name": kind, "path": path, "input_len": ns.input_len if kind == "random" else None,
                        "output_len": ns.output_len if kind == "random" else None,
                        "range_ratio": ns.range_ratio if kind == "random" else None, "seed": ns.seed},
            "num_prompts": ns.num_prompts, "request_rate": str(ns.request_rate),  # JSON has no inf
            "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency, "goodput_slo_ms": slos,
            "temperature": ns.temperature,  # None: not sent (the server's default)
            "results": summarize(records, duration, slos), "requests": _per_request(records)}


def run_serve_bench(ns: argparse.Namespace) -> int:
    slos = parse_goodput(ns.goodput)
    kind, path = parse_dataset(ns.dataset)
    if ns.num_prompts < 1 or ns.request_rate <= 0 or ns.burstiness <= 0 or (ns.max_concurrency or 1) < 1:
        raise ValueError("--num-prompts, --request-rate, --burstiness and --max-concurrency must be positive")
    window = (ns.num_prompts - 1) / ns.request_rate  # the arrivals' mean span
    if window > MAX_SEND_WINDOW_S:  # a rate of 1e-9 would wait decades between two requests: a hang, not a run
        least = (ns.num_prompts - 1) / MAX_SEND_WINDOW_S
        raise ValueError(f"--request-rate {ns.request_rate:g} spreads {ns.num_prompts} requests over about "
                         f"{window:.3g} s, more than a day: give at least {least:.3g} requests/s, or fewer "
                         f"--num-prompts")
    if not ns.url and not ns.peer:
        raise ValueError("bench serve needs --url (a running server) or --peer pagellm|vllm (start them here)")
    check_outputs(ns.json, ns.plot)  # before the run, not after it
    if ns.plot:
        import matplotlib  # noqa: F401  -- fail before the run, not after it

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    print_platform_line("cpu")  # the client's host (the server's too, where it serves on localhost)
    if ns.peer:
        from pagellm.bench.serve_launch import run_launched

        return run_launched(ns, slos, kind, path)
    report = asyncio.run(_bench(ns, slos, kind, path))
    _print(report["results"])
    print(f"client CPU during the run: {report['client']['cpu_s_during_run']:.2f} s")
    for err in sorted({r["error"] for r in report["requests"] if r["error"]})[:5]:
        print(f"error: {err}", file=sys.stderr)
    if ns.json:
        write_json(ns.json, report)
    if ns.plot:
        from pagellm.bench.plot import plot_serve

        plot_serve(report, ns.plot)
        print(f"wrote {plot_written(ns.plot)}")
    return 0 if report["results"]["completed"] else 1
