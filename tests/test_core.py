"""Block pool, KV-cache manager and scheduler: pure Python, exact block ids."""

import sys

import pytest

from pagellm.config import SchedulerConfig
from pagellm.core.block_pool import BlockPool
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request, RequestStatus
from pagellm.sampling_params import SamplingParams

# pure Python or a tiny model: seconds here; a minute means something hangs
pytestmark = pytest.mark.timeout(60)


def make_req(rid, n_prompt, max_tokens=8, first_token=0, **kw):
    return Request(rid, list(range(first_token, first_token + n_prompt)),
                   SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=frozenset({99999}))


def make_sched(num_blocks=8, block_size=4, budget=16, max_seqs=8, chunked=True, caching=False, max_len=None):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    cfg = SchedulerConfig(max_seqs, budget, max_len or num_blocks * block_size, chunked)
    return Scheduler(cfg, kv), kv


def run_step(sched, token=7):
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    sched.update(out, sampled)
    return out


def test_core_never_imports_torch():
    import pagellm.core.scheduler  # noqa: F401

    for mod in ("pagellm.core.block_pool", "pagellm.core.kv_cache_manager", "pagellm.core.scheduler",
                "pagellm.core.prefix_hash", "pagellm.request"):
        src = open(sys.modules[mod].__file__).read()
        assert "import torch" not in src, mod


def test_block_pool_allocates_in_order_and_frees_to_the_tail():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])
    assert pool.num_free == 3
    # Free queue order is now 3, 1, 0: the never-used block first, then in the order freed.
    assert pool.allocate(3) == [3, 1, 0]
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_block_pool_ref_counts_and_touch_revives_free_blocks():
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    pool.touch([b])
    assert pool.ref_cnt[b] == 2
    pool.free([b])
    assert pool.ref_cnt[b] == 1 and not pool.is_free(b)
    pool.free([b])
    assert pool.is_free(b)
    pool.touch([b])
    assert not pool.is_free(b) and pool.ref_cnt[b] == 1 and pool.num_free == 2


def test_allocate_slots_grows_on_demand():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = make_req("a", 5)
    assert kv.allocate_slots(r, 5) == [0, 1]
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3) == []  # fits in block 1
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1) == [2]
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.allocate_slots(r, 9) is None  # needs 3 more, 1 free: nothing changes
    assert kv.block_table("a") == [0, 1, 2]
    kv.free(r)
    assert kv.pool.num_free == 4 and kv.usage() == 0.0


def test_mixed_step_prefills_in_chunks_and_decodes_together():
    sched, kv = make_sched(num_blocks=16, block_size=4, budget=10)
    a, b = make_req("a", 3), make_req("b", 20)
    sched.add_request(a)
    sched.add_request(b)
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 3), ("b", 7)]
    assert kv.block_table("a") == [0] and kv.block_table("b") == [1, 2]
    assert a.output_token_ids == [7] and b.output_token_ids == []
    out = run_step(sched)  # a decodes one token, b continues its prefill with the rest of the budget
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert kv.block_table("b") == [1, 2, 3, 4]
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 4)]
    assert b.output_token_ids == [7]


def test_no_chunked_prefill_waits_for_a_budget_that_fits_the_prompt():
    sched, _ = make_sched(num_blocks=16, block_size=4, budget=10, chunked=False)
    sched.add_request(make_req("a", 6))
    sched.add_request(make_req("b", 6))
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 6)]
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 6)]


