"""The start-up line's memory figures are what the engine holds and can run (a report-only probe of memory
accounting found the two below wrong)."""

from __future__ import annotations

import logging

import pytest

from pagellm import LLM, SamplingParams
from pagellm.kernels.build import cpu_kernels

pytestmark = pytest.mark.timeout(180)


def test_max_concurrency_counts_whole_blocks_and_that_many_sequences_run_at_once(tiny_hf_model, smollm_gguf_path):
    """At a max_model_len of 100 tokens a sequence takes 7 blocks of 16: tokens over max_model_len had promised
    14.6 sequences where 13 fit (the 14th preempted one)."""
    llm = LLM(tiny_hf_model("llama"), tokenizer=smollm_gguf_path, kv_cache_memory="256KiB", max_model_len=100,
              dtype="float32")
    eng = llm.engine
    blocks = eng.kv_cache.num_blocks
    assert eng.max_concurrency == blocks / 7 and blocks * 16 / 100 > int(eng.max_concurrency) + 1  # the old figure
    n = int(eng.max_concurrency)
    prompts = [[5 + i] * 96 for i in range(n)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert eng.scheduler.stats.num_preemptions == 0


def test_a_draft_model_keeps_blocks_only_and_says_when_its_cache_is_full(tiny_gguf_model, smollm_gguf_path, caplog):
    """The draft had kept float copies beside its blocks (a SmolLM2 draft: 619 MiB against the target's 106),
    and a full draft cache had dropped drafts without a word."""
    path = tiny_gguf_model("llama", qtype="Q8_0")
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = LLM(path, tokenizer=smollm_gguf_path, kv_cache_memory="8MiB", speculative_method="draft",
                  draft_model=path, draft_kv_cache_memory="12KiB", speculative_adaptive=False, dtype="float32")
    draft = llm.engine.proposer.executor.runner.model
    if cpu_kernels() is not None:  # the kernels read the blocks: no float copy beside them
        assert draft.layers[0].mlp.gate_up_proj.weight_t.numel() == 0
    assert any("draft model" in r.getMessage() and "MiB" in r.getMessage() for r in caplog.records)
    blocks = llm.engine.proposer.kv.num_blocks
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagellm"):
        long = [[7 + i] * (blocks * 16) for i in range(2)]  # more than the draft's cache holds
        llm.generate(long, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        llm.generate(long, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    said = [r for r in caplog.records if "draft model's KV cache" in r.getMessage()]
    assert len(said) == 1  # once
