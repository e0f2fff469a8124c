"""/metrics with vLLM's (V1) names, types and labels: under pagellm: and, with --vllm-metric-names, under
vllm: too; every series moves as the requests it counts say it must."""

import asyncio
import random

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import MODEL, Server

from pagellm import SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.llm_engine import LLMEngine
from pagellm.metrics import EngineMetrics

pytestmark = pytest.mark.timeout(240)

# name -> type, as vLLM exports them (counters without prometheus_client's _total suffix)
VLLM_METRICS = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "num_requests_swapped": "gauge",
    "kv_cache_usage_perc": "gauge", "gpu_cache_usage_perc": "gauge", "cache_config_info": "gauge",
    "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
    "num_preemptions": "counter", "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
    "gpu_prefix_cache_queries": "counter", "gpu_prefix_cache_hits": "counter",
    "spec_decode_num_drafts": "counter", "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter", "spec_decode_num_accepted_tokens_per_pos": "counter",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "time_per_output_token_seconds": "histogram", "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram", "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram", "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram", "request_max_num_generation_tokens": "histogram",
    "request_params_n": "histogram", "request_params_max_tokens": "histogram",
    "iteration_tokens_total": "histogram",
}
PER_REQUEST = ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
               "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
               "request_generation_tokens", "request_max_num_generation_tokens", "request_params_n",
               "request_params_max_tokens", "request_time_per_output_token_seconds", "time_to_first_token_seconds")


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def values(text: str, prefix: str = "pagellm") -> dict[str, float]:
    """Sample name (+ its labels beyond model_name/engine) -> value, for one prefix."""
    out = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if not s.name.startswith(prefix + ":"):
                continue
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                             if k in ("finished_reason", "le", "position"))
            out[s.name[len(prefix) + 1:] + (f"{{{extra}}}" if extra else "")] = s.value
    return out


@pytest.fixture(scope="module")
def server(tiny_hf_model, smollm_gguf_path, tmp_path_factory):
    path = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)
    with Server.running(["--model", path, "--tokenizer", smollm_gguf_path, "--served-model-name", MODEL,
                         "--kv-cache-memory", "16MiB", "--vllm-metric-names"],
                        tmp_path_factory.mktemp("m") / "server.log") as s:
        yield s


def scrape(server) -> str:
    return httpx.get(server.url + "/metrics").text


