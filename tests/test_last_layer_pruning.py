"""The last layer runs attention, MLP and the final norm only for the rows whose logits are sampled (a prefill
chunk's last row, decode rows, drafts), after writing every row's k and v (ModelRunner's `_pruned_rows`,
LlamaForCausalLM.forward's `keep`). Checked against the unpruned forward of the same engine: a request that asks
for prompt logprobs runs unpruned."""

import random

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.core.step_message import ScheduledRows
from pagellm.model.attention import AttentionMetadata
from pagellm.model.runner import _prunes, _sampled_rows

pytestmark = pytest.mark.timeout(180)

# float32 on both sides: the kept row attends through the decode kernel instead of the prefill path (another
# summation order), so logprobs agree to rounding, not bit for bit
LOGPROB_TOL = 1e-4


def _pruned_rows(want: str, rows: list[ScheduledRows], meta: AttentionMetadata) -> list[int] | None:
    """The rows the runner keeps for the last layer, or None where it does not prune."""
    sampled = _sampled_rows(rows, meta)
    return sampled if _prunes(want, rows, sampled, meta.query_start_loc[-1]) else None


def meta_for(counts: list[int]) -> AttentionMetadata:
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return AttentionMetadata(slot_mapping=torch.zeros(0), block_tables=torch.zeros(0), query_start_loc=starts,
                             seq_lens=list(counts), block_size=16)


def test_pruned_rows_keep_what_is_sampled_and_nothing_when_all_rows_are():
    rows = [ScheduledRows("a", 0, 5, samples=False), ScheduledRows("b", 10, 3, spec_token_ids=[7, 8]),
            ScheduledRows("c", 0, 4)]
    meta = meta_for([5, 3, 4])
    # a's mid-prompt chunk samples nothing; b's last row and its two drafts; c's last row
    assert _pruned_rows("logits", rows, meta) == [5, 6, 7, 11]
    assert _pruned_rows("logits", [ScheduledRows("a", 0, 5, samples=False)], meta_for([5])) == []
    # every row sampled (decode rows): nothing to prune
    assert _pruned_rows("logits", [ScheduledRows("a", 4, 1), ScheduledRows("b", 9, 1)], meta_for([1, 1])) is None
    # other readers of every row's hidden state
    assert _pruned_rows("hidden", rows, meta) is None
    assert _pruned_rows("all_logits", rows, meta) is None
    with_prompt_logprobs = [*rows[:2], ScheduledRows("c", 0, 4, prompt_logprobs=(0, 1))]
    assert _pruned_rows("logits", with_prompt_logprobs, meta) is None


@pytest.fixture(scope="module")
def llm(tiny_hf_model, smollm_gguf_path):
    path = tiny_hf_model("llama", max_position_embeddings=1024)
    # 48 tokens a step: prompts of 40-150 tokens are cut into chunks, some steps sample no row at all
    return LLM(path, tokenizer=smollm_gguf_path, kv_cache_memory="8MiB", max_num_batched_tokens=48)


def test_pruned_steps_sample_what_the_unpruned_forward_does(llm, monkeypatch):
    calls = []
    backend = type(llm.engine.runner.backend)  # CpuPagedAttention; the reference backend without the kernels
    real = backend.forward_rows

    def spy(self, q, k, v, kv_cache, meta, scale, keep):
        calls.append((q.shape[0], keep.numel()))
        return real(self, q, k, v, kv_cache, meta, scale, keep)

    monkeypatch.setattr(backend, "forward_rows", spy)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(40, 150))] for _ in range(6)]
    pruned = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0),
                          use_tqdm=False)
    assert calls and any(kept == 0 for _, kept in calls) and all(kept < rows for rows, kept in calls)
    calls.clear()
    # prompt logprobs read every row: those steps run unpruned
    whole = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0,
                                                 prompt_logprobs=0), use_tqdm=False)
    for a, b in zip(pruned, whole, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        tok = a.outputs[0].token_ids[0]
        # the first token comes from the prompt's last chunk: pruned in one run, not in the other
        assert abs(first_a[tok].logprob - first_b[tok].logprob) < LOGPROB_TOL
    assert not calls  # decode steps sample every row, and the prompts' steps were not pruned
    assert llm.engine.kv_cache.pool.num_free == llm.engine.kv_cache.num_blocks
