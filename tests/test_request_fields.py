"""vLLM's request fields in the engine: allowed_token_ids, bad_words (token-sequence semantics) and
truncate_prompt_tokens, each compared against a run without it."""

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.sample.sampler import SamplingRow
from pagellm.sample.token_masks import apply_token_masks, bad_words_token_ids

# a tiny model: seconds per test
pytestmark = pytest.mark.timeout(120)

PROMPT = [17, 230, 44, 91, 300, 12, 8, 77]


@pytest.fixture(scope="module")
def llm(tiny_hf_model, smollm_gguf_path):
    # SmolLM2's vocabulary, so that words tokenize as the server's would
    path = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)
    return LLM(path, tokenizer=smollm_gguf_path, kv_cache_memory="8MiB", max_model_len=64)


def _ids(llm, prompt, **kw):
    kw = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **kw}
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]


def test_allowed_token_ids_restrict_greedy_and_random_sampling(llm):
    allowed = [101, 2025, 333, 4000, 12345]
    free = _ids(llm, PROMPT).outputs[0].token_ids
    assert not set(free) <= set(allowed)
    for kw in ({}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0, "top_k": 2, "seed": 4, "logprobs": 2}):
        out = _ids(llm, PROMPT, allowed_token_ids=allowed, **kw).outputs[0]
        assert set(out.token_ids) <= set(allowed), kw
    one = _ids(llm, PROMPT, allowed_token_ids=[4000]).outputs[0].token_ids
    assert one == [4000] * 8
    with pytest.raises(ValueError, match=r"allowed_token_ids must be token ids in \[0, 49152\), got 49152"):
        _ids(llm, PROMPT, allowed_token_ids=[5, 49152])
    with pytest.raises(ValueError, match="allowed_token_ids must be unset with use_beam_search"):
        SamplingParams(use_beam_search=True, max_tokens=4, allowed_token_ids=[5])


