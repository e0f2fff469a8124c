"""AsyncLLMEngine on a tiny random Llama: concurrent requests, aborts, timeouts, queue limit, drain."""

import asyncio
import contextlib

import pytest
from polling import async_wait_until

from pagellm import SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.request_stream import QueueFullError, RequestTimeoutError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_hf_model, smollm_gguf_path):
    path = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)
    return LLMEngine(EngineArgs(model=path, tokenizer=smollm_gguf_path, kv_cache_memory="8MiB"))


def run(engine, body, **kw):
    """Run body(async_engine) with a started AsyncLLMEngine; check every block is free afterwards."""

    async def main():
        ae = AsyncLLMEngine(engine, **kw)
        await ae.start()
        try:
            return await body(ae)
        finally:
            await ae.stop()

    result = asyncio.run(main())
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.usage() == 0.0
    return result


def sync_greedy(engine, prompt, params=GREEDY):
    rid = engine.add_request(None, prompt, params)
    for _ in range(10 * params.max_tokens + 100):  # far more steps than the request can take
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0].token_ids
    raise AssertionError(f"request {rid} did not finish")


async def collect(ae, prompt, params=GREEDY, **kw):
    last = None
    async for out in ae.generate(prompt, params, **kw):
        last = out
    return last


PROMPTS = [[5 + i, 17, 300 + 7 * i, 42, 9] * (i + 1) for i in range(8)]


def test_concurrent_requests_match_the_sync_engine(engine):
    expected = [sync_greedy(engine, p) for p in PROMPTS]

    async def body(ae):
        return await asyncio.gather(*(collect(ae, p) for p in PROMPTS))

    outs = run(engine, body)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_a_consumer_that_stops_reading_aborts_its_request(engine):
    async def body(ae):
        gen = ae.generate(PROMPTS[0], LONG)
        async with contextlib.aclosing(gen):
            seen = 0
            async for _ in gen:
                seen += 1
                if seen == 3:
                    break
        # the abort lands between steps
        await async_wait_until(lambda: not engine.has_unfinished_requests(), what="abort applied")
        return ae.snapshot

    snap = run(engine, body)
    assert snap.num_running == 0 and snap.kv_cache_usage == 0.0
    assert snap.finished.get("abort", 0) >= 1


def test_cancelled_task_aborts_its_request(engine):
    async def body(ae):
        task = asyncio.ensure_future(collect(ae, PROMPTS[1], LONG))
        await async_wait_until(engine.has_unfinished_requests, what="request admitted")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await async_wait_until(lambda: not engine.has_unfinished_requests(), what="abort applied")
        return True

    assert run(engine, body)


def test_invalid_requests_raise_at_admission(engine):
    async def body(ae):
        with pytest.raises(ValueError, match="max_model_len"):
            await ae.add_request(list(range(3, 1100)), GREEDY)
        with pytest.raises(ValueError, match="out of range"):
            await ae.add_request([10**7], GREEDY)
        return await collect(ae, PROMPTS[2])  # the loop still serves

    assert run(engine, body).finished


def test_timeout_aborts_and_raises(engine):
    async def body(ae):
        with pytest.raises(RequestTimeoutError, match="timed out"):
            await collect(ae, PROMPTS[3], LONG, timeout=0.2)

    run(engine, body)


def test_queue_limit(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler.config, "max_num_seqs", 1)

    async def body(ae):
        running = await ae.add_request(PROMPTS[0], LONG)
        await async_wait_until(lambda: engine.scheduler.num_running > 0, what="first request running")
        waiting = await ae.add_request(PROMPTS[1], LONG)  # max_num_seqs=1: it has to wait
        with pytest.raises(QueueFullError, match="full"):
            await ae.add_request(PROMPTS[2], GREEDY)
        running.close()
        waiting.close()

    run(engine, body, max_queue_len=1)


def test_drain_finishes_short_requests_and_aborts_long_ones(engine):
    """Drain waits for in-flight requests and aborts what is left when it gives up. Nothing here depends on
    the CPU's speed: the long request has produced a token before the drain starts, and the drain gives up
    as soon as the short one is done (a 2-token request in the same batches as a 900-token one always
    finishes first), so the long one is still running when it is aborted."""
    async def body(ae):
        long_started = asyncio.Event()

        async def collect_long():
            last = None
            async for out in ae.generate(PROMPTS[5], LONG):
                last = out
                long_started.set()
            return last

        long = asyncio.ensure_future(collect_long())
        short = asyncio.ensure_future(collect(ae, PROMPTS[4], SamplingParams(temperature=0, max_tokens=2)))
        await asyncio.wait_for(long_started.wait(), 30)
        await ae.drain(60.0, give_up=short.done)
        with pytest.raises(RuntimeError, match="shutting down"):
            await ae.add_request(PROMPTS[6], GREEDY)
        return await asyncio.wait_for(short, 30), await asyncio.wait_for(long, 30)

    short, long = run(engine, body)
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 2
    assert long.finished and long.outputs[0].finish_reason == "abort"
    assert 0 < len(long.outputs[0].token_ids) < 900


