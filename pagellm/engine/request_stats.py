"""Per-request timing for the metrics layer: what one finished request spent where (vLLM's phases)."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.outputs import RequestOutput


@dataclass
class FinishedRequest:
    """The timeline of one request that finished (vLLM's per-request stats): arrival -> first scheduled
    (queue) -> first token (prefill) -> last token (decode). Times in seconds; n samples share one request."""

    e2e: float
    queue_time: float
    prefill_time: float
    decode_time: float
    num_prompt_tokens: int
    num_generation_tokens: int  # all samples together
    max_generation_tokens: int  # the longest sample
    n: int
    max_tokens: int | None

    @property
    def inference_time(self) -> float:
        return self.prefill_time + self.decode_time

    @property
    def time_per_output_token(self) -> float:
        """Decode time per token after the first, of the longest sample (0 for a one-token request)."""
        return self.decode_time / (self.max_generation_tokens - 1) if self.max_generation_tokens > 1 else 0.0


def finished_request(stream, out: RequestOutput, now: float) -> FinishedRequest:
    """From an async engine RequestStream's timestamps and its final output."""
    # Both times are always set by the time a request finishes; the fallbacks keep the phases summing to
    # at most e2e if that ever changes.
    scheduled = stream.scheduled_time if stream.scheduled_time is not None else stream.arrival_time
    first = stream.first_token_time if stream.first_token_time is not None else now
    lengths = [len(c.token_ids) for c in out.outputs]
    return FinishedRequest(
        e2e=now - stream.arrival_time, queue_time=scheduled - stream.arrival_time,
        prefill_time=first - scheduled, decode_time=now - first,
        num_prompt_tokens=len(out.prompt_token_ids or ()), num_generation_tokens=sum(lengths),
        max_generation_tokens=max(lengths, default=0), n=stream.n, max_tokens=stream.max_tokens)