def test_masks_that_leave_no_token_are_refused_or_fail_alone(llm):
    """allowed_token_ids that bad_words or min_tokens ban entirely: refused at admission. Masks that leave no
    token only later (a longer bad word completing, here the grammar of structured outputs): that request
    fails alone at that position, naming why, never sampling a banned id; the batch beside it is unchanged."""
    from pagellm.sampling_params import StructuredOutputsParams

    tok = llm.get_tokenizer()
    comma = tok.encode(",", add_special_tokens=False)
    with pytest.raises(ValueError, match="^allowed_token_ids must hold a token that bad_words does not ban$"):
        _ids(llm, PROMPT, allowed_token_ids=comma, bad_words=[","])
    eos = sorted(llm.engine.eos_token_ids)
    with pytest.raises(ValueError, match=r"^allowed_token_ids must hold a token that min_tokens \(which bans"):
        _ids(llm, PROMPT, allowed_token_ids=eos, min_tokens=2, ignore_eos=False)
    out = _ids(llm, PROMPT, allowed_token_ids=eos + comma, min_tokens=1, bad_words=["!"], ignore_eos=False)
    assert out.outputs[0].token_ids[0] == comma[0] and out.error is None  # the comma, then maybe the EOS
    with pytest.raises(ValueError, match="^allowed_token_ids must hold a token that can start the structured "):
        _ids(llm, PROMPT, allowed_token_ids=comma, ignore_eos=False,
             structured_outputs=StructuredOutputsParams(choice=["Paris", "Lyon"]))

    par = tok.encode("Par", add_special_tokens=False)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0].token_ids
    for kw in ({}, {"temperature": 1.0, "seed": 7}):
        masked = SamplingParams(max_tokens=6, allowed_token_ids=par, **{"temperature": 0.0, **kw},
                                structured_outputs=StructuredOutputsParams(choice=["Paris"]))
        digits = SamplingParams(max_tokens=3, bad_words=list("0123456789"), **{"temperature": 0.0, **kw},
                                structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
        outs = llm.generate([PROMPT, PROMPT, PROMPT], [masked, plain, digits], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == par and outs[0].outputs[0].finish_reason == "error"
        assert outs[0].error.startswith(f"no token is allowed at output position {len(par)}: allowed_token_ids")
        assert outs[2].outputs[0].token_ids == [] and outs[2].error.startswith(
            "no token is allowed at output position 0")
        assert outs[1].outputs[0].token_ids == alone and outs[1].error is None
    kv = llm.engine.kv_cache
    assert kv.pool.num_free == kv.num_blocks


def test_bad_words_ban_a_one_token_word_and_the_last_token_of_a_longer_one(llm):
    tok = llm.get_tokenizer()
    free = _ids(llm, PROMPT, max_tokens=12).outputs[0].token_ids
    encode = lambda w: tok.encode(w, add_special_tokens=False)  # noqa: E731

    # a generated token whose text, as a bad word, tokenizes back to that one token
    j, word = next((j, tok.decode([t])) for j, t in enumerate(free[1:], 1)
                   if [t] in bad_words_token_ids([tok.decode([t])], encode) and tok.decode([t]).strip())
    out = _ids(llm, PROMPT, max_tokens=12, bad_words=[word]).outputs[0].token_ids
    assert out[:j] == free[:j] and out[j] != free[j] and free[j] not in out

    # two generated tokens as one word: the first may come, never followed by the second
    k = next(k for k in range(1, 11) if [free[k], free[k + 1]] in bad_words_token_ids(
        [tok.decode(free[k:k + 2])], encode) and free[k] != free[k + 1])
    out = _ids(llm, PROMPT, max_tokens=12, bad_words=[tok.decode(free[k:k + 2])]).outputs[0].token_ids
    assert out[:k + 1] == free[:k + 1] and out[k + 1] != free[k + 1]


def test_bad_words_token_sequences_follow_vllm():
    # a toy tokenizer: one id per character, a leading space is its own id 0
    encode = lambda w: [0 if c == " " else ord(c) for c in w]  # noqa: E731
    assert bad_words_token_ids(["ab"], encode) == [[97, 98]]  # " ab" is longer: not a second form
    words = {" x": [120]}
    same_length = lambda w: words.get(w, [ord(c) for c in w])  # noqa: E731
    assert bad_words_token_ids(["x"], same_length) == [[120]]  # " x" starts like "x": the same ban

    rows = [SamplingRow(SamplingParams(), [], out, None) for out in ([], [5], [7, 5])]
    for r in rows:
        r.params.bad_words_token_ids = [[3], [5, 6]]
    x = torch.zeros(3, 10)
    apply_token_masks(x, rows)
    banned = [sorted(torch.nonzero(torch.isinf(x[i])).flatten().tolist()) for i in range(3)]
    assert banned == [[3], [3, 6], [3, 6]]


def test_truncate_prompt_tokens_keeps_the_last_ones(llm):
    long = [(7 * i) % 40000 + 50 for i in range(50)]
    cut = _ids(llm, long, truncate_prompt_tokens=10)
    assert cut.prompt_token_ids == long[-10:]
    assert cut.outputs[0].token_ids == _ids(llm, long[-10:]).outputs[0].token_ids
    assert _ids(llm, long[:5], truncate_prompt_tokens=10).prompt_token_ids == long[:5]
    # -1: as much as fits next to max_tokens in max_model_len (64)
    assert len(_ids(llm, long + long, truncate_prompt_tokens=-1).prompt_token_ids) == 64 - 8
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be at most max_model_len \(64\), got 65"):
        _ids(llm, long, truncate_prompt_tokens=65)
    text = llm.generate("hello there", SamplingParams(max_tokens=2, truncate_prompt_tokens=1), use_tqdm=False)[0]
    assert text.prompt is None and len(text.prompt_token_ids) == 1  # the text no longer matches the ids
