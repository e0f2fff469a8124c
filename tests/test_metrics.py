"""Prometheus metrics without a server: an AsyncLLMEngine under swap pressure moves the swap counters."""

import asyncio
import random

from prometheus_client.parser import text_string_to_metric_families

from pagellm import SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.llm_engine import LLMEngine
from pagellm.metrics import EngineMetrics


def samples(metrics: EngineMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if "finished_reason" not in s.labels}


def run_to_completion(engine, prompts, params, before=None) -> dict[str, float]:
    """Serve the prompts through an AsyncLLMEngine to the end; return the metrics it then exports."""

    async def main() -> dict[str, float]:
        ae = AsyncLLMEngine(engine)
        metrics = EngineMetrics(ae, "tiny")
        if before is not None:
            before(metrics)
        await ae.start()
        try:
            streams = [await ae.add_request(p, params) for p in prompts]
            for s in streams:
                async for _ in s:
                    pass
        finally:
            await ae.stop()
        return samples(metrics)

    return asyncio.run(main())


def test_swap_counters_move_under_swap_pressure(tiny_hf_model, smollm_gguf_path):
    block_bytes = 2 * 2 * 2 * 16 * 8 * 4  # K+V, 2 layers, 2 kv heads, head_dim 16, block 8, fp32
    engine = LLMEngine(EngineArgs(model=tiny_hf_model("llama", max_position_embeddings=1024),
                                  tokenizer=smollm_gguf_path, block_size=8, kv_cache_memory=30 * block_bytes,
                                  preemption_mode="swap", swap_space="1MiB"))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(10)] for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    def check_zero(metrics):
        before = samples(metrics)
        assert before["pagellm:num_swapped_out_total"] == before["pagellm:num_swapped_in_total"] == 0

    after = run_to_completion(engine, prompts, params, before=check_zero)
    stats = engine.scheduler.stats
    assert stats.num_swapped_out > 0
    assert after["pagellm:num_swapped_out_total"] == stats.num_swapped_out
    assert after["pagellm:num_swapped_in_total"] == stats.num_swapped_in == stats.num_swapped_out
    assert after["pagellm:num_preemptions_total"] >= stats.num_swapped_out


def test_spec_decode_counters_move(tiny_hf_model, smollm_gguf_path):
    engine = LLMEngine(EngineArgs(model=tiny_hf_model("llama", max_position_embeddings=1024),
                                  tokenizer=smollm_gguf_path, block_size=8, kv_cache_memory="4MiB",
                                  speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False))
    prompt = [7, 8, 9, 10] * 6
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    after = run_to_completion(engine, [prompt], params)
    stats = engine.scheduler.stats
    assert stats.num_draft_tokens > 0
    assert after["pagellm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert after["pagellm:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    assert after["pagellm:spec_decode_acceptance_rate"] == stats.num_accepted_tokens / stats.num_draft_tokens
    assert after["pagellm:spec_decode_mean_acceptance_length"] >= 1
