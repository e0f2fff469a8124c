"""A request's life: tokens, progress through the model, status. Pure Python (the scheduler owns it)."""

from __future__ import annotations

import enum
import itertools
from typing import Any

from pagellm.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its own parameters made the step fail for it (vLLM's FinishReason.ERROR)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


def request_of(seq_id: str) -> str:
    """The engine request a sequence belongs to: LLMEngine names sequences `<request id>#<i>` (beams
    `#beam<step>.<j>`), and what follows the last '#' never holds one. For messages the client reads."""
    return seq_id.rsplit("#", 1)[0]


class Request:
    """One sequence. `num_computed_tokens` is how many of `all_token_ids` have KV in the cache."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), arrival_time: float = 0.0,
                 cache_salt: str | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt  # tenants with different salts never share prefix-cache blocks
        self.arrival_seq = next(_arrival_counter)  # priority: lower arrived earlier (beams of one request tie)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # n > 1: siblings that will fork from this request's blocks once its prompt is computed.
        self.pending_forks: list[Request] = []
        self.extra_seats = 0  # beam search: seats reserved for beams this request will become
        # Speculative decoding: proposed next tokens (and the draft model's distributions for them).
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: Any = None
        # Per-request state that belongs to other layers (torch generator, detokenizer); opaque here.
        self.sampling_state: Any = None
        # Structured output: the sequence's grammar matcher (pagellm/structured_output), made on first use.
        self.grammar: Any = None
        # With params.prompt_logprobs: one entry per prompt position 0..P-2 (scoring prompt token p + 1),
        # appended by the model runner as prefill chunks run (pagellm/sample/prompt_logprobs.py).
        self.prompt_logprob_rows: list = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_seqs(self) -> int:
        """Sequences this request will occupy once its pending forks happen."""
        return 1 + len(self.pending_forks) + self.extra_seats

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def extend(self, request_id: str, token_id: int) -> Request:
        """A copy of this sequence plus one token, under a new id (a beam-search continuation)."""
        child = Request(request_id, self.prompt_token_ids, self.params, self.eos_token_ids, self.arrival_time,
                        self.cache_salt)
        child.arrival_seq = self.arrival_seq  # a beam keeps its request's place: else it is the first preempted
        child.output_token_ids = self.output_token_ids + [token_id]
        child.all_token_ids = self.all_token_ids + [token_id]
        child.grammar = self.grammar.fork() if self.grammar is not None else None  # it then accepts token_id
        return child

    def clear_spec(self) -> None:
        self.spec_token_ids = []
        self.spec_draft_probs = None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
