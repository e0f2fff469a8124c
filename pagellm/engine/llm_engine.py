"""The synchronous engine: add_request / abort_request / step()."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from pagellm.config import EngineArgs
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.engine.admission import prepare_request
from pagellm.engine.beam_search import BeamSearchGroup
from pagellm.engine.engine_parts import build_proposer, kv_bytes_per_block, resolve_kv_dtype
from pagellm.engine.gpu_memory import log_kv_sizing, size_kv_cache
from pagellm.engine.isolation import error_output, sample_isolated
from pagellm.engine.kv_sizing import check_device_memory, fit_max_model_len
from pagellm.engine.output_processor import RequestState, SequenceState
from pagellm.executor.multiproc import start_workers
from pagellm.executor.uniproc import UniprocExecutor
from pagellm.model.attention import get_attention_backend
from pagellm.model.layers.custom_op import CustomOp
from pagellm.model.loader import load_config, resolve_model_path
from pagellm.model.loader.model_loader import get_model, model_weight_bytes
from pagellm.model.parallel import check_splittable
from pagellm.model.runner import ModelRunner
from pagellm.outputs import RequestOutput
from pagellm.platforms import get_platform
from pagellm.quant.kv_cache import kv_dtype_label
from pagellm.request import Request, RequestStatus
from pagellm.sample import Sampler, StepSampler
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.adaptive import SpeculationController
from pagellm.spec_decode.proposers import NgramProposer
from pagellm.structured_output import StructuredOutputManager
from pagellm.tokenizer import Tokenizer

logger = logging.getLogger("pagellm")


@dataclass
class EngineStats:
    """Counters the metrics layer reads; cumulative since start."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    steps: int = 0


