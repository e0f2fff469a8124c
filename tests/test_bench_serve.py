"""`pagellm bench serve`: the arrival process and metric formulas on their own, then whole runs through
the CLI against a real server (a subprocess on a tiny random Llama with SmolLM2's tokenizer)."""

import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

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
    for bad in (["itl:5"], ["ttft"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_dataset(["sharegpt-json", "x.json"]) == ("sharegpt-json", "x.json")
    with pytest.raises(ValueError, match="--dataset"):
        parse_dataset(["sharegpt-json"])


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
    rc = main(["bench", "serve", "--url", server_url + "/v1", "--num-prompts", "6", "--request-rate", "20",
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
    assert out_png.stat().st_size > 10_000 and out_png.read_bytes()[:4] == b"\x89PNG"


def test_sharegpt_dataset_run_with_tight_slo(server_url, tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"Question {i}: tell me about item {i}."},
                                {"from": "gpt", "value": "It is a thing. " * (i + 1)}]} for i in range(5)]
    convs.append({"conversations": [{"from": "gpt", "value": "no human turn, skipped"}]})
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(convs))
    out_json = tmp_path / "s.json"
    rc = main(["bench", "serve", "--url", server_url, "--num-prompts", "4", "--dataset", "sharegpt-json",
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
        main_raising(["bench", "serve", "--url", server_url, "--num-prompts", "9", "--dataset", "sharegpt-json",
                      str(data)])


def test_local_tokenizer_instead_of_the_servers_endpoints(server_url, smollm_gguf_path, tmp_path):
    """--tokenizer: the vocabulary and sharegpt token counts come from the local tokenizer, as against a
    server whose /detokenize checks no range (vLLM's); they agree with what the server's endpoints say."""
    from pagellm.tokenizer import Tokenizer

    out_json = tmp_path / "t.json"
    rc = main(["bench", "serve", "--url", server_url, "--num-prompts", "3", "--input-len", "12", "--output-len", "4",
               "--tokenizer", smollm_gguf_path, "--json", str(out_json)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    _check(report, 3, [4] * 3)
    assert report["tokenizer"] == smollm_gguf_path and all(r["prompt_tokens"] == 12 for r in report["requests"])

    text = "Question: tell me about the tokenizer."
    convs = [{"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "It splits text. " * 3}]}]
    data = tmp_path / "one.json"
    data.write_text(json.dumps(convs))
    rc = main(["bench", "serve", "--url", server_url, "--num-prompts", "1", "--dataset", "sharegpt-json", str(data),
               "--tokenizer", smollm_gguf_path, "--json", str(out_json)])
    assert rc == 0
    served = httpx.post(server_url + "/tokenize", json={"prompt": text, "add_special_tokens": True}).json()["tokens"]
    local = Tokenizer.from_path(smollm_gguf_path).encode(text, add_special_tokens=True)
    assert local == served and json.loads(out_json.read_text())["requests"][0]["prompt_tokens"] == len(local)


def main_raising(argv: list[str]) -> int:
    from pagellm.cli import build_parser

    ns = build_parser().parse_args(argv)
    return ns.func(ns)