def test_preemption_takes_the_latest_arrival_and_it_resumes():
    sched, kv = make_sched(num_blocks=4, block_size=4, budget=64)
    a, b = make_req("a", 7, max_tokens=6), make_req("b", 7, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # a: blocks 0,1 ; b: blocks 2,3
    run_step(sched)  # each has computed 8 tokens: both blocks full
    assert kv.block_table("a") == [0, 1] and kv.block_table("b") == [2, 3]
    out = run_step(sched)  # both need a third block: b (later arrival) is preempted for a
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert kv.block_table("a") == [0, 1, 3] and "b" not in kv.req_blocks
    assert sched.stats.num_preemptions == 1
    while sched.has_unfinished_requests():
        run_step(sched)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert kv.pool.num_free == 4


def test_stop_rules():
    sched, kv = make_sched()
    r = make_req("a", 3, max_tokens=5, stop_token_ids=[5], min_tokens=2)
    sched.add_request(r)
    run_step(sched, token=5)  # below min_tokens: a stop id does not stop
    assert not r.is_finished
    run_step(sched, token=5)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 5
    r2 = make_req("b", 3, max_tokens=2)
    sched.add_request(r2)
    run_step(sched, token=99999)  # eos
    assert r2.status == RequestStatus.FINISHED_STOPPED
    r3 = make_req("c", 3, max_tokens=2, ignore_eos=True)
    sched.add_request(r3)
    run_step(sched, token=99999)
    run_step(sched, token=99999)
    assert r3.status == RequestStatus.FINISHED_LENGTH and r3.output_token_ids == [99999, 99999]
    assert kv.pool.num_free == kv.num_blocks


def test_max_model_len_limits_prompt_and_output():
    sched, _ = make_sched(num_blocks=8, block_size=4, max_len=10)
    with pytest.raises(ValueError, match="10 tokens.*max_model_len is 10"):
        sched.add_request(make_req("x", 10))
    r = make_req("a", 8, max_tokens=100)
    sched.add_request(r)
    while sched.has_unfinished_requests():
        run_step(sched)
    assert r.num_tokens == 10 and r.status == RequestStatus.FINISHED_LENGTH


def test_max_num_seqs_caps_the_running_set():
    sched, _ = make_sched(num_blocks=32, max_seqs=2)
    for i in range(3):
        sched.add_request(make_req(str(i), 2))
    out = run_step(sched)
    assert len(out.scheduled) == 2 and sched.num_waiting == 1


def test_abort_frees_blocks_from_waiting_and_running():
    sched, kv = make_sched()
    a, b = make_req("a", 5), make_req("b", 5)
    sched.add_request(a)
    run_step(sched)
    sched.add_request(b)
    assert sched.abort_requests(["a", "b", "nope"]) == [a, b]
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert kv.pool.num_free == kv.num_blocks and not sched.has_unfinished_requests()


def test_prefix_cache_hit_reuses_blocks_and_leaves_last_token():
    sched, kv = make_sched(num_blocks=16, block_size=4, budget=64, caching=True)
    a = make_req("a", 10, max_tokens=1)
    sched.add_request(a)
    run_step(sched)
    assert a.is_finished  # its two full blocks [0, 1] stay cached; block 2 was partial
    b = make_req("b", 9, max_tokens=1)  # same first 9 tokens
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_computed_tokens == 8 and out.scheduled[0].num_new_tokens == 1
    assert kv.block_table("b")[:2] == [0, 1]
    c = make_req("c", 8, max_tokens=1)  # exactly two blocks: the last token must still be computed
    sched.add_request(c)
    hit, n = kv.get_computed_blocks(c)
    assert hit == [0] and n == 4


def test_prefix_lookups_count_once_per_admission():
    """The hit-rate statistics count a request's lookup when it is admitted: one that waits for blocks looks
    up at every step (it had been counted at each, overstating queries and hits)."""
    sched, kv = make_sched(num_blocks=6, block_size=4, budget=64, caching=True)
    a = make_req("a", 17, max_tokens=1)  # 5 blocks of 6
    sched.add_request(a)
    sched.schedule()
    assert (kv.prefix_queries, kv.prefix_hits) == (17, 0)
    b = make_req("b", 9, max_tokens=1, first_token=100)  # needs 3 blocks: waits while a holds 5
    sched.add_request(b)
    for _ in range(3):
        assert b not in [s.request for s in sched.schedule().scheduled]
    assert (kv.prefix_queries, kv.prefix_hits) == (17, 0)
    sched.finish_request(a, RequestStatus.FINISHED_LENGTH)
    assert b in [s.request for s in sched.schedule().scheduled]
    assert (kv.prefix_queries, kv.prefix_hits) == (17 + 9, 0)


def test_prompts_beside_decodes_take_the_prefill_allowance_unless_a_backlog_waits():
    kv = KVCacheManager(256, 16)
    sched = Scheduler(SchedulerConfig(16, 2048, 4096, True, max_prefill_tokens_while_decoding=256), kv)
    sched.add_request(make_req("d", 8, max_tokens=50))
    run_step(sched)  # "d" prefilled with the whole budget (nothing decodes yet); it decodes from now on
    sched.add_request(make_req("p", 600, first_token=100))
    sizes = [{s.request.request_id: s.num_new_tokens for s in run_step(sched).scheduled} for _ in range(3)]
    assert sizes == [{"d": 1, "p": 256}, {"d": 1, "p": 256}, {"d": 1, "p": 88}]  # the prompt in chunks of 256
    # more than max_num_seqs // 8 = 2 waiting: a backlog, admitted with the whole budget
    for i in range(3):
        sched.add_request(make_req(f"b{i}", 600, first_token=1000 + 1000 * i))
    assert [s.num_new_tokens for s in run_step(sched).scheduled] == [1, 1, 600, 600, 600]
    # no allowance (0): the whole budget beside decodes too
    kv = KVCacheManager(256, 16)
    sched = Scheduler(SchedulerConfig(16, 2048, 4096, True, max_prefill_tokens_while_decoding=0), kv)
    sched.add_request(make_req("d", 8, max_tokens=50))
    run_step(sched)
    sched.add_request(make_req("p", 600, first_token=100))
    assert [s.num_new_tokens for s in run_step(sched).scheduled] == [1, 600]
