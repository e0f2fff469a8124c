"""The step message (pagellm/core/step_message.py): what the workers rebuild from the diffs must be what the
scheduler holds, after every step, whatever moved the KV (forks and copy-on-write, preemption by recompute
or swap, beams, prefix hits, speculation). Checked on the in-process executor, whose runner keeps the same
`WorkerBatch` a worker process does."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm import LLM, SamplingParams
from pagellm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagellm.core.step_message import ScheduledRows, StepMessageBuilder, WorkerBatch
from pagellm.model.parallel import stage_layers
from pagellm.model.runner import ModelRunner
from pagellm.request import Request, RequestStatus

pytestmark = pytest.mark.timeout(300)


def _check_worker_view(engine, out) -> None:
    seqs = engine.runner.batch.seqs
    for s in out.scheduled:
        req, held = s.request, seqs[s.request.request_id]
        end = req.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids)
        assert held.token_ids[:end] == req.all_token_ids[:end], req.request_id
        assert held.block_ids == s.block_ids, req.request_id


@pytest.fixture(scope="module")
def engine_llm(tiny_hf_model, smollm_gguf_path):
    return lambda **kw: LLM(tiny_hf_model("llama"), tokenizer=smollm_gguf_path, block_size=4,
                            max_num_batched_tokens=24, **kw)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(3, 40), min_size=2, max_size=6), n=st.sampled_from([1, 2, 3]),
       beam=st.booleans(), swap=st.booleans(), spec=st.booleans(), shared=st.integers(0, 12))
def test_workers_hold_what_the_scheduler_holds_after_every_step(engine_llm, lengths, n, beam, swap, spec, shared):
    llm = engine_llm(kv_cache_memory="64KiB", preemption_mode="swap" if swap else "recompute", swap_space="64KiB",
                     **(dict(speculative_method="ngram", num_speculative_tokens=2, speculative_adaptive=False)
                        if spec else {}))
    engine = llm.engine
    prefix = [7, 8, 9] * 4
    for i, k in enumerate(lengths):
        prompt = prefix[:shared] + [(13 * i + j) % 400 + 3 for j in range(k)]
        params = (SamplingParams(max_tokens=12, use_beam_search=True, beam_width=2, ignore_eos=True) if beam and i == 0
                  else SamplingParams(max_tokens=12, n=n if i == 1 else 1,  # the n request sampled: it forks
                                      temperature=0.0 if i % 2 and i != 1 else 0.8, seed=i, ignore_eos=True))
        engine.add_request(f"r{i}", prompt, params)
    execute = engine.executor.execute

    def checked(out):
        result = execute(out)
        _check_worker_view(engine, out)
        return result

    engine.executor.execute = checked
    build = engine.executor.builder.build
    running = []

    def counting(out, *args, **kwargs):  # the batch each step belongs to, for the runner's path choice
        msg = build(out, *args, **kwargs)
        running.append(msg.num_running == sum(r.num_seqs for r in engine.scheduler.running) == out.num_running)
        return msg

    engine.executor.builder.build = counting
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert running and all(running)
    assert not engine.has_unfinished_requests()
    # every sequence the workers held is released once the requests are done (next message says so)
    engine.executor.run(engine.executor.builder.build(engine.scheduler.schedule()))
    assert not engine.runner.batch.seqs


def test_message_is_plain_data_and_carries_only_diffs():
    b = StepMessageBuilder(block_size=4)
    req = Request("a", [1, 2, 3, 4, 5], SamplingParams())
    req.status = RequestStatus.RUNNING
    first = b.build(SchedulerOutput([ScheduledRequest(req, 5, [3, 9])], 5))
    assert [n.token_ids for n in first.new] == [[1, 2, 3, 4, 5]] and not first.diffs
    req.num_computed_tokens = 5
    req.append_token(6)
    second = b.build(SchedulerOutput([ScheduledRequest(req, 1, [3, 9])], 1))
    assert not second.new and [(d.new_token_ids, d.blocks_from, d.block_ids) for d in second.diffs] == [([6], 2, [])]
    # copy-on-write replaced the block being written: that entry, not the whole table, is sent
    third = b.build(SchedulerOutput([ScheduledRequest(req, 1, [3, 11])], 1))
    assert [(d.blocks_from, d.block_ids) for d in third.diffs] == [(1, [11])]
    assert "Request" not in pickle.dumps(third).decode("latin-1")
    batch = WorkerBatch()
    for m in (first, second, third):
        batch.apply(pickle.loads(pickle.dumps(m)))
    assert batch.seqs["a"].block_ids == [3, 11] and batch.seqs["a"].token_ids[:6] == [1, 2, 3, 4, 5, 6]


def test_pipeline_stages_and_micro_batches():
    assert [stage_layers(30, r, 4) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_layers(2, r, 2) for r in range(2)] == [(0, 1), (1, 2)]
    runner = ModelRunner.__new__(ModelRunner)
    runner.pipeline = type("Link", (), {"micro_batches": 2})()
    rows = [ScheduledRows(str(i), 0, k) for i, k in enumerate([30, 2, 2, 30])]
    groups = runner._micro_batches(rows)
    assert [g[0] for g in groups] == [[0, 1], [2, 3]] and sum(len(g[1]) for g in groups) == 4
    assert runner._micro_batches(rows[:1]) == [([0], rows[:1])]


def test_a_sequence_preempted_between_two_messages_is_sent_whole_again():
    """A step that runs nothing sends no message, yet may preempt (the scheduler sets an idle beam aside);
    readmitted with prefix-cache hits on other blocks, the sequence keeps its computed count, so only its
    preemption count tells the builder that the table the workers hold is stale."""
    b = StepMessageBuilder(block_size=4)
    req = Request("a", list(range(1, 10)), SamplingParams())
    req.status = RequestStatus.RUNNING
    b.build(SchedulerOutput([ScheduledRequest(req, 9, [10, 11, 30])], 9))
    req.num_computed_tokens = 9
    req.num_preemptions += 1  # preempted and readmitted with hits on blocks 20, 21 (no message between)
    msg = b.build(SchedulerOutput([ScheduledRequest(req, 0 + 1, [20, 21, 30])], 1))
    assert [n.block_ids for n in msg.new] == [[20, 21, 30]] and "a" in msg.finished and not msg.diffs
