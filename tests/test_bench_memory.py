"""`pagellm bench memory` on a tiny random model: the scenarios' block accounting, and the model-free
replay the fragmentation numbers come from, checked step by step against a real engine."""

import argparse
import json

import pytest

from pagellm import LLM
from pagellm.bench.memory import (
    format_report,
    fragmentation_bench,
    parallel_sampling_bench,
    plot_report,
    replay_block_usage,
    run_memory_bench,
    shared_prefix_bench,
    track_blocks,
)
from pagellm.bench.workload import random_workload
from pagellm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def make_engine(tiny_hf_model, smollm_gguf_path):
    path = tiny_hf_model("llama", max_position_embeddings=1024)

    def make(**kw):
        kw.setdefault("kv_cache_memory", "8MiB")
        return LLM(path, tokenizer=smollm_gguf_path, block_size=8, **kw).engine

    return make


def test_shared_prefix_holds_the_prefix_once(make_engine):
    engine = make_engine()
    a = shared_prefix_bench(engine, num_requests=6, prefix_len=64, question_len=8, max_tokens=4)
    # 64 + 8 + 4 - 1 = 75 KV tokens = 10 blocks each; the 8 prefix blocks are shared with the cache.
    assert a["ideal_blocks_unshared"] == 60 and a["ideal_blocks_shared"] == 8 + 6 * 2
    assert a["without_cache"]["peak_blocks"] == 60 and a["without_cache"]["prefix_hit_tokens"] == 0
    assert a["with_cache"]["peak_blocks"] == 20
    assert a["with_cache"]["prefix_hit_tokens"] == 5 * 64
    assert engine.kv_cache.enable_caching  # restored
    assert engine.kv_cache.pool.num_free == engine.kv_cache.num_blocks


def test_parallel_sampling_shares_the_prompt(make_engine):
    engine = make_engine()
    b = parallel_sampling_bench(engine, n=4, prompt_len=45, max_tokens=6)
    # 50 KV tokens = 7 blocks each when independent; the forks share the 6 prompt blocks and copy the
    # partial last one (45 = 5 full blocks + 5 tokens).
    assert b["independent"]["peak_blocks"] == b["ideal_blocks_independent"] == 28
    assert b["parallel"]["cow_copies"] == 3 and b["independent"]["cow_copies"] == 0
    assert b["parallel"]["peak_blocks"] == 6 + 1 + 3 * 2


@pytest.mark.parametrize("kv", ["8MiB", 40 * 4096])  # 40 blocks: preemptions, the replay still agrees
def test_replay_matches_the_engine_step_by_step(make_engine, kv):
    engine = make_engine(kv_cache_memory=kv, enable_prefix_caching=False, max_num_batched_tokens=96)
    workload = random_workload(12, 512, (8, 120), (4, 40), seed=1, low_token_id=3)
    with track_blocks(engine.scheduler) as seen:
        for i, r in enumerate(workload):
            engine.add_request(f"r{i}", r.prompt_token_ids,
                               SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    replayed = replay_block_usage(engine.scheduler.config, engine.kv_cache.num_blocks,
                                  engine.kv_cache.block_size, workload)
    assert replayed == seen
    if kv != "8MiB":
        assert engine.scheduler.stats.num_preemptions > 0


def test_fragmentation_paged_wastes_less_than_a_block_per_sequence(make_engine):
    engine = make_engine()
    c = fragmentation_bench(engine, num_prompts=16, contiguous_len=1024)
    peak = c["peak"]
    assert peak["blocks"] * 8 - peak["tokens"] < 8 * peak["seqs"]  # under one block each
    assert peak["paged_waste"] < peak["reserve_max_tokens_waste"] < peak["contiguous_waste"]
    assert c["max_concurrent"]["paged"] >= c["max_concurrent"]["reserve_max_tokens"] \
        >= c["max_concurrent"]["contiguous"] == c["kv_capacity_tokens"] // 1024


def test_report_json_and_plot(make_engine, tmp_path):
    engine = make_engine()
    ns = argparse.Namespace(shared_requests=3, prefix_len=32, question_len=4, max_tokens=2, parallel_n=2,
                            parallel_prompt_len=20, num_prompts=8, contiguous_len=1024)
    rep = {"model": "tiny", **run_memory_bench(engine, ns)}
    text = format_report(rep)
    assert "with prefix cache" in text and "contiguous, max_model_len=1024" in text
    json.dumps(rep)
    plot_report(rep, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_cli_checks_its_outputs_and_prefix_before_loading(tmp_path, capsys):
    """--json / --plot that cannot be written failed after the three scenarios had run; --prefix-len 0 ran the
    shared-prefix scenario with nothing shared."""
    from pagellm.cli import build_parser

    parser = build_parser()
    ns = parser.parse_args(["bench", "memory", "--model", "/nonexistent", "--json", "/proc/x.json"])
    with pytest.raises(ValueError, match="cannot write /proc/x.json"):  # before the model (which is missing)
        ns.func(ns)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "memory", "--prefix-len", "0"])
    assert "--prefix-len: must be >= 1" in capsys.readouterr().err
