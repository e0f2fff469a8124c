"""Sampler semantics: greedy, seeded reproducibility, distributions, filters, penalties, logprobs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.kernels import ops
from pagellm.kernels.build import cpu_kernels
from pagellm.sample.sampler import Sampler, SamplingRow
from pagellm.sampling_params import SamplingParams

# pure Python or a tiny model: seconds here; a minute means something hangs
pytestmark = pytest.mark.timeout(60)

EOS = 3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def row(prompt=(), output=(), seed=None, device="cpu", **kw):
    params = SamplingParams(seed=seed, **kw)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    return SamplingRow(params, list(prompt), list(output), gen)


def draw(logits_row, n, device="cpu", **kw):
    """Sample n times from one row of logits as one batch of n identical unseeded rows."""
    logits = torch.as_tensor(logits_row, dtype=torch.float32, device=device).expand(n, -1).contiguous()
    return torch.tensor(Sampler([EOS])(logits, [row(**kw) for _ in range(n)]).token_ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(device, dtype):
    torch.manual_seed(0)
    logits = torch.randn(8, 50, device=device).to(dtype)
    logits[0, 7] = logits[0, 11] = logits[0].max() + 1  # tie: the lowest index wins
    out = Sampler([EOS])(logits, [row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.token_ids[0] == 7
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_rows_unaffected_by_random_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(6, 40)
    rows = [row(temperature=0.0 if i % 2 == 0 else 1.5, top_k=5 if i % 2 else -1) for i in range(6)]
    out = Sampler([EOS])(logits, rows)
    assert [out.token_ids[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()


def test_input_logits_not_mutated():
    logits = torch.randn(3, 20)
    before = logits.clone()
    rows = [row(temperature=0.8, top_p=0.5, repetition_penalty=1.5, prompt=[1, 2], logit_bias={4: 5.0}),
            row(temperature=0.0, frequency_penalty=1.0, output=[5, 5]),
            row(min_p=0.3, min_tokens=2, output=[1])]
    Sampler([EOS])(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_reproducible_across_batches(device):
    torch.manual_seed(2)
    vocab, steps = 64, 6
    target = torch.randn(vocab, device=device)

    def run(batch_size, pos, noise_seed):
        torch.manual_seed(noise_seed)  # the unseeded neighbours' draws differ run to run
        r = row(seed=1234, temperature=1.0, top_p=0.9, device=device)
        got = []
        for _ in range(steps):
            logits = torch.randn(batch_size, vocab, device=device) * 3
            logits[pos] = target
            rows = [row(temperature=1.0 if i % 2 else 0.0, seed=(i if i % 3 == 0 else None), device=device)
                    for i in range(batch_size)]
            rows[pos] = r
            got.append(Sampler([EOS])(logits, rows).token_ids[pos])
        return got

    alone = run(1, 0, 10)
    assert run(5, 3, 11) == alone
    assert run(9, 0, 12) == alone
    assert run(4, 1, 13) == alone
    # the seed matters: another seed (almost surely) gives another sequence
    other = row(seed=99, temperature=1.0, top_p=0.9, device=device)
    assert [Sampler([EOS])(target[None], [other]).token_ids[0] for _ in range(steps)] != alone


def chi_square(samples, probs):
    n = len(samples)
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * n
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature):
    torch.manual_seed(3)
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.7])
    samples = draw(logits, 40_000, temperature=temperature)
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001. Ignoring the temperature gives hundreds or more.
    assert chi_square(samples, torch.softmax(logits / temperature, -1)) < 18.47
    for wrong in (1.0, 0.5 * temperature):
        if wrong != temperature:
            assert chi_square(samples, torch.softmax(logits / wrong, -1)) > 100


def test_seeded_distribution_matches_softmax():
    logits = torch.tensor([0.5, 1.5, -1.0, 0.0])
    r = row(seed=5)
    samples = torch.tensor([Sampler([EOS])(logits[None], [r]).token_ids[0] for _ in range(4000)])
    assert chi_square(samples, torch.softmax(logits, -1)) < 16.27  # 3 dof, p = 0.001


def test_top_k_keeps_only_k():
    torch.manual_seed(4)
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.3, 1.9, -0.2, 0.0, 0.5, 0.4])
    samples = draw(logits, 3000, temperature=3.0, top_k=3)
    assert set(samples.tolist()) == {1, 3, 5}


def test_top_k_rows_mixed_k_and_disabled():
    torch.manual_seed(5)
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.3, -0.5]).expand(6000, -1).contiguous()
    ks = (2, -1, 4)
    rows = [row(temperature=5.0, top_k=ks[i % 3]) for i in range(6000)]
    ids = torch.tensor(Sampler([EOS])(logits, rows).token_ids)
    assert set(ids[0::3].tolist()) == {1, 3}
    assert set(ids[1::3].tolist()) == set(range(6))
    assert set(ids[2::3].tolist()) == {1, 3, 4, 0}


def test_top_k_keeps_ties_with_the_kth():
    # cutting at the k-th value keeps equal logits, so the set never depends on how topk orders ties
    torch.manual_seed(11)
    samples = draw([1.0, 2.0, 2.0, 0.0, 2.0], 2000, top_k=2)
    assert set(samples.tolist()) == {1, 2, 4}


def test_top_p_nucleus_beyond_the_candidates():
    # a flat distribution whose nucleus is far wider than the partial-topk candidates: the full sort runs
    torch.manual_seed(12)
    vocab = 5000
    logits = torch.linspace(0.0, 0.5, vocab)  # ascending: the nucleus is a suffix of the ids
    probs = torch.softmax(logits.double(), -1)
    first_kept = int((probs.flip(0).cumsum(0) - probs.flip(0) < 0.9).sum())  # nucleus size
    samples = draw(logits, 3000, top_p=0.9)
    assert samples.min() >= vocab - first_kept
    assert samples.min() < vocab - 2 * 1024  # far beyond the first 1024 candidates


PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


@pytest.mark.parametrize("top_p,nucleus",
                         [(0.4, {1}), (0.75, {1, 3}), (0.85, {1, 3, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_nucleus(top_p, nucleus):
    torch.manual_seed(6)
    samples = draw(PROBS.log(), 4000, top_p=top_p)
    assert set(samples.tolist()) == nucleus


def test_top_p_applies_to_top_k_survivors():
    torch.manual_seed(7)
    # top-2 renormalised: 1 -> 0.625, 3 -> 0.375; top_p 0.6 keeps only token 1 (without top-k it keeps {1, 3})
    samples = draw(PROBS.log(), 2000, top_k=2, top_p=0.6)
    assert set(samples.tolist()) == {1}


@pytest.mark.parametrize("min_p,kept", [(0.0, {0, 1, 2, 3}), (0.25, {1, 2, 3}), (0.5, {1, 3}), (0.7, {1})])
def test_min_p(min_p, kept):
    torch.manual_seed(8)
    samples = draw(PROBS.log(), 4000, min_p=min_p)
    assert set(samples.tolist()) == kept


LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0]


@pytest.mark.parametrize("kw,expected", [
    # seen (prompt 0,1 + output 2,2,4): positive / 2, negative * 2
    (dict(repetition_penalty=2.0), [1.0, -2.0, 0.25, 3.0, -4.0]),
    # output counts {2: 2, 4: 1}; the prompt does not count
    (dict(frequency_penalty=0.5), [2.0, -1.0, -0.5, 3.0, -2.5]),
    (dict(presence_penalty=0.25), [2.0, -1.0, 0.25, 3.0, -2.25]),
    # all three: repetition first, then frequency and presence
    (dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
     [1.0, -2.0, -1.0, 3.0, -4.75]),
])
def test_penalties_hand_computed(kw, expected):
    logits = torch.tensor([LOGITS, LOGITS])
    rows = [row(prompt=[0, 1], output=[2, 2, 4], **kw), row(prompt=[0, 1], output=[2, 2, 4])]
    x = Sampler([EOS]).process(logits, rows)
    assert x[0].tolist() == pytest.approx(expected)
    assert x[1].tolist() == LOGITS  # the neighbour without penalties is untouched


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0]])
    assert Sampler([EOS])(logits, [row(temperature=0.0, output=[0])]).token_ids == [0]
    assert Sampler([EOS])(logits, [row(temperature=0.0, output=[0], repetition_penalty=1.5)]).token_ids == [1]


@pytest.mark.parametrize("penalty", [3.0, 1e6, 1e-6])
def test_repetition_penalties_past_two_as_vllm_keep_logits_finite(penalty):
    """vLLM takes any penalty > 0 (pagellm once refused past 2); at the accepted bounds every float32 logit stays
    finite and a masked token stays masked."""
    logits = torch.tensor([[30.0, -30.0, 0.5, 3.0, -2.0]])
    x = Sampler([EOS]).process(logits, [row(prompt=[0, 1], output=[2], allowed_token_ids=[0, 1, 2])])
    assert torch.isfinite(x[0, :3]).all() and x[0, 3:].tolist() == [-math.inf, -math.inf]
    got = Sampler([EOS]).process(logits.clone(), [row(prompt=[0, 1], output=[2], repetition_penalty=penalty,
                                                      allowed_token_ids=[0, 1, 2])])[0]
    assert torch.isfinite(got[:3]).all() and got[3:].tolist() == [-math.inf, -math.inf]
    assert got[:3].tolist() == pytest.approx([30.0 / penalty, -30.0 * penalty, 0.5 / penalty], rel=1e-6)


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 5.0, 1.0, 9.0, 2.0]] * 4)
    rows = [row(output=[7], min_tokens=2, stop_token_ids=[1], temperature=0.0),
            row(output=[7, 7], min_tokens=2, stop_token_ids=[1], temperature=0.0),  # reached: no mask
            row(output=[7], min_tokens=2, stop_token_ids=[1], ignore_eos=True, temperature=0.0),
            row(output=[], min_tokens=1, temperature=1.0)]
    sampler = Sampler({EOS, 4})
    x = sampler.process(logits, rows)
    inf = float("-inf")
    assert x[0].tolist() == [0.0, inf, 1.0, inf, inf]
    assert x[1].tolist() == logits[1].tolist()
    assert x[2].tolist() == [0.0, inf, 1.0, 9.0, 2.0]
    assert x[3].tolist() == [0.0, 5.0, 1.0, inf, inf]
    out = sampler(logits, rows)
    assert out.token_ids[:3] == [2, 3, 3]
    assert out.token_ids[3] not in (EOS, 4)


def test_logit_bias_forces_token():
    torch.manual_seed(9)
    logits = torch.tensor([[3.0, 1.0, 0.0, 2.0, -4.0]] * 50)
    rows = [row(temperature=0.0 if i % 2 else 1.0, logit_bias={4: 100.0, 0: -100.0}) for i in range(50)]
    assert Sampler([EOS])(logits, rows).token_ids == [4] * 50
    x = Sampler([EOS]).process(logits[:1], [row(logit_bias={4: 1.5, 99: 3.0})])  # out-of-vocab id ignored
    assert x[0].tolist() == [3.0, 1.0, 0.0, 2.0, -2.5]


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(10)
    logits = torch.randn(4, 30) * 2
    rows = [row(logprobs=5, temperature=0.0, repetition_penalty=2.0, prompt=list(range(30)),
                logit_bias={0: 50}),
            row(logprobs=None, temperature=1.0),
            row(logprobs=0, temperature=0.7, top_k=3),
            row(logprobs=20, seed=1)]
    out = Sampler([EOS])(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert out.token_ids[0] == 0  # the bias decided the token ...
    for i, tok in enumerate(out.token_ids):  # ... but logprobs are from the raw logits
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
    assert out.top_logprobs[1] is None and out.top_logprobs[2] == []
    for i, n in ((0, 5), (3, 20)):
        top = out.top_logprobs[i]
        vals, ids = ref[i].topk(n)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:], strict=False))


def test_logprobs_absent_when_nobody_asks():
    rows = [row(temperature=1.0), row(temperature=0.0, presence_penalty=1.0)]
    out = Sampler([EOS])(torch.randn(2, 10), rows)
    assert out.logprobs is None and out.top_logprobs is None


def allowed_set(logits, temperature, top_k, top_p, min_p):
    """Independent float64 reference; the tolerances make it a superset of fp32 rounding at the edges."""
    # Scale in fp32 as the sampler does (bit-identical), so that ties at the top-k boundary match.
    x = (torch.tensor(logits) / torch.tensor(temperature)).double()
    vocab = len(logits)
    ok = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        ok &= x >= x.topk(top_k).values[-1]
    probs = torch.where(ok, torch.softmax(x.masked_fill(~ok, -math.inf), -1), 0.0)
    if top_p < 1.0:
        # mass strictly above each token; ties count as not above, so any tie-break is allowed
        mass_above = (probs[None, :] * (probs[None, :] > probs[:, None])).sum(1)
        ok &= mass_above < top_p + 1e-4
    probs = torch.where(ok, probs, 0.0)
    ok &= probs >= min_p * probs.max() * (1 - 1e-4)
    return set(torch.nonzero(ok).flatten().tolist())


@settings(max_examples=150, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, allow_nan=False), min_size=2, max_size=24),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(-1, 25),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),  # 1.0 takes the sort-free top-k path
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_samples_lie_in_allowed_set(logits, temperature, top_k, top_p, min_p, seed):
    torch.manual_seed(seed)
    kw = dict(temperature=temperature, top_k=max(top_k, 0) or -1, top_p=top_p, min_p=min_p)
    allowed = allowed_set(logits, temperature, kw["top_k"], top_p, min_p)
    n = 64
    t = torch.tensor(logits).expand(n, -1).contiguous()
    rows = [row(seed=seed + i if i % 2 else None, **kw) for i in range(n)]
    got = set(Sampler([EOS])(t, rows).token_ids)
    assert got <= allowed, (got, allowed)


def test_argmax_rows_equals_argmax_on_ties_nan_and_masked_rows():
    """The sampler's greedy pick (`max(dim).indices`, faster on the CPU) is torch's argmax exactly: the first of
    equal values, a NaN as the largest, index 0 for a row of -inf."""
    from pagellm.sample.logprobs import argmax_rows

    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        x = (torch.randint(0, 4, (16, 1000), generator=g).float() if trial % 2
             else torch.randn(16, 1000, generator=g))
        x[3, 100 + trial] = float("nan")
        x[5] = float("-inf")
        for t in (x, x.bfloat16(), x[:, :999]):  # float32, bf16, a strided view
            assert torch.equal(argmax_rows(t), t.argmax(dim=-1))
        clean = x[[0, 1, 2, 4, 5, 6]]  # no NaN: float32 rows take the native kernel where it is built
        for t in (clean, clean[:, :999], clean[:, 1:17], clean[:, :15]):  # whole vectors, tails, a short row
            assert torch.equal(argmax_rows(t), t.argmax(dim=-1))


@pytest.mark.skipif(cpu_kernels() is None, reason="no native CPU kernels here")
def test_native_argmax_is_torchs_and_leaves_nan_rows_to_torch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 3, (40, 49152), generator=g).float()  # many ties for the largest value
    x[7, :100] = 5.0  # the largest value first in its row, repeated across lanes
    x[8, -1] = 9.0  # ... in the tail
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    x[11, 4000] = float("nan")
    assert ops.argmax_rows(x) is None  # torch's max takes the NaN: the caller asks torch


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_whose_next_row_allows_nothing_is_cut_not_the_request(temperature):
    """Speculation with masks: after draft A, allowed_token_ids {A, B} less the bad words [A, A] and [A, B] leave
    no token. Where the target's row 0 picks B (A is rejected), the row after A is never reached and the request
    goes on (it had failed as 'no token is allowed'); where row 0 itself allows nothing, it fails, naming it."""
    import dataclasses

    from pagellm.core.scheduler import ScheduledRequest
    from pagellm.request import Request
    from pagellm.sample.sampler import NoTokenAllowedError
    from pagellm.sample.step import StepSampler

    a, b, vocab = 5, 7, 16
    params = dataclasses.replace(SamplingParams(temperature=temperature, seed=0, max_tokens=8,
                                                allowed_token_ids=[a, b]), bad_words_token_ids=[[a, a], [a, b]])
    req = Request("r", [1, 2, 3], params)
    req.num_computed_tokens = 3
    logits = torch.zeros(3, vocab)
    logits[:, b] = 50.0  # B wins row 0 by far: draft A is rejected at any temperature
    step = StepSampler(Sampler([0]), torch.device("cpu"))
    sampled = step([ScheduledRequest(req, 3, [0], spec_token_ids=[a, a])], logits)
    assert sampled["r"].tokens[0].token_id == b and len(sampled["r"].tokens) == 1
    req.output_token_ids.append(a)  # now A came: after it nothing is allowed
    with pytest.raises(NoTokenAllowedError, match="^no token is allowed at output position 1"):
        step([ScheduledRequest(req, 3, [0], spec_token_ids=[b, b])], logits)


def test_ngram_verification_draws_each_position_as_a_plain_step():
    # A seeded request's verified tokens are the plain steps' tokens, whichever draw the plain step takes (here
    # temperature only: the fused softmax draw, whose rounding differs from a draw on probabilities now and then,
    # 1 in ~740 draws of 151,936 tokens: so many seeds).
    from pagellm.core.scheduler import ScheduledRequest
    from pagellm.request import Request
    from pagellm.sample.step import StepSampler

    step = StepSampler(Sampler([0]), torch.device("cpu"))
    x = torch.randn(3, 151_936, generator=torch.Generator().manual_seed(0)) * 2
    for seed in range(3000):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8)
        plain = Request("p", [1, 2, 3], params)
        for row in range(3):
            plain.output_token_ids.append(step([ScheduledRequest(plain, 1, [0])], x[row:row + 1])["p"].token_id)
        spec = Request("s", [1, 2, 3], params)
        drafts = plain.output_token_ids[:2]
        tokens = [t.token_id for t in step([ScheduledRequest(spec, 3, [0], spec_token_ids=drafts)], x)["s"].tokens]
        assert tokens == plain.output_token_ids, seed


def test_a_seeded_rows_draw_does_not_depend_on_its_neighbours_filters():
    # A temperature-only row takes the fused softmax draw, a min-p row the draw on filtered probabilities; they
    # round differently (1 token in ~740 of 151,936 differs), so the choice is per row, not per batch.
    x = torch.randn(2, 151_936, generator=torch.Generator().manual_seed(0)) * 2
    s = Sampler([0])
    nucleus = SamplingParams(temperature=1.0, min_p=0.01, seed=1)
    for seed in range(1000):
        params = SamplingParams(temperature=1.0, seed=seed)
        alone = s(x[:1], [SamplingRow(params, [1], [], torch.Generator().manual_seed(seed))]).token_ids[0]
        rows = [SamplingRow(params, [1], [], torch.Generator().manual_seed(seed)),
                SamplingRow(nucleus, [1], [], torch.Generator().manual_seed(1))]
        assert s(x, rows).token_ids[0] == alone, seed
