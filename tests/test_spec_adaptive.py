"""Adaptive drafting (pagellm/spec_decode/adaptive.py): drafts are kept only where their expected tokens
are worth the measured cost of the rows that verify them; output never changes."""

import itertools
import math
import random

import pytest

from pagellm import LLM, SamplingParams
from pagellm.spec_decode.adaptive import (
    COMPARED_WITHIN,
    EXPLORE_EVERY,
    MAX_EXPLORE_EVERY,
    MIN_GAIN,
    OUTLIER,
    SpeculationController,
)

# pure Python or a tiny model: seconds here; a minute means something hangs
pytestmark = pytest.mark.timeout(60)


def warmed(costs: dict[int, float]) -> SpeculationController:
    ctl = SpeculationController()
    for rows, seconds in costs.items():
        ctl.observe_step(rows, seconds)
    ctl.num_plans = 1  # away from the exploration phases (0 and EXPLORE_EVERY // 2)
    return ctl


def test_first_steps_measure_plain_then_every_draft():
    ctl = SpeculationController()
    assert ctl.plan({"a": 4}, batch_rows=1) == {"a": 0}  # no plain-step time for 1 row yet
    ctl.observe_step(1, 0.010)
    assert ctl.plan({"a": 4}, batch_rows=1) == {"a": 4}  # nothing measured above 1 row yet
    assert ctl.plan({}, batch_rows=1) == {}


def test_drafts_are_dropped_when_rows_cost_more_than_they_bring():
    # each extra row costs 0.75 of a plain step; a request at the prior acceptance (0.5) gains 0.5 a row
    ctl = warmed({1: 1.0, 5: 4.0})
    assert ctl.plan({"a": 4}, batch_rows=1) == {"a": 0}
    # cheap rows and a request that is accepted 90% of the time: keep every draft
    ctl = warmed({1: 1.0, 5: 1.2})
    for _ in range(10):
        ctl.observe_request("a", drafted=4, accepted=4)
    assert ctl.accept_rate("a") > 0.85
    assert ctl.plan({"a": 4}, batch_rows=1) == {"a": 4}


def test_per_request_acceptance_decides_who_drafts():
    ctl = warmed({4: 1.0, 12: 1.8})  # 0.1 of a plain batch-4 step per extra row
    for _ in range(10):
        ctl.observe_request("copying", drafted=4, accepted=4)
        ctl.observe_request("writing", drafted=4, accepted=0)
    keep = ctl.plan({"copying": 4, "writing": 4}, batch_rows=4)
    assert keep == {"copying": 4, "writing": 0}
    ctl.retain({"copying"})
    assert "writing" not in ctl.acceptance and ctl.accept_rate("writing") == 0.5


def test_plans_near_break_even_keep_no_drafts():
    """A plan must promise MIN_GAIN more tokens per second than the plain step: the estimates err both ways,
    and a plan kept wrongly loses time while one dropped wrongly only forgoes a gain too small to measure."""
    assert 0.1 < MIN_GAIN < 0.2
    ctl = warmed({4: 1.0, 8: 1.6})  # a verification row costs 0.15 of a plain 4-row step
    ids = ["a", "b", "c", "d"]
    for rid in ids:
        ctl.acceptance[rid] = [[8.0, 10.0]]  # first drafts accepted 80% of the time: one draft each +12.5%
    assert ctl.plan(dict.fromkeys(ids, 1), batch_rows=4) == dict.fromkeys(ids, 0)
    assert ctl.kept[4] == 0
    for rid in ids:
        ctl.acceptance[rid] = [[9.5, 10.0]]  # 95%: +21.9%
    assert ctl.plan(dict.fromkeys(ids, 1), batch_rows=4) == dict.fromkeys(ids, 1)


