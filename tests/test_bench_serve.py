"""`pagellm bench serve`: the arrival process and metric formulas on their own, then whole runs through
the CLI against a real server (a subprocess on a tiny random Llama with SmolLM2's tokenizer)."""

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from pagellm.bench.common import sse_data
from pagellm.bench.serve import RequestRecord, parse_dataset, parse_goodput, send_times, summarize
from pagellm.cli import main
from pagellm.platforms import get_platform


def test_send_times_gamma_mean_rate_and_inf():
    assert send_times(5, float("inf"), 1.0, 0) == [0.0] * 5
    for burstiness in (0.5, 1.0, 4.0):
        t = send_times(4001, 8.0, burstiness, seed=1)
        assert t[0] == 0.0 and t == sorted(t)
        assert t[-1] / 4000 == pytest.approx(1 / 8.0, rel=0.1)  # the mean gap keeps the rate

    def gap_variance(burstiness: float) -> float:
        t = send_times(2001, 1.0, burstiness, 2)
        gaps = [y - x for x, y in zip(t, t[1:], strict=False)]
        return sum((g - sum(gaps) / len(gaps)) ** 2 for g in gaps) / len(gaps)

    assert gap_variance(0.25) > 2 * gap_variance(1.0) > 4 * gap_variance(4.0)  # = 1 / (rate^2 * b)
    assert send_times(10, 2.0, 1.0, 3) == send_times(10, 2.0, 1.0, 3)


def test_summarize_formulas_and_goodput():
    fast = RequestRecord(10, 5, ttft=0.1, itl=[0.05] * 4, e2el=0.3, prompt_tokens=10, output_tokens=5)
    slow = RequestRecord(20, 3, ttft=1.0, itl=[0.5, 0.5], e2el=2.0, prompt_tokens=20, output_tokens=3)
    failed = RequestRecord(30, 3, error="HTTP 503")
    res = summarize([fast, slow, failed], duration=4.0, slos={"ttft": 500, "tpot": 100})
    assert res["completed"] == 2 and res["failed"] == 1
    assert res["total_input_tokens"] == 30 and res["total_output_tokens"] == 8
    assert res["request_throughput"] == 0.5 and res["output_throughput"] == 2.0
    assert res["total_token_throughput"] == 38 / 4.0
    assert res["request_goodput"] == 0.25  # only `fast` meets both SLOs
    assert fast.tpot == pytest.approx(0.05) and slow.tpot == pytest.approx(0.5)
    assert res["mean_tpot_ms"] == pytest.approx(275.0) and res["median_ttft_ms"] == pytest.approx(550.0)
    assert res["mean_itl_ms"] == pytest.approx(1000 * (0.2 + 1.0) / 6)
    assert summarize([fast], 1.0, {})["request_goodput"] is None


def test_argument_errors():
    assert parse_goodput(["ttft:200", "e2el:1e4"]) == {"ttft": 200.0, "e2el": 10000.0}
    for bad in (["itl:5"], ["ttft"], ["tpot:-1"], ["ttft:nan"], ["e2el:inf"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_dataset(["sharegpt-json", "x.json"]) == ("sharegpt-json", "x.json")
    with pytest.raises(ValueError, match="--dataset"):
        parse_dataset(["sharegpt-json"])


GREEDY = ["--temperature", "0"]  # the tiny model's streams, chunk for chunk as before


# ---- against a real server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server_url(tiny_hf_model, smollm_gguf_path, tmp_path_factory):
    model = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)
    log_path = tmp_path_factory.mktemp("srv") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pagellm.cli", "serve", "--port", "0", "--model", model,
                                 "--tokenizer", smollm_gguf_path, "--kv-cache-memory", "16MiB"],
                                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.time() + 180
        while not (m := re.search(r"ready: serving \S+ at (http://\S+)/v1", log_path.read_text())):
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        yield m.group(1)
    finally:
        proc.terminate()
        proc.wait(30)


