"""What crosses from the scheduler to the model workers each step: plain data, picklable, no Request objects.

The scheduler runs once, in the engine process; every worker (one in-process runner, or T x P processes)
keeps a persistent copy of each running sequence's tokens and block table (`WorkerBatch`) and receives only
what changed (`StepMessageBuilder`): a sequence it has not seen, or whose KV moved (preemption, swap, a
recompute: seen as a changed preemption count, since a step that ran nothing may preempt between two
messages), comes whole as `NewSequence`; a running one brings the tokens appended since (`SequenceDiff`:
sampled tokens, accepted drafts) and the tail of its block table that changed: blocks added, or the block
being written replaced by its copy (copy-on-write). Blocks of computed positions never change otherwise,
so only the table from the block of `num_computed_tokens` on is compared. `finished` lists sequences the
workers can forget. Each step's rows are then `ScheduledRows` in batch order.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from pagellm.core.kv_cache_manager import BlockCopies
from pagellm.core.scheduler import SchedulerOutput
from pagellm.request import RequestStatus


@dataclass
class NewSequence:
    seq_id: str
    token_ids: list[int]  # every known token (prompt, then outputs so far)
    block_ids: list[int]
    num_prompt_tokens: int


@dataclass
class SequenceDiff:
    seq_id: str
    new_token_ids: list[int]  # appended to the worker's copy
    blocks_from: int  # its block table from this index on is replaced by block_ids
    block_ids: list[int]


@dataclass
class ScheduledRows:
    """One sequence's rows this step: positions num_computed_tokens .. + num_new_tokens (drafts last)."""

    seq_id: str
    num_computed_tokens: int
    num_new_tokens: int  # including the drafts
    spec_token_ids: list[int] = field(default_factory=list)
    samples: bool = True  # this chunk reaches the last known token: its last 1 + len(drafts) rows are kept
    # prompt logprobs: (first prompt position not scored yet, top-k); None when not asked for
    prompt_logprobs: tuple[int, int] | None = None


@dataclass
class StepMessage:
    new: list[NewSequence] = field(default_factory=list)
    diffs: list[SequenceDiff] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    rows: list[ScheduledRows] = field(default_factory=list)
    block_copies: BlockCopies = field(default_factory=BlockCopies)
    # what the step returns: "logits" (rows that sample, prompt logprobs), "hidden" (every row's final
    # hidden state: embeddings) or "all_logits" (every row's logits: scoring)
    want: str = "logits"
    # sequences running when the step was scheduled (SchedulerOutput.num_running; 0: not known): a batch's size,
    # which plain and speculative runs share where their steps' rows differ (ModelRunner._batch_rows)
    num_running: int = 0

    @property
    def num_rows(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)


@dataclass
class _Sent:
    # the engine-side sequence (a Request, or a draft model's own sequence object), weakly: a finished
    # request (its grammar matcher, its logprobs) must not live on here until the next step
    request: weakref.ref
    num_tokens: int
    block_ids: list[int]  # the table the workers hold
    num_preemptions: int  # a preemption between two builds (a step that ran nothing) moved its KV


class StepMessageBuilder:
    """Engine side: remembers what the workers hold and turns a SchedulerOutput into a StepMessage."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._sent: dict[str, _Sent] = {}
        self._forgotten: list[str] = []

    def forget(self, seq_id: str) -> None:
        """A caller without a scheduler (the draft model) says when a sequence is gone, or when tokens the
        workers hold were rewritten (a Request's tokens only ever grow; a draft's copy is cut back to what
        the target accepted)."""
        if self._sent.pop(seq_id, None) is not None:
            self._forgotten.append(seq_id)

    def build(self, out: SchedulerOutput, want: str = "logits") -> StepMessage:
        msg = StepMessage(block_copies=out.block_copies, want=want, num_running=out.num_running)
        msg.finished, self._forgotten = self._forgotten, []
        scheduled = {s.request.request_id for s in out.scheduled}
        # Sequences no longer running (finished, dropped beams, preempted: recompute or swap) leave the
        # workers; one that comes back is sent whole again.
        for seq_id in [k for k, v in self._sent.items() if k not in scheduled and not _running(v.request())]:
            del self._sent[seq_id]
            msg.finished.append(seq_id)
        for s in out.scheduled:
            req, seq_id = s.request, s.request.request_id
            sent = self._sent.get(seq_id)
            tokens, blocks = req.all_token_ids, s.block_ids
            if sent is not None and (sent.request() is not req or len(tokens) < sent.num_tokens
                                     or len(blocks) < len(sent.block_ids)
                                     or getattr(req, "num_preemptions", 0) != sent.num_preemptions):
                sent = None  # not the sequence the workers hold: replace it
                msg.finished.append(seq_id)
            if sent is None:
                msg.new.append(NewSequence(seq_id, list(tokens), list(blocks),
                                           getattr(req, "num_prompt_tokens", len(tokens))))
                self._sent[seq_id] = _Sent(weakref.ref(req), len(tokens), list(blocks),
                                           getattr(req, "num_preemptions", 0))
            else:
                held = sent.block_ids
                first = min(req.num_computed_tokens // self.block_size, len(held))
                while first < len(held) and held[first] == blocks[first]:
                    first += 1
                if len(tokens) > sent.num_tokens or first < len(blocks):
                    msg.diffs.append(SequenceDiff(seq_id, tokens[sent.num_tokens:], first, blocks[first:]))
                    sent.num_tokens = len(tokens)
                    held[first:] = blocks[first:]
            msg.rows.append(ScheduledRows(seq_id, req.num_computed_tokens, s.num_new_tokens,
                                          list(s.spec_token_ids), s.samples, _prompt_logprobs(req)))
        return msg


def _running(req) -> bool:
    return req is not None and getattr(req, "status", RequestStatus.RUNNING) == RequestStatus.RUNNING


def _prompt_logprobs(req) -> tuple[int, int] | None:
    params = getattr(req, "params", None)  # a draft model's sequences have none
    if params is None or params.prompt_logprobs is None or req.output_token_ids:
        return None
    return len(req.prompt_logprob_rows), params.prompt_logprobs


@dataclass
class SequenceCopy:
    token_ids: list[int]
    block_ids: list[int]
    num_prompt_tokens: int


class WorkerBatch:
    """Worker side: the persistent copy of every sequence the engine has sent."""

    def __init__(self):
        self.seqs: dict[str, SequenceCopy] = {}

    def apply(self, msg: StepMessage) -> None:
        for seq_id in msg.finished:
            self.seqs.pop(seq_id, None)
        for n in msg.new:
            self.seqs[n.seq_id] = SequenceCopy(n.token_ids, n.block_ids, n.num_prompt_tokens)
        for d in msg.diffs:
            seq = self.seqs[d.seq_id]
            seq.token_ids.extend(d.new_token_ids)
            seq.block_ids[d.blocks_from:] = d.block_ids