def test_a_slow_minute_measured_at_one_row_count_moves_every_row_counts_estimate():
    """The machine's speed is common to every step: plain steps measured in a slow minute must not make the
    verification rows measured before it look cheap (one average per row count kept drafts there)."""
    ctl = warmed({4: 0.0065, 8: 0.0104})  # the Zen 4 VM's batch-4 costs
    ids = ["a", "b", "c", "d"]
    for rid in ids:
        ctl.acceptance[rid] = [[8.0, 10.0]]  # one draft each: +12.5% at these costs, below MIN_GAIN
    assert ctl.plan(dict.fromkeys(ids, 1), batch_rows=4) == dict.fromkeys(ids, 0)
    for _ in range(COMPARED_WITHIN):  # plain steps, then a slow minute
        ctl.observe_step(4, 0.0065)
    for _ in range(10):
        ctl.observe_step(4, 1.4 * 0.0065)
    assert ctl.step_cost == pytest.approx({4: 0.0065, 8: 0.0104}, rel=1e-9)  # they moved the speed alone
    assert ctl.cost(4) == pytest.approx(1.4 * 0.0065, rel=0.05)
    assert ctl.cost(8) == pytest.approx(1.4 * 0.0104, rel=0.1)  # never measured in the slow minute
    assert ctl.plan(dict.fromkeys(ids, 1), batch_rows=4) == dict.fromkeys(ids, 0)
    # and where the speed does not explain a row count's time, its shape moves: 8 rows got cheaper
    for _ in range(60):
        ctl.observe_step(8, 1.4 * 0.0080)
        ctl.observe_step(4, 1.4 * 0.0065)
    assert ctl.cost(8) / ctl.cost(4) == pytest.approx(0.0080 / 0.0065, rel=0.05)
    assert ctl.plan(dict.fromkeys(ids, 1), batch_rows=4) == dict.fromkeys(ids, 1)


def test_one_slow_step_moves_the_estimates_as_one_step_of_outlier_times_at_most():
    ctl = warmed({4: 0.0065, 8: 0.0104})
    ctl.observe_step(4, 5 * 0.0065)  # stolen time
    assert ctl.cost(4) <= OUTLIER * 0.0065 and ctl.cost(8) <= OUTLIER * 0.0104
    # a step that is no outlier moves the estimate part of the way
    ctl = warmed({4: 0.0065})
    ctl.observe_step(12, 0.016)
    ctl.observe_step(12, 0.014)
    assert 0.014 < ctl.cost(12) < 0.016
    # and a clock that did not move, or NaN, measures nothing
    before = (dict(ctl.step_cost), ctl.speed)
    for bad in (0.0, -0.001, float("nan"), float("inf")):
        ctl.observe_step(12, bad)
        ctl.observe_step(16, bad)
    assert (ctl.step_cost, ctl.speed) == before


@pytest.mark.parametrize("seed", range(5))
def test_a_row_count_not_measured_for_minutes_keeps_its_estimate_on_a_steady_machine(seed):
    """Speed and shape split a step's time only up to a common factor: shapes that moved with every step's noise
    dragged the estimate of a row count not measured since along with them (a review's probe: x0.6-x1.5 after
    30,000 steps). Batch 4 after its back-off: plain steps, one-draft probes every 16th, 20 rows measured once."""
    rng = random.Random(seed)
    truth = {4: 0.0065, 8: 0.0104, 20: 0.0223}
    ctl = warmed({4: truth[4], 20: truth[20]})
    for i in range(30_000):
        rows = 8 if i % 16 == 0 else 4
        spike = rng.uniform(1.5, 3) if rng.random() < 0.02 else 1  # the Zen 4 VM's stolen time
        ctl.observe_step(rows, truth[rows] * spike * math.exp(rng.gauss(0, 0.03)))
    assert ctl.cost(20) / ctl.cost(4) == pytest.approx(truth[20] / truth[4], rel=0.12)
    assert ctl.cost(8) / ctl.cost(4) == pytest.approx(truth[8] / truth[4], rel=0.05)