def _check(report: dict, n: int, asked_out: list[int] | None = None):
    res, reqs = report["results"], report["requests"]
    assert res["completed"] == len(reqs) == n and res["failed"] == 0
    assert res["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)
    if asked_out is not None:
        assert sorted(r["output_tokens"] for r in reqs) == sorted(asked_out)  # ignore_eos: exactly max_tokens
    assert res["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs)
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < res[f"median_{key}_ms"] <= res[f"p90_{key}_ms"] <= res[f"p99_{key}_ms"]
    assert res["median_ttft_ms"] <= res["median_e2el_ms"]
    assert 0 < res["request_throughput"] and res["request_throughput"] * res["duration"] == pytest.approx(n)
    for r in reqs:
        assert r["ttft_ms"] <= r["e2el_ms"] and r["error"] is None
        assert r["tpot_ms"] == pytest.approx((r["e2el_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1), abs=0.02)


def test_random_dataset_run(server_url, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["bench", "serve", *GREEDY,
               "--url", server_url + "/v1", "--num-prompts", "6", "--request-rate", "20",
               "--burstiness", "0.5", "--max-concurrency", "3", "--input-len", "16", "--output-len", "8",
               "--goodput", "ttft:60000", "tpot:60000", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == get_platform("cpu").summary_line() and "Serving Benchmark Result" in text
    report = json.loads(out_json.read_text())
    _check(report, 6, [8] * 6)
    assert all(r["prompt_tokens"] == 16 for r in report["requests"])
    assert report["results"]["total_input_tokens"] == 6 * 16
    res = report["results"]
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])  # SLOs nobody misses
    assert report["goodput_slo_ms"] == {"ttft": 60000.0, "tpot": 60000.0} and report["request_rate"] == "20.0"
    assert 0 < report["client"]["cpu_s_during_run"] < 60 and "client CPU during the run: " in text
    assert out_png.stat().st_size > 10_000 and out_png.read_bytes()[:4] == b"\x89PNG"


def test_sharegpt_dataset_run_with_tight_slo(server_url, tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"Question {i}: tell me about item {i}."},
                                {"from": "gpt", "value": "It is a thing. " * (i + 1)}]} for i in range(5)]
    convs.append({"conversations": [{"from": "gpt", "value": "no human turn, skipped"}]})
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(convs))
    out_json = tmp_path / "s.json"
    rc = main(["bench", "serve", *GREEDY,
               "--url", server_url, "--num-prompts", "4", "--dataset", "sharegpt-json",
               str(data), "--goodput", "ttft:0.001", "--json", str(out_json)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    _check(report, 4)
    tok = lambda text, special: len(httpx.post(server_url + "/tokenize", json={
        "prompt": text, "add_special_tokens": special}).json()["tokens"])
    possible_out = {tok(c["conversations"][1]["value"], False) for c in convs[:5]}
    assert {r["output_tokens"] for r in report["requests"]} <= possible_out
    assert report["results"]["request_goodput"] == 0.0  # a 1 us TTFT SLO is never met
    with pytest.raises(ValueError, match="only 5 usable"):
        main_raising(["bench", "serve", *GREEDY,
                      "--url", server_url, "--num-prompts", "9", "--dataset", "sharegpt-json",
                      str(data)])


def test_local_tokenizer_instead_of_the_servers_endpoints(server_url, smollm_gguf_path, tmp_path):
    """--tokenizer: the vocabulary and sharegpt token counts come from the local tokenizer, as against a
    server whose /detokenize checks no range (vLLM's); they agree with what the server's endpoints say."""
    from pagellm.tokenizer import Tokenizer

    out_json = tmp_path / "t.json"
    rc = main(["bench", "serve", *GREEDY,
               "--url", server_url, "--num-prompts", "3", "--input-len", "12", "--output-len", "4",
               "--tokenizer", smollm_gguf_path, "--json", str(out_json)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    _check(report, 3, [4] * 3)
    assert report["tokenizer"] == smollm_gguf_path and all(r["prompt_tokens"] == 12 for r in report["requests"])

    text = "Question: tell me about the tokenizer."
    convs = [{"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "It splits text. " * 3}]}]
    data = tmp_path / "one.json"
    data.write_text(json.dumps(convs))
    rc = main(["bench", "serve", *GREEDY,
               "--url", server_url, "--num-prompts", "1", "--dataset", "sharegpt-json", str(data),
               "--tokenizer", smollm_gguf_path, "--json", str(out_json)])
    assert rc == 0
    served = httpx.post(server_url + "/tokenize", json={"prompt": text, "add_special_tokens": True}).json()["tokens"]
    local = Tokenizer.from_path(smollm_gguf_path).encode(text, add_special_tokens=True)
    assert local == served and json.loads(out_json.read_text())["requests"][0]["prompt_tokens"] == len(local)


def main_raising(argv: list[str]) -> int:
    from pagellm.cli import build_parser

    ns = build_parser().parse_args(argv)
    return ns.func(ns)


# ---- --peer: the benchmark starts the servers itself ---------------------------------------------------------

def _vllm_python() -> str | None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python = os.environ.get("PAGELLM_VLLM_PYTHON") or os.path.join(repo, ".peers", "venv-vllm", "bin", "python")
    return python if os.path.isfile(python) else None


def test_failed_streams_are_records_not_exceptions(server_url):
    """A refused request and a closed port each give a record with the reason, beside a request that succeeds
    on the same client."""
    import asyncio

    from pagellm.bench.serve import _send
    from pagellm.bench.workload import BenchRequest

    model = httpx.get(server_url + "/v1/models").json()["data"][0]["id"]

    async def go():
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as s:
            # greedy: a sampled token may be part of a character, which the server streams with the next one
            return [await _send(s, base, name, BenchRequest(prompt, n), time.perf_counter(), 0.0)
                    for base, name, prompt, n
                    in [(server_url, model, [100, 101, 102], 3), (server_url, "no-such-model", [100, 101], 2),
                        (server_url, model, [100] * 2000, 2), ("http://127.0.0.1:1", model, [100], 2)]]

    ok, wrong, huge, closed = asyncio.run(go())
    # a token that is part of a character waits for the next, and a reader that lags gets the outputs so far
    # in one chunk (both depend on the CPU): 3 tokens arrive in 1 to 3 chunks, an inter-token gap between each
    assert ok.success and ok.output_tokens == 3 and ok.prompt_tokens == 3 and len(ok.itl) <= 2
    assert 0 < ok.ttft <= ok.e2el and ok.e2el == pytest.approx(ok.ttft + sum(ok.itl))
    assert wrong.error.startswith("HTTP 404") and "no-such-model" in wrong.error and not wrong.success
    assert huge.error.startswith("HTTP 400") and "1024" in huge.error and not huge.success
    assert closed.error.startswith("ConnectError") and not closed.success


@pytest.mark.timeout(30)
def test_url_or_peer():
    with pytest.raises(ValueError, match="needs --url .* or --peer"):
        main_raising(["bench", "serve"])
    with pytest.raises(ValueError, match="takes neither --url nor --model"):
        main_raising(["bench", "serve", "--peer", "pagellm", "--url", "http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="--serve-args '--no-such-option': not options of pagellm serve"):
        main_raising(["bench", "serve", "--peer", "pagellm", "--serve-args=--no-such-option"])
    for bad in ("nan", "0", "-1"):  # nan ran the whole benchmark; 0 and -1 launched a server, then gave up
        with pytest.raises(SystemExit):
            main_raising(["bench", "serve", "--peer", "pagellm", "--launch-timeout", bad])
    # a rate that spreads the requests over more than a day would wait (decades at 1e-9) instead of running
    with pytest.raises(ValueError, match="more than a day: give at least"):
        main_raising(["bench", "serve", "--url", "http://127.0.0.1:1", "--request-rate", "1e-9"])


@pytest.mark.timeout(60)
def test_launch_waits_boundedly_and_leaves_no_process(tmp_path):
    from pagellm.bench.serve_launch import LaunchError, launched, stop

    base = "http://127.0.0.1:1"  # nothing answers there
    with pytest.raises(LaunchError, match="exited with code 3 before answering /health:\nboom"):
        with launched([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], dict(os.environ), base, 30):
            pass
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"no answer on http://127.0.0.1:1/health after 1 s"):
        with launched([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), base, 1):
            pass
    assert time.monotonic() - t0 < 20
    # A server that ignores SIGTERM and has a child of its own: after the grace period the whole process
    # group is killed, the child too.
    pid_file = tmp_path / "child.pid"
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.time() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    stop(proc, grace=1)
    assert proc.returncode == -9
    deadline = time.time() + 10
    while _alive(child):  # killed; its new parent (init or a subreaper) reaps it
        assert time.time() < deadline, f"child {child} outlived its server"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped yet
    except FileNotFoundError:
        return False
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.timeout(300)
def test_launched_pagellm_with_vllm_skipped(tiny_hf_model, smollm_gguf_path, tmp_path, capsys):
    model = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)
    out_json, out_png = tmp_path / "l.json", tmp_path / "l.png"
    missing = tmp_path / "nowhere" / "python"
    rc = main(["bench", "serve", "--peer", "vllm", "--peer-python", str(missing), "--serve-args",
               f"--model {model} --tokenizer {smollm_gguf_path} --kv-cache-memory 16MiB", "--num-prompts", "3",
               "--input-len", "12", "--output-len", "4", "--json", str(out_json), "--plot", str(out_png), *GREEDY])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f"skipping vllm: no vLLM python at {missing} (--peer-python)" in text and "Traceback" not in text
    assert "Serving Benchmark: launched servers" in text
    report = json.loads(out_json.read_text())
    assert report["mode"] == "launched" and report["skipped"][0].startswith("vllm: ") and not report["failed"]
    [r] = report["results"]
    assert r["server"] == "pagellm" and r["server_command"][1:4] == ["-m", "pagellm.cli", "serve"]
    assert r["tokenizer"] == smollm_gguf_path and r["ready_s"] > 0
    _check(r, 3, [4] * 3)
    port = int(r["server_command"][r["server_command"].index("--port") + 1])
    with pytest.raises(httpx.ConnectError):  # stopped
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    assert out_png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(_vllm_python() is None, reason="no vLLM venv (PAGELLM_VLLM_PYTHON or .peers/venv-vllm)")
@pytest.mark.timeout(900)
def test_launched_pagellm_and_vllm(tmp_path, capsys):
    out_json = tmp_path / "v.json"
    rc = main(["bench", "serve", "--peer", "vllm", "--peer-python", _vllm_python(), "--serve-args",
               "--kv-cache-memory 32MiB", "--num-prompts", "3", "--input-len", "16", "--output-len", "6",
               "--json", str(out_json), *GREEDY])
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads(out_json.read_text())
    p, v = report["results"]
    assert (p["server"], v["server"]) == ("pagellm", "vllm") and not report["skipped"]
    for r in (p, v):
        _check(r, 3, [6] * 3)
        assert all(q["prompt_tokens"] == 16 for q in r["requests"])  # the same ids, counted by each server
    assert v["server_command"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--no-enable-prefix-caching" in v["server_command"]
    ratio = report["pagellm_over_server"]["vllm"]["output_throughput"]
    assert ratio == pytest.approx(p["results"]["output_throughput"] / v["results"]["output_throughput"], rel=1e-2)
    assert any(line.startswith("output throughput tok/s") and line.endswith("x") for line in text.splitlines())


def test_sharegpt_files_of_another_shape_are_one_line(tmp_path):
    """A file that is not ShareGPT's layout (a probe's `{"a": 1}`, `[1, 2]`, `[{"conversations": "x"}]`)
    was an AttributeError traceback; not JSON or not UTF-8 named neither the file nor the option."""
    from pagellm.bench.serve import _sharegpt_conversations

    cases = {'{"a": 1}': "expected a JSON list", "[1, 2]": "entry 0 is not an object",
             '[{"conversations": "x"}]': "entry 0 is not an object",
             '[{"conversations": []}, {"conversations": [{"from": "human", "value": 3}]}]': "entry 1 is not",
             "nope": "not JSON"}
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"{i}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"--dataset sharegpt-json {re.escape(str(path))}: {message}"):
            _sharegpt_conversations(str(path))
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\xff\xfe[")
    with pytest.raises(ValueError, match="b.json: not JSON"):
        _sharegpt_conversations(str(binary))
    ok = tmp_path / "ok.json"
    ok.write_text('[{"conversations": [{"from": "human", "value": "hi"}]}, {"id": 3}]')
    assert _sharegpt_conversations(str(ok)) == [[{"from": "human", "value": "hi"}], []]


@pytest.mark.timeout(60)
def test_outputs_checked_before_the_run_and_a_foreign_server_is_one_line(tmp_path):
    """--json / --plot that cannot be written fail before any request (they failed after the whole run), and a
    server that is not OpenAI-compatible (http.server: /v1/models is a 404) is one line, without httpx's link."""
    import http.server
    import threading

    for extra, message in ((["--json", "/proc/x.json"], "cannot write /proc/x.json"),
                           (["--plot", str(tmp_path / "p.txt")], "--plot .*: name a")):
        with pytest.raises(ValueError, match=message):  # port 1: a request would fail differently
            main_raising(["bench", "serve", "--url", "http://127.0.0.1:1", *extra])
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ValueError) as e:
            main_raising(["bench", "serve", "--url", f"http://127.0.0.1:{srv.server_address[1]}"])
    finally:
        srv.shutdown()
    assert str(e.value).startswith("cannot list models at") and "404" in str(e.value) and "\n" not in str(e.value)


def test_timeout_bounds_each_wait_not_the_stream_and_silent_servers_are_one_line(monkeypatch):
    """--timeout bounds each wait for data (httpx.Timeout): a stream that takes 4x the timeout with shorter gaps
    succeeds, one that stalls past it is a failed record that says so (httpx's timeouts have empty messages);
    a /v1/models that never answers is one line (str(e).splitlines()[0] was an IndexError)."""
    import asyncio

    from pagellm.bench import common
    from pagellm.bench.common import served_model
    from pagellm.bench.serve import _send
    from pagellm.bench.workload import BenchRequest

    async def sse(reader, writer, gap: float, chunks: int):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        for _ in range(chunks):
            writer.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            await writer.drain()
            await asyncio.sleep(gap)
        writer.write(b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 4}}\n\n'
                     b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()

    async def go():
        steady = await asyncio.start_server(lambda r, w: sse(r, w, 0.1, 4), "127.0.0.1", 0)
        stall = await asyncio.start_server(lambda r, w: sse(r, w, 0.6, 2), "127.0.0.1", 0)
        silent = await asyncio.start_server(lambda r, w: asyncio.sleep(5), "127.0.0.1", 0)
        urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in (steady, stall, silent)]
        async with httpx.AsyncClient(timeout=httpx.Timeout(0.25)) as session:
            recs = [await _send(session, u, "m", BenchRequest([100], 4), time.perf_counter()) for u in urls[:2]]
        # the probe's own limit (MODELS_PROBE_TIMEOUT_S, 0.3 s here) under a client's long one: bench serve had
        # waited its --timeout (600 s) on a port that never answers
        async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
            t = time.perf_counter()
            try:
                await served_model(client, urls[2], None, 1)
            except ValueError as e:
                recs.append(str(e))
            assert time.perf_counter() - t < 3
        for s in (steady, stall, silent):
            s.close()
        return recs

    monkeypatch.setattr(common, "MODELS_PROBE_TIMEOUT_S", 0.3)
    steady, stalled, silent = asyncio.run(go())
    assert steady.success and steady.output_tokens == 4 and steady.e2el > 0.25
    assert not stalled.success and stalled.error == "ReadTimeout: no data within --timeout"
    assert silent.startswith("cannot list models at") and "ReadTimeout, no answer within 0.3 s" in silent
    assert "\n" not in silent


def test_sharegpt_turns_without_a_value_are_skipped(tmp_path):
    import asyncio

    from pagellm.bench.serve import _sharegpt

    class Words:
        async def encode(self, text, special):
            return [100] * len(text.split())

    data = tmp_path / "d.json"
    data.write_text(json.dumps([
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "a b c d e"}]},
        {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "a b c d e"}]}]))
    reqs = asyncio.run(_sharegpt(Words(), str(data), 1, 0, 100))
    assert [(len(r.prompt_token_ids), r.output_len) for r in reqs] == [(2, 5)]  # was a KeyError: 'value'


def test_temperature_is_the_servers_unless_given():
    """As vLLM's bench serve, no temperature is sent by default (an OpenAI server then samples at 1); --temperature
    sends one (0: greedy)."""
    import asyncio

    from pagellm.bench.serve import _send
    from pagellm.bench.workload import BenchRequest

    bodies = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        bodies.append(json.loads(await reader.readexactly(length)))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                     b'data: {"choices": [{"text": "x"}]}\n\n'
                     b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n\n'
                     b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()

    async def go():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        async with httpx.AsyncClient(timeout=httpx.Timeout(5)) as client:
            recs = [await _send(client, url, "m", BenchRequest([100, 7], 1), time.perf_counter(), t)
                    for t in (None, 0.0, 0.7)]
        srv.close()
        return recs

    assert all(r.success for r in asyncio.run(go()))
    assert "temperature" not in bodies[0] and [b.get("temperature") for b in bodies[1:]] == [0.0, 0.7]
    assert bodies[0]["ignore_eos"] is True and bodies[0]["prompt"] == [100, 7] and bodies[0]["stream"] is True


def test_sse_lines_end_where_sse_says_not_where_splitlines_does():
    # vLLM's server writes U+2028 and its kin raw inside JSON strings; CR, LF and CR LF end lines, also split
    # across the pieces the transport hands over.
    pieces = ['data: {"t": "a\u2028b\x85c\u2029d"}\r', '\n\r\ndata: {"t": "e"}\r\rdata: [DO', 'NE]\n',
              ': a comment\nevent: x\ndata:{"t": "f"}']

    async def text(pieces):
        for p in pieces:
            yield p

    async def collect(pieces):
        return [d async for d in sse_data(text(pieces))]

    expected = ['{"t": "a\u2028b\x85c\u2029d"}', '{"t": "e"}', "[DONE]", '{"t": "f"}']
    assert asyncio.run(collect(pieces)) == expected
    assert asyncio.run(collect(list("".join(pieces)))) == expected  # one character a piece
    assert asyncio.run(collect(["data: [DONE] \r"])) == ["[DONE]"]
    assert len("".join(pieces).splitlines()) > 7  # what a splitlines reader would have made of it