def test_an_id_reused_right_after_its_abort_is_a_new_request(engine):
    """A client aborts a running request and at once sends another under the same id: the abort and the
    add reach the engine in one batch. The abort ends the first; the second is not taken for the aborted
    one (it was dropped, its stream never answered), and gets its own outputs only."""
    import time as _time

    from pagellm.engine.engine_core import Add, EngineCore

    expected = sync_greedy(engine, PROMPTS[1])
    core = EngineCore(engine)
    res = core.step([Add("same", PROMPTS[0], LONG, _time.time())], set())
    assert "same" in res.added and res.outputs  # running
    res = core.step([Add("same", PROMPTS[1], GREEDY, _time.time(), after_abort=True)], {"same"})
    assert res.added["same"][1] == PROMPTS[1]
    outs = res.outputs
    for _ in range(200):
        if outs and outs[-1].finished:
            break
        outs = core.step([], set()).outputs
    assert outs[-1].prompt_token_ids == PROMPTS[1] and outs[-1].outputs[0].token_ids == expected
    assert engine.stats.finished.get("abort", 0) >= 1
    # without the flag the abort still drops an add that came before it (the client left first)
    res = core.step([Add("gone", PROMPTS[2], GREEDY, _time.time())], {"gone"})
    assert "gone" not in res.added and not engine.has_unfinished_requests()

    async def body(ae):  # the same through the front, which sets the flag
        first = await ae.add_request(PROMPTS[0], LONG, request_id="same")
        async for _ in first:
            break
        ae.abort("same")
        second = await ae.add_request(PROMPTS[1], GREEDY, request_id="same")
        last = None
        async for out in second:
            last = out
        return last

    last = run(engine, body)
    assert last.finished and last.prompt_token_ids == PROMPTS[1] and last.outputs[0].token_ids == expected


def test_the_core_process_loop_keeps_a_reused_id_across_messages(engine):
    """In the core process, the abort and the new add may come in two messages before one step: the add is
    marked as the abort's successor; an abort in a later message drops an add that an earlier one brought."""
    import os
    import time as _time

    from pagellm.engine.core_process import CoreLoop
    from pagellm.engine.engine_core import Add

    loop = CoreLoop(engine, None, os.getppid())
    try:
        loop.take([], {"same"}, [], [])
        loop.take([Add("same", PROMPTS[1], GREEDY, _time.time())], set(), [], [])
        loop.take([Add("left", PROMPTS[2], GREEDY, _time.time())], set(), [], [])
        loop.take([], {"left"}, [], [])
        assert [(a.request_id, a.after_abort) for a in loop.adds] == [("same", True), ("left", False)]
        res = loop.core.step(loop.adds, loop.aborts)
        assert set(res.added) == {"same"}
        engine.abort_request("same")
    finally:
        loop.close()
        engine.executor.on_failure = None


def test_add_requests_admits_a_list_between_two_steps(engine):
    """One add after another waited a step each (a list of 64 prompts took ~11 s to admit under load, unaware
    of its client leaving); add_requests queues them together."""
    async def body(ae):
        before = engine.stats.steps
        streams = await ae.add_requests(PROMPTS, LONG, [f"list-{i}" for i in range(len(PROMPTS))])
        steps = engine.stats.steps - before
        assert {s.request_id for s in streams} == {f"list-{i}" for i in range(len(PROMPTS))}
        for s in streams:
            s.close()
        return steps

    assert run(engine, body) <= 2  # the step that admitted them (and one just then under way)


def test_add_requests_is_every_prompt_or_none(engine):
    async def body(ae):
        prompts = [PROMPTS[0], PROMPTS[1], [10**7]]  # the last one is refused by the engine
        with pytest.raises(ValueError, match="out of range"):
            await ae.add_requests(prompts, LONG, ["all-0", "all-1", "all-2"])
        await async_wait_until(lambda: not engine.has_unfinished_requests(), what="the admitted ones aborted")
        with pytest.raises(ValueError, match="already in use"):  # a duplicate id: the first one is withdrawn
            await ae.add_requests([PROMPTS[0], PROMPTS[1]], GREEDY, ["dup", "dup"])
        return await collect(ae, PROMPTS[2])

    assert run(engine, body).finished


def test_add_requests_checks_the_queue_for_the_whole_list(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler.config, "max_num_seqs", 1)

    async def body(ae):
        with pytest.raises(ValueError, match="more than the server's queue holds"):  # never fits: not a 503
            await ae.add_requests(PROMPTS[:3], GREEDY, ["q-0", "q-1", "q-2"])
        running = await ae.add_request(PROMPTS[0], LONG)
        await async_wait_until(lambda: engine.scheduler.num_running > 0, what="first request running")
        waiting = await ae.add_request(PROMPTS[1], LONG)  # max_num_seqs=1: it waits
        await async_wait_until(lambda: ae.num_waiting() == 1, what="one waiting")
        with pytest.raises(QueueFullError, match="2 more asked"):  # fits once the queue drains: a 503
            await ae.add_requests(PROMPTS[2:4], GREEDY, ["q-3", "q-4"])
        running.close()
        waiting.close()

    run(engine, body, max_queue_len=2)
