"""What several benchmarks share: the machine and platform lines, the latency prompts, one timed latency
run, and the roofline floors printed after the runs.

torch and the engine are imported inside the functions only: the llama.cpp peer child imports this module
(through pagellm.bench.peers) and must stay torch-free, or its peak RSS would include torch's.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from collections.abc import AsyncIterable, AsyncIterator

from pagellm.bench import roofline

# An input-grounded task: the answer mostly quotes the prompt, which is where n-gram lookup shines.
GROUNDED_CODE = '''def summarize_orders(orders, tax_rate):
    subtotal = 0.0
    for order in orders:
        subtotal += order.price * order.quantity
    tax = subtotal * tax_rate
    shipping = 0.0 if subtotal > 100 else 7.5
    total = subtotal + tax + shipping
    return {"subtotal": subtotal, "tax": tax, "shipping": shipping, "total": total}


def print_receipt(orders, tax_rate):
    summary = summarize_orders(orders, tax_rate)
    for order in orders:
        print(order.name, order.quantity, order.price)
    print("subtotal", summary["subtotal"])
    print("total", summary["total"])
'''
GROUNDED_PROMPT = ("Rewrite the following Python code, renaming the variable `subtotal` to `items_cost`. "
                   "Reply with the full code only.\n\n" + GROUNDED_CODE)


_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_data(text: AsyncIterable[str]) -> AsyncIterator[str]:
    """The data fields of a server-sent event stream given as text pieces (a response's aiter_text()). Lines
    end where the SSE specification says, at CR LF, LF or CR: str.splitlines (httpx's aiter_lines) also ends
    them at U+0085, U+2028 and U+2029, which servers (vLLM's among them) write unescaped inside a JSON string,
    so a token decoding to one of them cut its chunk in two and failed the request in the client. A CR LF cut
    between pieces reads as a line and an empty one, which carries no field."""
    parts: list[str] = []  # the line so far: a long line in many pieces is joined once, not per piece
    async for piece in text:
        if "\n" not in piece and "\r" not in piece:
            parts.append(piece)
            continue
        *lines, rest = _SSE_LINE_END.split("".join(parts) + piece)
        parts = [rest]
        for line in lines:
            if line.startswith("data:"):
                yield line[5:].strip(" \t")
    last = "".join(parts)
    if last.startswith("data:"):
        yield last[5:].strip(" \t")


def machine_info() -> dict:
    """The "machine" entry of every report's JSON."""
    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}


def print_platform_line(device: str = "cpu", num_threads: int | None = None) -> None:
    """The platform's summary line (what it detected and chose for `device`), printed first so that a
    benchmark's output says what the figures below it ran on. `num_threads` (--num-threads) is applied
    first, as the engine applies it when it starts, so the line's thread count is the one the run uses."""
    from pagellm.platforms import get_platform

    platform = get_platform(device)
    platform.set_num_threads(num_threads)
    print(platform.summary_line(), flush=True)


def latency_prompts(tok, vocab: int, task: str, input_len: int, batch: int) -> list[list[int]]:
    """The latency prompts' token ids; a pagellm Tokenizer `tok`, so peers can get them without loading a
    model. grounded: the GROUNDED_PROMPT chat, `batch` times; random: `input_len` random ids per prompt."""
    if task == "grounded":
        text = tok.apply_chat_template([{"role": "user", "content": GROUNDED_PROMPT}], add_generation_prompt=True)
        return [tok.encode(text, add_special_tokens=False)] * batch
    from pagellm.bench.workload import random_workload

    return [r.prompt_token_ids for r in random_workload(batch, vocab, (input_len, input_len), (1, 1), seed=0)]


def timed_latency_run(llm, prompts: list[list[int]], output_len: int, ignore_eos: bool) -> dict:
    """All prompts submitted at once to a pagellm LLM, greedy. TTFT: submission to each request's first
    token (mean); decode tok/s: the tokens after each request's first one, over the time after the first
    token of any request."""
    from pagellm import SamplingParams
    from pagellm.bench.workload import check_fits

    eng = llm.engine
    check_fits([(len(p), output_len) for p in prompts], eng.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"lat-{time.monotonic_ns()}-{i}", p, params)
    first: dict[str, float] = {}
    final = {}
    peak = 0  # requests running at once: fewer than the batch where the KV cache cannot hold it
    while eng.has_unfinished_requests():
        outs = eng.step()
        peak = max(peak, len(eng.scheduler.running))
        for out in outs:
            now = time.perf_counter()
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                final[out.request_id] = (now, out.outputs[0].token_ids)
    end = max(t for t, _ in final.values())
    n_out = sum(len(ids) for _, ids in final.values())
    ttft = statistics.mean(first[r] - t0 for r in final)
    decode_time = end - min(first.values())
    return {"ttft_s": ttft, "decode_tok_s": (n_out - len(final)) / max(decode_time, 1e-9),
            "output_tokens": n_out, "token_ids": [final[r][1] for r in sorted(final)], "peak_running": peak}


def throughput_roofline(cfg, workload, results: list[dict]) -> dict:
    """Measured after the runs (never during them), with the threads the engines used; prints its lines."""
    machine = roofline.measure_machine(results[0].get("threads"))
    print(roofline.machine_line(machine))
    requests = [(len(r.prompt_token_ids), r.output_len) for r in workload]
    engines = {}
    for r in results:
        engines[r["engine"]] = fl = roofline.throughput_floor(cfg, requests, machine, r["output_tokens_per_s"])
        print(roofline.throughput_line(r["engine"], fl))
    return {"machine": machine, "engines": engines}


def latency_roofline(cfg, engines: dict[str, tuple[int, int, list[dict]]], threads: int | None) -> dict:
    """Decode floors of every engine's latency rows; engines: name -> (weight bytes per step, KV bytes per
    token, rows with batch_size, prompt_tokens, output_tokens, decode_tok_s). Prints one line per row."""
    machine = roofline.measure_machine(threads)  # after every engine ran, so nothing competes with it
    print(roofline.machine_line(machine))
    out = {}
    for name, (weight_bytes, kv_per_token, rows) in engines.items():
        floors = []
        for row in rows:
            b = row["batch_size"]
            fl = roofline.decode_floor(cfg, weight_bytes, kv_per_token, row["prompt_tokens"], row["output_tokens"] / b,
                                       b, machine, row["decode_tok_s"])
            floors.append(fl)
            print(roofline.decode_line(name, fl))
        out[name] = {"weight_bytes_per_step": weight_bytes, "kv_bytes_per_token": kv_per_token, "decode": floors}
    return {"machine": machine, "engines": out}


MODELS_PROBE_TIMEOUT_S = 30.0


async def served_model(client, base: str, wanted: str | None, default_len: int) -> tuple[str, int]:
    """(model id, its max_model_len) from a server's /v1/models: `wanted` or the first one served."""
    import httpx

    try:  # a short limit of its own: the client's is per generation request (minutes), and a port that takes
        # the connection but never answers (not an HTTP server, a hung one) would hold the benchmark as long
        limit = min(MODELS_PROBE_TIMEOUT_S, client.timeout.read or MODELS_PROBE_TIMEOUT_S)
        r = await client.get(base + "/v1/models", timeout=limit)
        r.raise_for_status()
    except httpx.TimeoutException as e:
        raise ValueError(f"cannot list models at {base}/v1/models: {type(e).__name__}, no answer within {limit:g} s "
                         "(is it an OpenAI-compatible server?)") from None
    except httpx.HTTPError as e:  # its first line: httpx adds a second, a link explaining the status code
        raise ValueError(f"cannot list models at {base}/v1/models: "
                         f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
    try:
        served = r.json()["data"]
        model = wanted or served[0]["id"]
        max_len = next((m.get("max_model_len") for m in served if m["id"] == model), None)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise ValueError(f"{base}/v1/models did not answer as an OpenAI-compatible server does (a list of models "
                         "under 'data')") from None
    return model, max_len or default_len