def test_acceptance_is_measured_per_draft_position():
    """n-gram drafts come in runs: half the time no draft is right, the other half all four are. The j-th
    draft is then worth about 0.5 (not 0.5^j), so four drafts pay where a geometric model would keep one."""
    ctl = warmed({1: 1.0, 5: 2.2})  # each extra row 0.3 of a plain step
    for i in range(20):
        ctl.observe_request("a", drafted=4, accepted=4 if i % 2 else 0)
    values = ctl.draft_values("a", 4)
    assert 0.4 < values[0] < 0.6 and values[3] > 0.8 * values[0]
    assert ctl.plan({"a": 4}, batch_rows=1) == {"a": 4}


def test_exploration_keeps_measuring_both_ends_and_backs_off_while_drafts_lose():
    ctl = warmed({1: 1.0, 5: 4.0})  # drafts never pay here
    plans = [ctl.plan({"a": 3}, batch_rows=1)["a"] for _ in range(4 * MAX_EXPLORE_EVERY)]
    explored = [i for i, k in enumerate(plans) if k > 0]
    gaps = [b - a for a, b in itertools.pairwise(explored)]
    assert gaps[0] == EXPLORE_EVERY and gaps == sorted(gaps) and gaps[-1] == MAX_EXPLORE_EVERY
    assert plans.count(0) == len(plans) - len(explored)
    # explorations after plans that kept no draft probe with one draft per request, not all three
    assert {plans[i] for i in explored} == {1}
    # once drafts pay again (cheap rows, a request that copies), the period is back at EXPLORE_EVERY
    for rows, seconds in {1: 1.0, 5: 1.1}.items():
        ctl.step_cost[rows] = seconds
    for _ in range(10):
        ctl.observe_request("a", drafted=3, accepted=3)
    ctl.num_plans = 1
    assert ctl.plan({"a": 3}, batch_rows=1) == {"a": 3} and 1 not in ctl.every


def test_cost_interpolates_and_extrapolates():
    ctl = warmed({2: 1.0, 6: 2.0})
    assert ctl.cost(4) == 1.5  # between two measured row counts
    assert ctl.cost(10) == 3.0  # beyond: the measured per-row slope
    assert ctl.cost(1) == 0.75
    assert SpeculationController().cost(3) is None


def test_engine_output_is_identical_and_drafts_follow_the_measured_cost(tiny_hf_model, smollm_gguf_path):
    """With the engine's own measurements, and with a rigged cost table that makes every draft a loss,
    greedy output equals non-speculative decoding; the rigged engine verifies drafts only when it explores."""
    tiny = tiny_hf_model("llama", max_position_embeddings=1024)
    rng = random.Random(3)
    prompts = [([rng.randrange(3, 512) for _ in range(5)] * 6)[:rng.randint(12, 30)] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def make(**kw):
        return LLM(tiny, tokenizer=smollm_gguf_path, block_size=8, kv_cache_memory="8MiB", **kw)

    def greedy(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    plain = greedy(make())
    adaptive = make(speculative_method="ngram", num_speculative_tokens=4)
    assert greedy(adaptive) == plain
    assert adaptive.engine.spec_controller is not None and adaptive.engine.spec_controller.step_cost

    rigged = make(speculative_method="ngram", num_speculative_tokens=4)
    ctl = rigged.engine.spec_controller
    ctl.observe_step = lambda rows, seconds: None  # keep the rigged costs: each extra row a whole step
    ctl.step_cost.update({r: float(r) for r in range(1, 64)})
    assert greedy(rigged) == plain
    # only exploration steps (one plan in EXPLORE_EVERY) verify drafts, for at most 6 requests each
    explored = ctl.num_plans // EXPLORE_EVERY + 1
    assert 0 < rigged.engine.scheduler.stats.num_spec_steps <= 6 * explored < rigged.engine.stats.steps