def test_every_vllm_metric_has_its_type_and_labels_under_both_prefixes(server):
    fams = families(scrape(server))
    for prefix in ("pagellm", "vllm"):
        for name, kind in VLLM_METRICS.items():
            f = fams.get(f"{prefix}:{name}")
            assert f is not None and f.type == kind, (prefix, name, f and f.type)
            for s in f.samples:
                assert s.labels.get("model_name", MODEL) == MODEL and s.labels["engine"] == "0", s
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    (info,) = fams["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["cache_dtype"] == "float32"
    # 16 MiB of float32 K+V for 2 layers x 2 KV heads x head_dim 16 in 16-token blocks: 8 KiB per block.
    assert info.labels["num_gpu_blocks"] == str(16 * 2**20 // (2 * 2 * 2 * 16 * 16 * 4))


def test_metrics_move_as_the_requests_say(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    before = values(scrape(server))
    a = client.completions.create(model=MODEL, prompt="alpha beta gamma", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    b = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "two samples"}], n=2,
                                       max_tokens=4, temperature=0.8, seed=1, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt="delta epsilon", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    c = chunks[-1].usage
    text = scrape(server)
    after = values(text)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    usages = [a.usage, b.usage, c]
    # one per sample, by its own reason (vLLM counts n > 1 samples so), the latency histograms once per request
    assert delta("request_success_total{finished_reason=length}") == 1 + 2 + 1
    for h in PER_REQUEST:
        assert delta(f"{h}_count") == 3, h
    assert delta("prompt_tokens_total") == delta("request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert delta("generation_tokens_total") == delta("request_generation_tokens_sum") == 5 + 8 + 3
    assert delta("request_max_num_generation_tokens_sum") == 5 + 4 + 3  # the longest of the n samples
    assert delta("request_params_n_sum") == 1 + 2 + 1
    assert delta("request_params_max_tokens_sum") == 5 + 4 + 3
    # One inter-token observation per later output; TPOT is the same series under vLLM's old name.
    assert delta("inter_token_latency_seconds_count") == delta("time_per_output_token_seconds_count") >= 4 + 3 + 2
    # A request's phases: queue + prefill + decode = e2e; inference = prefill + decode.
    e2e, queue = delta("e2e_request_latency_seconds_sum"), delta("request_queue_time_seconds_sum")
    prefill, decode = delta("request_prefill_time_seconds_sum"), delta("request_decode_time_seconds_sum")
    inference = delta("request_inference_time_seconds_sum")
    assert 0 < prefill + decode <= e2e + 1e-6 and inference == pytest.approx(prefill + decode)
    assert queue + inference == pytest.approx(e2e, abs=1e-3) and e2e < 60
    # Each step feeds its prefill chunks and one token per decoding sequence.
    steps, fed = delta("iteration_tokens_total_count"), delta("iteration_tokens_total_sum")
    assert steps >= 5 and sum(u.prompt_tokens for u in usages) <= fed <= sum(u.total_tokens for u in usages) + 2
    assert delta("iteration_tokens_total_bucket{le=+Inf}") == steps
    # Histogram buckets are cumulative.
    buckets = sorted((float(k.split("le=")[1][:-1]), v) for k, v in after.items()
                     if k.startswith("e2e_request_latency_seconds_bucket"))
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    # vllm: is the same data under vLLM's prefix.
    assert values(text, "vllm") == after


def _run(engine: LLMEngine, prompts, params, watch) -> EngineMetrics:
    async def main():
        ae = AsyncLLMEngine(engine)
        metrics = EngineMetrics(ae, "tiny")
        await ae.start()
        try:
            streams = [await ae.add_request(p, params) for p in prompts]
            for s in streams:
                async for _ in s:
                    watch(values(metrics.render().decode()))
        finally:
            await ae.stop()
        return metrics

    return asyncio.run(main())


def test_spec_decode_accepted_tokens_per_position(tiny_hf_model, smollm_gguf_path):
    k = 3
    engine = LLMEngine(EngineArgs(model=tiny_hf_model("llama", max_position_embeddings=1024),
                                  tokenizer=smollm_gguf_path, block_size=8, kv_cache_memory="4MiB",
                                  speculative_method="ngram", num_speculative_tokens=k, speculative_adaptive=False))
    metrics = _run(engine, [[7, 8, 9, 10] * 6, [5, 6] * 10], SamplingParams(temperature=0.0, max_tokens=30,
                                                                            ignore_eos=True), lambda m: None)
    m = values(metrics.render().decode())
    per_pos = [m.get(f"spec_decode_num_accepted_tokens_per_pos_total{{position={j}}}", 0) for j in range(k)]
    stats = engine.scheduler.stats
    assert stats.num_accepted_tokens > 0 and sum(per_pos) == m["spec_decode_num_accepted_tokens_total"]
    # A draft token is accepted only after every earlier one: counts never grow with the position.
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= m["spec_decode_num_drafts_total"]
    assert m["spec_decode_num_drafts_total"] == stats.num_spec_steps


def test_swapped_gauge_counts_requests_in_host_memory(tiny_hf_model, smollm_gguf_path):
    block_bytes = 2 * 2 * 2 * 16 * 8 * 4  # K+V, 2 layers, 2 KV heads, head_dim 16, block 8, float32
    engine = LLMEngine(EngineArgs(model=tiny_hf_model("llama", max_position_embeddings=1024),
                                  tokenizer=smollm_gguf_path, block_size=8, kv_cache_memory=30 * block_bytes,
                                  preemption_mode="swap", swap_space="1MiB"))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(10)] for _ in range(10)]
    seen = []
    metrics = _run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                   lambda m: seen.append(m["num_requests_swapped"]))
    assert engine.scheduler.stats.num_swapped_out > 0 and max(seen) > 0
    assert values(metrics.render().decode())["num_requests_swapped"] == 0  # all swapped back in and done
