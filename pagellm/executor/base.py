"""The engine's side of a step: SchedulerOutput -> StepMessage -> (some executor runs it) -> rows to sample."""

from __future__ import annotations

import torch

from pagellm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagellm.core.step_message import StepMessage, StepMessageBuilder
from pagellm.executor.errors import WorkerFailedError
from pagellm.model.runner import StepResult


class Executor:
    """Subclasses implement `run(msg)` (and `shutdown`); everything else is shared, so the in-process and the
    multi-process engine take the same code path up to the message."""

    name = "base"
    error: str | None = None  # why the executor can no longer run steps (a worker died)

    def __init__(self, block_size: int):
        self.builder = StepMessageBuilder(block_size)
        self.on_failure = None  # called from another thread when `error` is set between steps

    def check_health(self) -> None:
        if self.error is not None:
            raise WorkerFailedError(self.error)

    def run(self, msg: StepMessage) -> StepResult:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass

    def forget(self, seq_id: str) -> None:
        self.builder.forget(seq_id)

    def execute(self, out: SchedulerOutput) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """One forward over the step's batch; logits [rows, vocab] for the requests that sample, in batch
        order, 1 + len(spec_token_ids) rows each (the positions that score drafts, then the next). Requests
        asking for prompt logprobs get them appended to `request.prompt_logprob_rows`."""
        if out.is_empty and not out.block_copies:
            return [], torch.empty(0)
        result = self.run(self.builder.build(out))
        for i, rows in result.prompt_logprobs.items():
            out.scheduled[i].request.prompt_logprob_rows.extend(rows)
        if result.logits is None:
            return [], torch.empty(0)
        return [out.scheduled[i] for i in result.sample_rows], result.logits

    def forward_hidden(self, out: SchedulerOutput) -> torch.Tensor:
        """Final normed hidden states [T, hidden] of every row, in batch order (embeddings)."""
        return self.run(self.builder.build(out, want="hidden")).hidden

    def forward_all_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """float32 logits [T, vocab] of every row (scoring)."""
        return self.run(self.builder.build(out, want="all_logits")).hidden
