"""Token-budget continuous batching: no prefill or decode phases, just tokens owed per request.

Each step, running requests are served first (in arrival order), then waiting ones are admitted
while the budget, `max_num_seqs` and free blocks last. A prompt is prefilled in chunks of whatever
the budget leaves. When blocks run out, the latest-arrived running request is preempted by
recompute: its blocks are freed and it re-enters the front of the waiting queue.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import BlockCopies, KVCacheManager
from pagellm.request import Request, RequestStatus

logger = logging.getLogger("pagellm")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # includes the speculative drafts below
    block_ids: list[int]  # the request's whole block table (shared list, read-only for the runner)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified in this step
    draft_probs: Any = None  # the draft model's distributions for them (None: a point-mass proposer)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so its last logits are sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    block_copies: BlockCopies = field(default_factory=BlockCopies)
    num_running: int = 0  # sequences running once this step was scheduled (the batch the step belongs to)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_swap_recomputes: int = 0  # swap preemptions the host pool had no room for: recomputed instead
    num_finished: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0  # request-steps that verified drafts
    num_accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j
    num_batched_tokens: int = 0  # tokens fed to the model over all steps (per step: the difference)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, preemption_mode: str = "recompute"):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        self.preemption_mode = preemption_mode
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = config.max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept sorted by arrival_seq
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, req: Request, fork_of: Request | None = None) -> None:
        """Queue a request. With `fork_of`, it is a sibling (n > 1) that shares fork_of's prompt blocks:
        it waits, outside the queue, until fork_of has computed the prompt, then forks from it."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if fork_of is not None:
            if fork_of.num_seqs + 1 > self.config.max_num_seqs:
                raise ValueError(f"n={fork_of.num_seqs + 1} parallel sequences exceed max_num_seqs="
                                 f"{self.config.max_num_seqs}")
            fork_of.pending_forks.append(req)
            req.status = RequestStatus.WAITING
            self.requests[req.request_id] = req
            return
        limit = self.max_model_len
        if req.num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt has {req.num_prompt_tokens} tokens, but this engine's max_model_len is {limit} "
                f"(model context and KV cache of {self.kv_cache.capacity_tokens} tokens); "
                f"it must be at most {limit - 1} to leave room for one output token")
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def abort_requests(self, request_ids) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                self.finish_request(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted

    def finish_request(self, req: Request, status: RequestStatus, stop_reason=None) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        for child in req.pending_forks:  # never started: they end with their leader
            self.finish_request(child, RequestStatus.FINISHED_ABORTED)
        req.pending_forks = []
        req.status = status
        req.stop_reason = stop_reason
        self.kv_cache.free(req)
        self.requests.pop(req.request_id, None)
        self.stats.num_finished += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        prefill = self._prefill_allowance()  # of that budget, what prompts may take
        scheduled_ids: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            owed = req.num_tokens - req.num_computed_tokens
            spec = req.spec_token_ids if owed == 1 else []  # drafts only extend a caught-up sequence
            num_new = min(owed + len(spec), budget, prefill if owed > 1 else budget)
            spec = spec[:max(0, num_new - owed)]
            if num_new <= 0:  # nothing owed (cannot normally happen); skip rather than spin
                i += 1
                continue
            while self.kv_cache.allocate_slots(req, num_new) is None:
                victim = self.running.pop()  # latest arrival: the list is sorted by arrival
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                probs = req.spec_draft_probs[:len(spec)] if spec and req.spec_draft_probs is not None else None
                out.scheduled.append(ScheduledRequest(req, num_new, self.kv_cache.block_table(req.request_id),
                                                      list(spec), probs))
                self.stats.num_draft_tokens += len(spec)
                self.stats.num_spec_steps += bool(spec)
                scheduled_ids.add(req.request_id)
                budget -= num_new
                prefill -= num_new if owed > 1 else 0
                i += 1

        # A step that had to preempt is short of memory: admitting more would only thrash.
        num_seqs = sum(r.num_seqs for r in self.running)  # siblings yet to fork hold their seat
        passed = 0
        while self.waiting and budget > 0 and not out.preempted:
            req = self.waiting[0]
            if req.num_tokens == req.num_computed_tokens:
                # a preempted beam that has its candidates: it never needs to run (its group goes on with
                # them), so it lets the queue pass instead of blocking it
                if passed >= len(self.waiting):
                    break
                self.waiting.rotate(-1)
                passed += 1
                continue
            if num_seqs + req.num_seqs > self.config.max_num_seqs:
                break
            swapped = self.kv_cache.is_swapped(req)  # its KV comes back from host memory
            prompt = not swapped or req.num_tokens - req.num_computed_tokens > 1  # what the allowance counts
            if prompt and prefill <= 0:
                break
            if swapped:
                num_new = min(req.num_tokens - req.num_computed_tokens, budget, prefill if prompt else budget)
                if self.kv_cache.allocate_slots(req, num_new) is None:
                    break
                self.stats.num_swapped_in += 1
            else:
                hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(req)
                owed = req.num_tokens - num_hit_tokens
                if not self.config.enable_chunked_prefill and owed > budget:
                    break
                num_new = min(owed, budget, prefill)
                req.num_computed_tokens = 0
                if self.kv_cache.allocate_slots(req, num_new, hit_blocks) is None:
                    break
                self.kv_cache.record_prefix_lookup(req, num_hit_tokens)
                req.num_computed_tokens = num_hit_tokens
            self.waiting.popleft()
            num_seqs += req.num_seqs
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.arrival_seq)
            out.scheduled.append(ScheduledRequest(req, num_new, self.kv_cache.block_table(req.request_id)))
            budget -= num_new
            prefill -= num_new if prompt else 0

        if not out.scheduled and self.waiting:
            self._set_aside_idle(out)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.num_running = sum(r.num_seqs for r in self.running)
        self.stats.num_batched_tokens += out.num_batched_tokens
        out.block_copies = self.kv_cache.take_copies()
        return out

    def _prefill_allowance(self) -> int:
        """Prompt tokens this step may take. While requests decode and few wait, at most
        max_prefill_tokens_while_decoding: a step that prefills a whole 384-token prompt beside 30 decodes makes
        each of them wait ~100 ms for its next token on the 2-core Xeon VM, two such prompts twice that (serving
        at 4 req/s: P99 inter-token latency 275 ms with the whole budget, 118 ms with 256 tokens; median TTFT
        217 vs 182 ms). A queue of more than an eighth of max_num_seqs is a backlog, served with the whole
        budget for throughput (64 requests at once: 602 vs 533 output tok/s with 256 tokens always)."""
        cfg = self.config
        cap, whole = cfg.max_prefill_tokens_while_decoding, cfg.max_num_batched_tokens
        if not cap or not cfg.enable_chunked_prefill or len(self.waiting) > max(1, cfg.max_num_seqs // 8):
            return whole
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        return min(cap, whole) if decoding else whole

    def _set_aside_idle(self, out: SchedulerOutput) -> None:
        """Nothing could run: the running requests owe no token (beams waiting for a sibling's candidates)
        while the waiting head, often that sibling, lacks the blocks they hold. The latest idle one is
        preempted to the back of the queue, so the head comes in next step instead of the two waiting on
        each other forever."""
        idle = [r for r in self.running if r.num_tokens == r.num_computed_tokens]
        if not idle:
            return
        victim = idle[-1]
        self.running.remove(victim)
        self._preempt(victim)
        self.waiting.remove(victim)
        self.waiting.append(victim)
        out.preempted.append(victim)

    def _preempt(self, req: Request) -> None:
        req.clear_spec()
        if self.preemption_mode == "swap" and self.kv_cache.swap_out(req):
            self.stats.num_swapped_out += 1
        else:  # recompute (or the host pool is full): drop the KV, keep the tokens
            if self.preemption_mode == "swap":
                if not self.stats.num_swap_recomputes:
                    logger.warning("the swap space has no room for the %d KV blocks of preempted request %s: it "
                                   "is recomputed instead (raise --swap-space; counted in num_swap_recomputes)",
                                   len(self.kv_cache.block_table(req.request_id)), req.request_id)
                self.stats.num_swap_recomputes += 1
            self.kv_cache.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """Advance computed counts, append sampled tokens (with speculation: the accepted drafts plus
        one), apply stop rules. Returns the requests that got tokens this step (finished ones included)."""
        progressed = []
        for s in out.scheduled:
            req = s.request
            req.clear_spec()
            if req.is_finished:  # aborted while the step ran
                continue
            tokens = sampled.get(req.request_id)
            tokens = [tokens] if isinstance(tokens, int) else tokens or []
            rejected = len(s.spec_token_ids) - max(len(tokens) - 1, 0)
            self.stats.num_accepted_tokens += len(s.spec_token_ids) - rejected
            per_pos = self.stats.num_accepted_per_pos
            per_pos.extend([0] * (len(s.spec_token_ids) - len(per_pos)))
            for j in range(len(s.spec_token_ids) - rejected):
                per_pos[j] += 1
            # Rejected drafts' KV stays in its slots, beyond num_computed_tokens: it is overwritten, never read.
            req.num_computed_tokens += s.num_new_tokens - rejected
            self.kv_cache.cache_full_blocks(req)
            if req.pending_forks and req.num_computed_tokens >= req.num_prompt_tokens - 1:
                self._fork(req)
            if not tokens:
                continue
            progressed.append(req)
            for token in tokens:
                req.append_token(token)
                self._check_stop(req, token)
                if req.is_finished:  # e.g. max_tokens reached inside an accepted run: drop the rest
                    break
        return progressed

    def replace_beams(self, old: list[Request], new: list[tuple[Request, Request]]) -> None:
        """Beam search step: each new beam (child) shares its parent's computed blocks, then the old
        beams are dropped. A parent that lost its KV to preemption gives a child that recomputes."""
        for parent, child in new:
            self.requests[child.request_id] = child
            if parent.status == RequestStatus.RUNNING and parent.num_computed_tokens:
                self.kv_cache.fork(parent, child, parent.num_computed_tokens)
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = RequestStatus.RUNNING
                bisect.insort(self.running, child, key=lambda r: r.arrival_seq)
            else:
                child.status = RequestStatus.PREEMPTED
                self.waiting.appendleft(child)
        for req in old:
            self.drop_request(req)

    def drop_request(self, req: Request) -> None:
        """Remove a request that ends silently (a beam that was not continued)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        self.kv_cache.free(req)
        self.requests.pop(req.request_id, None)

    def _fork(self, leader: Request) -> None:
        """Siblings share the leader's prompt blocks and recompute only the last prompt token, which
        gives each its own logits for its first sample."""
        n = leader.num_prompt_tokens - 1
        for child in leader.pending_forks:
            self.kv_cache.fork(leader, child, n)
            child.num_computed_tokens = n
            child.status = RequestStatus.RUNNING
            bisect.insort(self.running, child, key=lambda r: r.arrival_seq)
        leader.pending_forks = []

    def _check_stop(self, req: Request, token: int) -> None:
        p = req.params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                return self.finish_request(req, RequestStatus.FINISHED_STOPPED, stop_reason=token)
            if not p.ignore_eos and token in req.eos_token_ids:
                return self.finish_request(req, RequestStatus.FINISHED_STOPPED)
        if (p.max_tokens is not None and n_out >= p.max_tokens) or req.num_tokens >= self.max_model_len:
            self.finish_request(req, RequestStatus.FINISHED_LENGTH)
