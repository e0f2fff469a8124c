"""Embeddings: a prompt's final (normed) hidden state, pooled over its tokens and L2-normalized.

The prompt runs through the same `ModelRunner` as generation (`forward_hidden`), in chunks of the step's
token budget, with KV blocks taken from the engine's `KVCacheManager` for the duration of the call and
returned in a `finally` (so never leaked). It bypasses the scheduler: the server runs it between two steps,
where the engine is touched (`EngineJobs` in the async engine's worker thread, or the engine core process's
loop), so a long input delays the running requests by its prefill time, as one unchunked prefill would.
Nothing is sampled and nothing is published to the prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pagellm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams

POOLINGS = ("last", "mean")


class KVCacheBusy(RuntimeError):
    """The KV cache cannot hold this input now; running requests will free blocks."""


def embed(engine, prompt: str | list[int], pooling: str | None = None, normalize: bool = True,
          add_special_tokens: bool = True, truncate_prompt_tokens: int | None = None) -> tuple[list[float], int]:
    """(embedding, number of prompt tokens). `engine` is an LLMEngine; ValueError for bad input."""
    ids = engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens) if isinstance(prompt, str) \
        else list(prompt)
    if truncate_prompt_tokens is not None:
        ids = ids[-truncate_prompt_tokens:]
    return embed_token_ids(engine, ids, pooling, normalize)


def embed_token_ids(engine, ids: list[int], pooling: str | None = None,
                    normalize: bool = True) -> tuple[list[float], int]:
    """embed() of token ids only: the server's job, whose text its API process tokenized (tokenizing between
    steps stalled every running request for as long as a long text took, only to refuse it afterwards)."""
    if not isinstance(ids, list):
        raise TypeError(f"embed_token_ids takes a list of token ids, got {type(ids).__name__}")
    pooling = pooling or engine.args.embedding_pooling
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
    check_token_ids(ids, "input", engine.model_config.vocab_size, engine.max_model_len)
    with borrowed_request(engine, ids, "embed", KVCacheBusy) as req:
        return _pooled(engine, req, pooling, normalize), len(ids)


def check_token_ids(ids: list[int], what: str, vocab: int, max_model_len: int) -> None:
    """ValueError naming `what` for an empty sequence, an id outside the vocabulary or one longer than
    max_model_len (nothing is generated, so the whole context may be used)."""
    if not ids:
        raise ValueError(f"{what} must contain at least one token")
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{what} token id {bad} is out of range [0, {vocab})")
    if len(ids) > max_model_len:
        raise ValueError(f"{what} has {len(ids)} tokens, but max_model_len is {max_model_len}")


@contextlib.contextmanager
def borrowed_request(engine, ids: list[int], tag: str, busy: type[Exception]) -> Iterator[Request]:
    """A throwaway Request holding KV blocks for `ids` from the engine's manager, freed on exit whatever
    happens; `busy` is raised when the cache has no room now."""
    req = Request(f"{tag}-{uuid.uuid4().hex}", ids, SamplingParams(max_tokens=1))
    if engine.kv_cache.allocate_slots(req, len(ids)) is None:
        raise busy(f"the KV cache has no room for {len(ids)} tokens now")
    try:
        yield req
    finally:
        engine.kv_cache.free(req)


def hidden_chunks(engine, req: Request, chunk: int, logits: bool = False) -> Iterator[tuple[int, torch.Tensor]]:
    """(first position, final hidden states, or with `logits` every row's float32 logits) of each forward over
    the request's tokens, `chunk` rows at a time, through the engine's executor; advances
    req.num_computed_tokens."""
    table = engine.kv_cache.block_table(req.request_id)
    while req.num_computed_tokens < req.num_tokens:
        first = req.num_computed_tokens
        n = min(chunk, req.num_tokens - first)
        out = SchedulerOutput([ScheduledRequest(req, n, table)], n)
        ex = engine.executor
        hidden = ex.forward_all_logits(out) if logits else ex.forward_hidden(out)
        yield first, hidden
        req.num_computed_tokens += n


@torch.inference_mode()
def _pooled(engine, req: Request, pooling: str, normalize: bool) -> list[float]:
    total = None
    for _, hidden in hidden_chunks(engine, req, engine.scheduler.config.max_num_batched_tokens):
        hidden = hidden.float()
        part = hidden[-1] if pooling == "last" else hidden.sum(dim=0)
        total = part if total is None or pooling == "last" else total + part
    vec = total if pooling == "last" else total / req.num_tokens
    if normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec.tolist()


# Jobs run between two steps for at most about this long (at least one job each time, however long): a request
# of many inputs (one job each) then shares the engine with the running requests step by step, and a client
# that left or timed out has its remaining jobs dropped, instead of every input running before the next step
# (20 inputs of 400 tokens had held a streaming request's next token for 15 s).
JOB_SLICE_S = 0.1


def within_slice(items: list) -> Iterator:
    """The items in order while JOB_SLICE_S has not passed since the first began (the first always)."""
    start = time.monotonic()
    for i, item in enumerate(items):
        if i and time.monotonic() - start > JOB_SLICE_S:
            return
        yield item


def run_job(job: Callable[[Any], Any], engine) -> tuple[Any, Exception | None] | None:
    """(result, error) of job(engine); None when it should run again after the next step (the KV cache is
    busy now, and running requests will free blocks)."""
    try:
        return job(engine), None
    except KVCacheBusy as e:
        return None if engine.has_unfinished_requests() else (None, e)
    except Exception as e:
        return None, e


class EngineJobs:
    """Work run on the engine in its worker thread between steps (AsyncLLMEngine calls `run`).
    A job raising KVCacheBusy waits for the next step while requests run (they free blocks)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], Any], asyncio.Future]] = []

    def __bool__(self) -> bool:
        return bool(self._pending)

    def submit(self, job: Callable[[Any], Any]) -> asyncio.Future:
        """From the event loop: a future for job(engine)'s result."""
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            self._pending.append((job, fut))
        return fut

    def run(self, engine) -> None:
        """In the worker thread: run pending jobs in order for about JOB_SLICE_S (the rest after the next step)."""
        with self._lock:
            jobs, self._pending = [j for j in self._pending if not j[1].done()], []  # done: the client left
        retry, ran = [], 0
        for job, fut in within_slice(jobs):
            ran += 1
            outcome = run_job(job, engine)
            if outcome is None:
                retry.append((job, fut))
                continue
            fut.get_loop().call_soon_threadsafe(_settle, fut, *outcome)
        retry += jobs[ran:]
        if retry:
            with self._lock:
                self._pending[:0] = retry

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            jobs, self._pending = self._pending, []
        for _, fut in jobs:
            _settle(fut, None, error)


def _settle(fut: asyncio.Future, result, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
