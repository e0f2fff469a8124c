"""Prefix caching, copy-on-write forks and swap preemption in the pure-Python core, with exact block ids."""

import pytest

from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request, RequestStatus
from pagellm.sampling_params import SamplingParams

# pure Python or a tiny model: seconds here; a minute means something hangs
pytestmark = pytest.mark.timeout(60)


def req(rid, tokens, max_tokens=4, salt=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), frozenset({99999}), cache_salt=salt)


def sched_for(num_blocks=16, block_size=4, budget=64, caching=True, mode="recompute", host=0, max_seqs=8):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, num_host_blocks=host)
    return Scheduler(SchedulerConfig(max_seqs, budget, num_blocks * block_size, True), kv, mode), kv


def step(sched, token=7):
    out = sched.schedule()
    sched.update(out, {s.request.request_id: token for s in out.scheduled if s.samples})
    return out


def test_hit_length_is_whole_blocks_and_capped_below_the_last_token():
    sched, kv = sched_for()
    a = req("a", range(13), max_tokens=1)
    sched.add_request(a)
    step(sched)  # a computed 13 tokens: blocks 0,1,2 full and cached; block 3 partial
    assert a.is_finished
    for n, expect in [(13, 12), (12, 8), (9, 8), (8, 4), (5, 4), (4, 0)]:
        hit, tokens = kv.get_computed_blocks(req(f"q{n}", range(n)))
        assert tokens == expect and hit == [0, 1, 2][:expect // 4], n
    # A different token inside block 1 breaks the chain there.
    other = list(range(13))
    other[5] = 500
    assert kv.get_computed_blocks(req("x", other)) == ([0], 4)


def test_eviction_is_lru_and_tail_of_a_chain_first():
    sched, kv = sched_for(num_blocks=4)
    a = req("a", range(100, 108), max_tokens=1)  # blocks 0, 1
    sched.add_request(a)
    step(sched)
    b = req("b", range(200, 208), max_tokens=1)  # blocks 2, 3 (never-used blocks go first)
    sched.add_request(b)
    step(sched)
    assert kv.pool.num_free == 4 and kv.get_computed_blocks(req("b1", range(200, 209))) == ([2, 3], 8)
    # Free queue: a's chain tail-first (1, 0), then b's (3, 2): the least recently used go first.
    c = req("c", range(300, 303), max_tokens=1)
    sched.add_request(c)
    out = step(sched)
    assert out.scheduled[0].block_ids == [1] and c.is_finished
    assert kv.pool.lookup(kv._hashes(req("a2", range(100, 108)))[1]) is None  # a's tail evicted
    assert kv.get_computed_blocks(req("a3", range(100, 109))) == ([0], 4)  # a's head survives
    assert kv.get_computed_blocks(req("b2", range(200, 209))) == ([2, 3], 8)  # b untouched


def test_salted_requests_never_share():
    sched, kv = sched_for()
    sched.add_request(req("a", range(9), max_tokens=1, salt="tenant-1"))
    step(sched)
    assert kv.get_computed_blocks(req("b", range(9), salt="tenant-2")) == ([], 0)
    assert kv.get_computed_blocks(req("c", range(9))) == ([], 0)
    assert kv.get_computed_blocks(req("d", range(9), salt="tenant-1"))[1] == 8


def test_fork_shares_prompt_blocks_and_copies_the_partial_one_on_write():
    sched, kv = sched_for(caching=False)
    leader = req("p#0", range(10), max_tokens=3)
    kids = [req(f"p#{i}", range(10), max_tokens=3) for i in (1, 2)]
    sched.add_request(leader)
    for k in kids:
        sched.add_request(k, fork_of=leader)
    assert sched.num_waiting == 1  # siblings wait outside the queue
    step(sched)  # leader prefills 10 tokens into blocks 0,1,2 (2 partial), then the siblings fork
    assert kv.block_table("p#1") == [0, 1, 2] == kv.block_table("p#2")
    assert [kv.pool.ref_cnt[b] for b in (0, 1, 2)] == [3, 3, 3]
    out = step(sched)  # each writer into shared block 2 copies it first; the last one left keeps it
    assert out.block_copies.cow == [(2, 3), (2, 4)]
    assert kv.block_table("p#0") == [0, 1, 3] and kv.block_table("p#1") == [0, 1, 4]
    assert kv.block_table("p#2") == [0, 1, 2]
    assert [kv.pool.ref_cnt[b] for b in (0, 1, 2, 3, 4)] == [3, 3, 1, 1, 1]
    while sched.has_unfinished_requests():
        step(sched)
    assert kv.pool.num_free == kv.num_blocks and kv.num_cow_copies == 2


def test_fork_at_a_block_boundary_needs_no_copy():
    sched, kv = sched_for(caching=False)
    leader = req("p#0", range(9), max_tokens=2)  # 8 shared tokens = 2 full blocks
    sched.add_request(leader)
    sched.add_request(req("p#1", range(9), max_tokens=2), fork_of=leader)
    step(sched)
    assert kv.block_table("p#1") == [0, 1]
    out = step(sched)
    assert out.block_copies.cow == [] and kv.block_table("p#1") == [0, 1, 3]


def test_aborting_a_leader_ends_siblings_that_never_forked():
    sched, kv = sched_for(caching=False)
    leader = req("p#0", range(10))
    kid = req("p#1", range(10))
    sched.add_request(leader)
    sched.add_request(kid, fork_of=leader)
    sched.abort_requests(["p#0"])
    assert kid.status == RequestStatus.FINISHED_ABORTED and not sched.has_unfinished_requests()


def test_swap_out_and_in_move_blocks_through_the_host_pool():
    sched, kv = sched_for(num_blocks=4, caching=False, mode="swap", host=4)
    a, b = req("a", range(7), max_tokens=6), req("b", range(50, 57), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    out = step(sched)  # both need a third block: b is swapped out to host blocks 0,1
    assert [r.request_id for r in out.preempted] == ["b"]
    assert out.block_copies.swap_out == [(2, 0), (3, 1)]
    assert kv.req_host_blocks["b"] == [0, 1] and b.num_computed_tokens == 8
    assert sched.stats.num_swapped_out == 1
    while not a.is_finished:
        out = step(sched)
    out = step(sched)  # b comes back without recomputing: only its next token is scheduled
    assert out.block_copies.swap_in == [(0, 2), (1, 3)] and kv.block_table("b") == [2, 3, 1]
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 1)]
    assert kv.host_pool.num_free == 4 and sched.stats.num_swapped_in == 1
    while sched.has_unfinished_requests():
        step(sched)
    assert kv.pool.num_free == 4


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    sched, kv = sched_for(num_blocks=4, caching=False, mode="swap", host=1)
    a, b = req("a", range(7), max_tokens=6), req("b", range(50, 57), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        step(sched)
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert "b" not in kv.req_host_blocks and sched.stats.num_swapped_out == 0


def test_reset_prefix_cache_only_when_idle():
    sched, kv = sched_for()
    a = req("a", range(9), max_tokens=2)
    sched.add_request(a)
    step(sched)
    assert not kv.reset_prefix_cache()
    while sched.has_unfinished_requests():
        step(sched)
    assert kv.get_computed_blocks(req("b", range(9)))[1] == 8
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(req("c", range(9))) == ([], 0)
