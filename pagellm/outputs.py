"""Results handed to users, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
    # Where the token alone is not whole characters (a piece of a multi-byte one: decoded_token is then
    # U+FFFD), the bytes it stands for, which OpenAI's chat logprobs report so that clients can join them.
    token_bytes: bytes | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: dict | None = None
    # Set when this request's own parameters made its step fail (every output then has finish_reason
    # "error"): what failed. The other requests of that step go on.
    error: str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which has no
    # context), the token's own logprob plus the top-N.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class BeamSearchSequence:
    """One of LLM.beam_search's sequences (vLLM's): tokens holds the prompt's ids then the generated ones,
    text their decoding."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
