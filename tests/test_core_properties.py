"""Property tests: random add / step / abort interleavings keep the block invariants of docs/architecture.md."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams

# pure Python or a tiny model: seconds here; a minute means something hangs
pytestmark = pytest.mark.timeout(60)

EOS = 3


def check_invariants(sched: Scheduler, kv: KVCacheManager) -> None:
    pool = kv.pool
    held = Counter(b for table in kv.req_blocks.values() for b in table)
    for b in range(pool.num_blocks):
        assert pool.ref_cnt[b] == held[b], f"block {b}: ref {pool.ref_cnt[b]} != {held[b]} tables"
        assert pool.is_free(b) == (pool.ref_cnt[b] == 0), f"block {b} free/held mismatch"
    assert pool.num_free + len(held) == pool.num_blocks
    if kv.host_pool is not None:
        host_held = Counter(b for table in kv.req_host_blocks.values() for b in table)
        assert all(kv.host_pool.ref_cnt[b] == host_held[b] for b in range(kv.host_pool.num_blocks))
        assert kv.host_pool.num_free + len(host_held) == kv.host_pool.num_blocks
    live = {r.request_id for r in sched.running}
    assert set(kv.req_blocks) <= live | {r.request_id for r in sched.waiting}
    for r in sched.running:
        assert len(kv.block_table(r.request_id)) * kv.block_size >= r.num_computed_tokens
    for r in sched.waiting:
        assert r.request_id not in kv.req_blocks
    assert len(sched.running) <= sched.config.max_num_seqs
    for b, h in enumerate(pool.block_hash):  # a cached hash maps back to its block
        if h is not None:
            assert pool.lookup(h) == b


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.integers(1, 3)),
        st.tuples(st.just("step"), st.integers(0, 10**6)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4, 8]),
       budget=st.integers(1, 48), max_seqs=st.integers(1, 6), chunked=st.booleans(), caching=st.booleans(),
       host_blocks=st.sampled_from([0, 2, 8, 32]), prefill_cap=st.sampled_from([0, 1, 3, 256]))
def test_random_interleavings_keep_invariants(ops, num_blocks, block_size, budget, max_seqs, chunked, caching,
                                              host_blocks, prefill_cap):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, num_host_blocks=host_blocks)
    max_len = num_blocks * block_size
    sched = Scheduler(SchedulerConfig(max_seqs, max(budget, max_len) if not chunked else budget, max_len,
                                      chunked, prefill_cap), kv, "swap" if host_blocks else "recompute")

    def schedule():
        """One step's schedule; beside decodes with at most one request waiting (max_seqs // 8 is 0 here),
        prompts take at most the cap."""
        few_waiting = len(sched.waiting) <= 1
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running)
        out = sched.schedule()
        prompt_tokens = sum(s.num_new_tokens for s in out.scheduled
                            if s.request.num_tokens - s.request.num_computed_tokens > 1)
        if prefill_cap and chunked and few_waiting and decoding:
            assert prompt_tokens <= prefill_cap
        return out

    added = []
    for op in ops:
        if op[0] == "add":
            _, n_prompt, max_tokens, prefix_family, n = op
            if n_prompt >= max_len or n > max_seqs:
                continue
            # Prompts of one family share a prefix, so prefix caching gets hits.
            prompt = [10 + prefix_family] * (n_prompt // 2) + list(range(100, 100 + n_prompt - n_prompt // 2))
            leader = None
            for _ in range(n):  # n > 1: siblings fork from the leader's prompt blocks (copy-on-write)
                req = Request(f"r{len(added)}", prompt, SamplingParams(max_tokens=max_tokens), frozenset({EOS}))
                sched.add_request(req, fork_of=leader)
                leader = leader or req
                added.append(req)
        elif op[0] == "step":
            out = schedule()
            seed = op[1]
            sampled = {s.request.request_id: (seed + i) % 50 for i, s in enumerate(out.scheduled) if s.samples}
            sched.update(out, sampled)
        elif added:
            sched.abort_requests([added[op[1] % len(added)].request_id])
        check_invariants(sched, kv)
    steps = 0
    while sched.has_unfinished_requests():
        out = schedule()
        assert out.scheduled, "scheduler stalled with unfinished requests"
        sched.update(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
        check_invariants(sched, kv)
        steps += 1
        assert steps < 10_000
    assert kv.pool.num_free == kv.num_blocks, "blocks leaked after every request finished"
    for r in added:
        assert r.is_finished
        assert r.num_output_tokens <= r.params.max_tokens
