"""The engine side of the async engine: apply queued adds and aborts, run jobs and one `LLMEngine.step()`,
and say what happened as one picklable `StepResult`.

Both front ends drive an `EngineCore`: `AsyncLLMEngine` in its worker thread (in the server's process) and
the engine core process (engine/core_process.py) in its main loop; the results go to the same
`AsyncLLMEngine._dispatch` on the event loop either way. `EngineInfo` is what the server reads about the
engine besides the tokenizer: built here, sent across once at start-up when the engine runs in its own
process.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field

from pagellm.engine.request_stream import EngineSnapshot
from pagellm.model_config import ModelConfig
from pagellm.outputs import RequestOutput
from pagellm.quant.kv_cache import kv_dtype_label
from pagellm.request import RequestStatus
from pagellm.sampling_params import SamplingParams

TRIM_INTERVAL_S = 1.0  # idle after work: return freed memory to the OS at most once a second


@dataclass
class Add:
    request_id: str
    prompt: str | list[int] | dict
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    # queued after an abort of the same id that had not been applied yet: the abort is its predecessor's
    # (a client reusing an id), not this add's
    after_abort: bool = False


@dataclass
class StepResult:
    added: dict[str, BaseException | tuple[str | None, list[int]]]
    outputs: list[RequestOutput]
    scheduled: dict[str, float]  # request id -> time of its first scheduling
    end_time: float
    snapshot: EngineSnapshot
    num_tokens: int = 0  # fed to the model in this step


@dataclass
class EngineInfo:
    """The engine's constants the server reads (model card, /detokenize, embeddings, metrics labels)."""

    model_path: str
    model_config: ModelConfig
    max_model_len: int
    eos_token_ids: frozenset[int]
    cache_info: dict[str, str] = field(default_factory=dict)  # the cache_config_info metric's labels

    @classmethod
    def of(cls, eng) -> EngineInfo:
        args, kv = eng.args, eng.kv_cache
        cache = {"block_size": str(kv.block_size), "cache_dtype": kv_dtype_label(eng.kv_dtype),
                 "enable_prefix_caching": str(kv.enable_caching), "num_gpu_blocks": str(kv.num_blocks),
                 "num_cpu_blocks": str(kv.host_pool.num_blocks if kv.host_pool is not None else 0),
                 "kv_cache_memory": str(kv.num_blocks * eng.bytes_per_block),
                 "preemption_mode": args.preemption_mode, "swap_space_bytes": str(args.swap_space), "engine": "0"}
        return cls(eng.model_path, eng.model_config, eng.max_model_len, frozenset(eng.eos_token_ids), cache)


def portable_error(e: BaseException) -> BaseException:
    """`e` without its traceback, or, if it does not survive pickling (an exception whose constructor takes
    other arguments than it stores), a ValueError / RuntimeError with the same message."""
    e = e.with_traceback(None)
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return (ValueError if isinstance(e, ValueError) else RuntimeError)(f"{type(e).__name__}: {e}")


class EngineCore:
    """Owns the LLMEngine between steps; every method runs on the one thread that touches the engine."""

    def __init__(self, engine):
        self.engine = engine
        self._unscheduled: set[str] = set()  # added, never scheduled yet: their first scheduling is reported

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests() or self.engine.executor.error is not None

    def step(self, adds: list[Add], aborts: set[str], run_jobs=None) -> StepResult:
        """Apply aborts, then adds (an add aborted in the same batch is dropped, unless it came after the abort:
        a reused id), run_jobs(engine), then one engine step if any request is unfinished. An exception here
        is the engine's own failure."""
        eng = self.engine
        added: dict[str, BaseException | tuple[str | None, list[int]]] = {}
        if aborts:  # first: an id reused right after its abort names a new request, which must not be aborted
            eng.abort_request(list(aborts))
            self._unscheduled -= aborts
        for a in adds:
            if a.request_id in aborts and not a.after_abort:  # the client left before it reached the engine
                continue
            try:
                eng.add_request(a.request_id, a.prompt, a.params, a.arrival_time, a.cache_salt)
            except Exception as e:
                # Without its traceback: that holds this frame (and `added`, so itself) in a cycle that
                # kept a refused request's prompt alive until the next full GC (bench soak: +20 MB each).
                # Portable: the refusal may cross to the API process, where an error that does not unpickle
                # would be taken for a dead engine.
                added[a.request_id] = portable_error(e)
                continue
            state = eng.requests[a.request_id]
            added[a.request_id] = (state.prompt, list(state.prompt_token_ids))
            self._unscheduled.add(a.request_id)
        if run_jobs is not None:
            run_jobs(eng)
        eng.executor.check_health()  # a worker died while idle: raise here, the caller then fails and stops
        start = time.time()
        batched_before = eng.scheduler.stats.num_batched_tokens
        outputs = eng.step() if eng.has_unfinished_requests() else []
        end = time.time()
        scheduled = {}
        for rid in list(self._unscheduled):
            state = eng.requests.get(rid)
            if state is None or any(s.request.status is not RequestStatus.WAITING for s in state.seqs):
                scheduled[rid] = start
                self._unscheduled.discard(rid)
        return StepResult(added, outputs, scheduled, end, self.snapshot(),
                          eng.scheduler.stats.num_batched_tokens - batched_before)

    def snapshot(self) -> EngineSnapshot:
        eng = self.engine
        return EngineSnapshot(
            num_running=eng.scheduler.num_running, num_waiting=eng.scheduler.num_waiting,
            kv_cache_usage=eng.kv_cache.usage(), num_swapped=len(eng.kv_cache.req_host_blocks),
            prompt_tokens=eng.stats.prompt_tokens,
            generation_tokens=eng.stats.generation_tokens, finished=dict(eng.stats.finished),
            num_preemptions=eng.scheduler.stats.num_preemptions,
            num_swapped_out=eng.scheduler.stats.num_swapped_out, num_swapped_in=eng.scheduler.stats.num_swapped_in,
            spec_draft_tokens=eng.scheduler.stats.num_draft_tokens,
            spec_accepted_tokens=eng.scheduler.stats.num_accepted_tokens,
            spec_steps=eng.scheduler.stats.num_spec_steps,
            spec_accepted_per_pos=list(eng.scheduler.stats.num_accepted_per_pos),
            prefix_queries=eng.kv_cache.prefix_queries, prefix_hits=eng.kv_cache.prefix_hits)