class LLMEngine:
    def __init__(self, args: EngineArgs):
        t0 = time.perf_counter()
        self.args = args
        self.platform = platform = get_platform(args.device)
        platform.check_available()
        platform.set_num_threads(args.num_threads)
        torch.manual_seed(args.seed)  # unseeded sampling is reproducible per engine run
        platform.use_device()
        self.device = platform.device if platform.name == "cuda" else torch.device(args.device)
        self.dtype = dtype = platform.resolve_dtype(args.dtype)
        path = resolve_model_path(args.model)
        self.model_path = path
        self.model_config = cfg = load_config(path)
        self.tokenizer = Tokenizer.from_path(args.tokenizer or path)
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        if args.executor_backend != "uni":
            if platform.name == "cuda":
                raise ValueError("tensor and pipeline parallelism run on the CPU (gloo worker processes); on "
                                 "cuda the engine runs one GPU: drop -tp / -pp / --distributed-executor-backend")
            check_splittable(cfg, tp, pp)  # before any process starts

        cache = args.cache_config()
        self.kv_dtype = kv_dtype = resolve_kv_dtype(args, dtype, platform)
        # per rank: --kv-cache-memory is each worker's (as vLLM's is per GPU); every rank holds every block
        self.bytes_per_block = kv_bytes_per_block(cfg, cache.block_size, kv_dtype, tp, pp)
        # On a GPU without --kv-cache-memory the cache gets what is left after loading (engine/gpu_memory.py).
        gpu_sized = args.kv_cache_memory is None and platform.total_memory() is not None
        num_blocks = None if gpu_sized else cache.kv_cache_memory // self.bytes_per_block
        if not gpu_sized:
            check_device_memory("--kv-cache-memory", cache.kv_cache_memory, platform.total_memory())
        if args.preemption_mode == "swap":
            check_device_memory("--swap-space", args.swap_space, None)
            if args.swap_space < self.bytes_per_block:  # no host block: every preemption would recompute, silently
                raise ValueError(f"--swap-space {args.swap_space} bytes is less than one KV block "
                                 f"({self.bytes_per_block} bytes): swap preemption needs room for at least one")
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"--kv-cache-memory {cache.kv_cache_memory} bytes is less than one KV block "
                             f"({self.bytes_per_block} bytes: {cache.block_size} tokens of "
                             f"{self.bytes_per_block // cache.block_size} bytes)")
        backend = get_attention_backend(args.attention_backend, platform, kv_dtype, dtype, args.dtype == "auto")
        graph_sizes = platform.decode_graph_sizes(backend.name, args.max_num_seqs, args.enforce_eager)
        self.model = self.runner = None  # in this process only with the "uni" executor
        if args.executor_backend == "uni":
            self.model = get_model(path, cfg, platform, dtype, self.device, args.int8_activations,
                                   args.packed_weights_only, auto_dtype=args.dtype == "auto",
                                   quantization=args.quantization,
                                   quantization_group_size=args.quantization_group_size)
            self.weights_bytes = model_weight_bytes(self.model)
        gpu_memory = None
        if gpu_sized:
            gpu_memory = size_kv_cache(platform, self.model, backend, kv_dtype, args, cfg, self.bytes_per_block,
                                       self.weights_bytes, max(graph_sizes, default=0))
            num_blocks = gpu_memory.num_blocks
            torch.manual_seed(args.seed)  # the profiling step sampled: unseeded sampling starts where it would
        kv_memory = num_blocks * self.bytes_per_block if gpu_sized else cache.kv_cache_memory
        num_host_blocks = args.swap_space // self.bytes_per_block if args.preemption_mode == "swap" else 0
        self.kv_cache = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, num_host_blocks)
        # A sequence can never be longer than the whole cache holds, so that is a length limit too.
        sched_cfg = args.scheduler_config(fit_max_model_len(args.max_model_len, cfg.max_position_embeddings,
                                                            self.kv_cache.capacity_tokens, kv_memory))
        if not sched_cfg.enable_chunked_prefill:
            # Without chunking, a whole (re-)prefill must fit in one step's budget.
            if sched_cfg.max_num_batched_tokens < sched_cfg.max_model_len:
                logger.info("max_num_batched_tokens %d -> %d (max_model_len): without chunked prefill a whole prompt "
                            "is one step", sched_cfg.max_num_batched_tokens, sched_cfg.max_model_len)
                sched_cfg.max_num_batched_tokens = sched_cfg.max_model_len
        self.scheduler = Scheduler(sched_cfg, self.kv_cache, args.preemption_mode)
        self.max_model_len = sched_cfg.max_model_len
        # sequences of max_model_len tokens the KV cache holds at once: each takes whole blocks (tokens over
        # max_model_len had promised 14.6 where 13 fit, at a length of 100: a probe)
        self.max_concurrency = num_blocks / -(-self.max_model_len // cache.block_size)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)
        if gpu_memory is not None:
            log_kv_sizing(gpu_memory, cfg, path, dtype, kv_dtype, args, cache.block_size, self.max_model_len)
        if self.model is not None:
            self.runner = ModelRunner(self.model, num_blocks, cache.block_size, kv_dtype, self.device, backend,
                                      platform, num_host_blocks=num_host_blocks, graph_sizes=graph_sizes,
                                      max_model_len=self.max_model_len, prefault_kv=args.prefault_kv_cache)
            self.executor = UniprocExecutor(self.runner)
        else:
            self.executor = start_workers(args, path, dtype, kv_dtype, num_blocks, num_host_blocks)
            self.weights_bytes = max(self.executor.weights_bytes)  # the busiest rank's
        try:  # a failure from here on (a draft model that does not load) must not leave worker processes behind
            # Grammars for structured output; xgrammar is loaded on the first structured request.
            self.structured_output = StructuredOutputManager(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
            self.step_sampler = StepSampler(Sampler(self.eos_token_ids), self.device, self.structured_output)
            self.proposer = build_proposer(args, self.max_model_len, backend, self.step_sampler.sampler,
                                           self.model_config, platform, dtype, self.device)
        except BaseException:
            self.executor.shutdown()
            raise
        # The draft model's own cost is not modelled yet: adaptive drafting is for the n-gram proposer.
        adaptive = args.speculative_adaptive and isinstance(self.proposer, NgramProposer)
        self.spec_controller = SpeculationController() if adaptive else None
        self.requests: dict[str, RequestState] = {}
        self._seq_to_request: dict[str, str] = {}
        self.stats = EngineStats()
        self.startup_seconds = time.perf_counter() - t0
        if self.model is not None:
            impl = next((m.impl for m in self.model.modules() if isinstance(m, CustomOp)), "native")
            compiled = self.runner.compiled_decoder
            where = "" if compiled is None else ", " + getattr(compiled, "label", "one-call native decoder")
        else:
            impl, where = "native", f"; {tp * pp} worker processes (tensor parallel {tp} x pipeline parallel {pp})"
        per_rank = " on the busiest rank" if self.model is None else ""
        logger.info("%s; engine: dtype %s, KV %s, attention %s, ops forward_%s%s", platform.summary_line(
            platform.HARDWARE_KEYS), kv_dtype_label(dtype), kv_dtype_label(kv_dtype), backend.name, impl, where)
        logger.info(
            "pagellm: %s (%s, %s) loaded in %.1f s: weights %.1f MiB%s; KV cache (%s, %d bytes/token%s) %d blocks x "
            "%d tokens = %d tokens (%.1f MiB, %s); max_model_len %d; max concurrent sequences at max_model_len: %.1f",
            path, cfg.architecture + (f", {cfg.weight_format}" if cfg.weight_format else ""), kv_dtype_label(dtype),
            self.startup_seconds, self.weights_bytes / 2**20, per_rank, kv_dtype_label(kv_dtype),
            self.bytes_per_block // cache.block_size, per_rank, num_blocks,
            cache.block_size, self.kv_cache.capacity_tokens, num_blocks * self.bytes_per_block / 2**20,
            "resident now" if args.prefault_kv_cache or self.device.type != "cpu" else "resident as blocks fill",
            self.max_model_len, self.max_concurrency)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.verify()  # again: a field may have changed since construction
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._tokenize(prompt)
        prompt_text, prompt_ids, params = prepare_request(prompt_text, prompt_ids, params, self.tokenizer,
                                                          self.model_config.vocab_size, self.max_model_len,
                                                          self.eos_token_ids)
        self._validate_prompt(prompt_ids, params)
        # checked before any sibling is queued; n greedy samples are one sequence (below)
        if params.n > self.scheduler.config.max_num_seqs and not (params.greedy and not params.use_beam_search):
            raise ValueError(f"n must be <= max_num_seqs ({self.scheduler.config.max_num_seqs}): the n sequences "
                             f"run at once; got {params.n}")
        arrival_time = arrival_time or time.time()
        if params.use_beam_search:
            self._add_beam_request(request_id, prompt_text, prompt_ids, params, arrival_time, cache_salt)
            return request_id
        seqs: list[SequenceState] = []
        # n greedy samples are one sample: computed once and reported n times (a sibling's first token, recomputed
        # in a step of another size, could part from the leader's under --dtype auto)
        copies = params.n if params.greedy and params.n > 1 else 1
        children = [params if params.n == 1 else params.child(i) for i in range(params.n // copies)]  # none queued
        for i, child in enumerate(children):
            # Always suffixed, n = 1 too: what follows the last '#' never holds one, so no request's id can equal
            # another's sequence (a request 'a#1' beside 'a' with n = 2 had shared a scheduler id).
            seq_id = f"{request_id}#{i}"
            req = Request(seq_id, prompt_ids, child, self.eos_token_ids, arrival_time, cache_salt)
            # Siblings fork from the first sequence's prompt blocks instead of prefilling again.
            self.scheduler.add_request(req, fork_of=seqs[0].request if seqs else None)
            self._seq_to_request[seq_id] = request_id
            seqs.append(SequenceState(i, req, self.tokenizer))
        self.requests[request_id] = RequestState(request_id, prompt_text, prompt_ids, seqs, arrival_time,
                                                 copies=copies)
        return request_id

    def _add_beam_request(self, request_id, prompt_text, prompt_ids, params, arrival_time, cache_salt) -> None:
        leader = Request(f"{request_id}#beam0", prompt_ids, params, self.eos_token_ids, arrival_time, cache_salt)
        leader.extra_seats = params.beam_width - 1
        if leader.num_seqs > self.scheduler.config.max_num_seqs:
            raise ValueError(f"beam_width must be <= max_num_seqs ({self.scheduler.config.max_num_seqs}): the beams "
                             f"run at once; got {params.beam_width}")
        max_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        group = BeamSearchGroup(request_id, params, len(prompt_ids), len(prompt_ids) + max_new,
                                self.eos_token_ids, beams=[(leader, 0.0)])
        self.scheduler.add_request(leader)
        self._seq_to_request[leader.request_id] = request_id
        self.requests[request_id] = RequestState(request_id, prompt_text, prompt_ids, [], arrival_time,
                                                 beam=group, tokenizer=self.tokenizer)

    def _advance_beams(self, sched_out, sampled) -> list[RequestState]:
        """Record beam candidates; expand every group whose live beams all have them."""
        if not any(tok.beam_candidates is not None for tok in sampled.values()):
            return []  # the common step: no beam search in the batch
        by_id = {s.request.request_id: s.request for s in sched_out.scheduled}
        ready = {}
        for seq_id, tok in sampled.items():
            if tok.beam_candidates is None or seq_id not in self._seq_to_request:
                continue
            state = self.requests[self._seq_to_request[seq_id]]
            state.beam.record(by_id[seq_id], tok.beam_candidates)
            if state.beam.ready():
                ready[state.request_id] = state
        for state in ready.values():
            group = state.beam
            old = [r for r, _ in group.beams]
            nxt = group.advance()
            for r in old:
                self._seq_to_request.pop(r.request_id, None)
            if not nxt:
                for r in old:
                    self.scheduler.drop_request(r)
                continue
            step = group.num_expansions
            pairs = [(parent, parent.extend(f"{state.request_id}#beam{step}.{j}", tok))
                     for j, (parent, tok, _) in enumerate(nxt)]
            self.scheduler.replace_beams(old, pairs)
            group.beams = [(child, score) for (_, child), (_, _, score) in zip(pairs, nxt, strict=True)]
            for _, child in pairs:
                self._seq_to_request[child.request_id] = state.request_id
        return list(ready.values())

    def _tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):  # vLLM's TokensPrompt: ids tokenized elsewhere, the text kept for echo
            if "prompt_token_ids" in prompt:
                text, (_, ids) = prompt.get("prompt"), self._tokenize(prompt["prompt_token_ids"])
                return text, ids
            if isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt
                return self._tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt_token_ids' (vLLM's TokensPrompt) or a 'prompt' string")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in prompt):
            return None, list(prompt)
        raise ValueError("prompt must be a string or a list of token ids")

    def _validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, but max_model_len is {self.max_model_len} "
                f"(model context {self.model_config.max_position_embeddings}, KV cache holds "
                f"{self.kv_cache.capacity_tokens} tokens); the prompt must leave room for one output token")
        for tok in (params.logit_bias or {}):
            if not 0 <= int(tok) < vocab:
                raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {tok}")
        self.structured_output.validate(params)  # compiles (a cache hit when the server compiled it)

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            live = state.live_requests
            self.scheduler.abort_requests([r.request_id for r in live])
            for r in live:
                self._seq_to_request.pop(r.request_id, None)
            self._count_samples(state, RequestStatus.FINISHED_ABORTED.value)
        self._release_drafts()

    def _release_drafts(self) -> None:
        """A draft model's KV of sequences that left (finished, aborted, preempted) goes back now, not at the
        next proposal (which an idle engine never makes)."""
        if self.proposer is not None:
            self.proposer.retain({r.request_id for r in self.scheduler.running})

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()  # adaptive speculation weighs whole steps: proposing and bookkeeping cost too
        self.executor.check_health()  # a worker that died between steps fails this one
        if self.proposer is not None:
            self._propose()
        sched_out = self.scheduler.schedule()
        # One request's parameters failing its sampling fails that request alone (engine/isolation.py).
        sampled, failed = sample_isolated(self.step_sampler, *self.executor.execute(sched_out))
        errored = self._fail(failed) if failed else []  # finished before update, which then skips them
        before = {s.request.request_id: s.request.num_output_tokens for s in sched_out.scheduled}
        progressed = self.scheduler.update(
            sched_out, {rid: [t.token_id for t in tok.tokens] for rid, tok in sampled.items()
                        if tok.token_id is not None})
        self.stats.steps += 1
        touched: dict[str, RequestState] = {}
        for state in self._advance_beams(sched_out, sampled):
            touched[state.request_id] = state
        now = time.time()
        for req in progressed:
            rid = self._seq_to_request[req.request_id]
            state = self.requests[rid]
            seq = state.seqs[0] if len(state.seqs) == 1 else next(s for s in state.seqs if s.request is req)
            infos = sampled[req.request_id].tokens
            start = before[req.request_id]
            new_tokens = req.output_token_ids[start:]
            for j, token in enumerate(new_tokens):
                # the scheduler ends a sequence on its EOS / stop token id, always the step's last token
                ended_by_token = j == len(new_tokens) - 1 and req.status == RequestStatus.FINISHED_STOPPED
                stop = seq.add_token(token, infos[j].logprob, infos[j].top_logprobs, ended_by_token, infos[j].rank)
                self.stats.generation_tokens += state.copies
                if stop is not None:
                    del req.output_token_ids[start + j + 1:]  # accepted drafts after a stop string
                    if not req.is_finished:
                        self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
                    elif req.status == RequestStatus.FINISHED_LENGTH or j < len(new_tokens) - 1:
                        # a stop string on the last token allowed is a stop (vLLM's), and one before the stop
                        # token or EOS that ended a run of accepted drafts is what ended the output
                        req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
                    break
            touched[rid] = state
        outputs = errored
        for rid, state in touched.items():
            if state.first_token_time is None:  # prefilled: its prompt counts (not one aborted while it waited)
                state.first_token_time = now
                self.stats.prompt_tokens += len(state.prompt_token_ids)
            outputs.append(state.output())
            if state.finished:
                self._finish(rid, state)
        if self.spec_controller is not None:
            self._observe_speculation(sched_out, sampled, time.perf_counter() - t0)
        if any(state.finished for state in touched.values()) or errored:
            self._release_drafts()
        return outputs

    def _propose(self) -> None:
        running, ctl = self.scheduler.running, self.spec_controller
        limit = self.args.speculative_disable_by_batch_size
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        skip_limit = limit is not None and len(running) >= limit
        if skip_limit or (ctl is not None and not ctl.wants_proposals(len(decoding))):
            for req in running:  # a draft proposer catches up on the skipped tokens next time
                req.clear_spec()
            if ctl is not None and not skip_limit:
                ctl.skip()
            return
        self.proposer.propose(running)
        self.structured_output.trim_drafts(running)  # no verification rows past what a grammar rejects
        if ctl is None:
            return
        ctl.retain({r.request_id for r in running})
        keep = ctl.plan({r.request_id: len(r.spec_token_ids) for r in decoding if r.spec_token_ids},
                        batch_rows=len(decoding))
        for req in decoding:
            k = keep.get(req.request_id, 0)
            if k == 0:
                req.clear_spec()
            else:
                req.spec_token_ids = req.spec_token_ids[:k]

    def _observe_speculation(self, sched_out, sampled, seconds: float) -> None:
        """Step time of decode-only steps by row count; each drafting request's accepted drafts."""
        ctl = self.spec_controller
        if sched_out.scheduled and all(s.num_new_tokens == 1 + len(s.spec_token_ids) for s in sched_out.scheduled):
            ctl.observe_step(sum(s.num_new_tokens for s in sched_out.scheduled), seconds)
        for s in sched_out.scheduled:
            rid = s.request.request_id
            if s.spec_token_ids and rid in sampled:
                ctl.observe_request(rid, len(s.spec_token_ids), len(sampled[rid].accepted))

    def _finish(self, rid: str, state: RequestState) -> None:
        del self.requests[rid]
        for r in state.live_requests:
            self._seq_to_request.pop(r.request_id, None)
        if state.beam is not None:
            outs = state.output().outputs
            self.stats.generation_tokens += sum(len(c.token_ids) for c in outs)
            self._count_finished(outs[0].finish_reason if outs else "abort")
        else:
            self._count_samples(state, RequestStatus.FINISHED_ABORTED.value)

    def _fail(self, failed: dict[str, str]) -> list[RequestOutput]:
        """Finish each request a failed sequence belongs to (all its sequences: they share its
        parameters) with finish_reason "error"; its KV blocks are freed."""
        outputs = []
        for seq_id, message in failed.items():
            rid = self._seq_to_request.get(seq_id)
            if rid is None:  # a sibling already failed it
                continue
            state = self.requests.pop(rid)
            for r in state.live_requests:
                self._seq_to_request.pop(r.request_id, None)
                if not r.is_finished:
                    self.scheduler.finish_request(r, RequestStatus.FINISHED_ERROR)
            n = state.beam.params.n if state.beam is not None else len(state.seqs)
            outputs.append(error_output(state, message, n))
            self._count_samples(state, RequestStatus.FINISHED_ERROR.value)
        return outputs

    def _count_samples(self, state: RequestState, unfinished: str) -> None:
        for reason in state.finish_reasons(unfinished):
            self._count_finished(reason)

    def _count_finished(self, reason: str) -> None:
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def shutdown(self) -> None:
        """Stops the worker processes, if any (idempotent; they also stop when this process exits)."""
        self.executor.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache.reset_prefix_cache()

