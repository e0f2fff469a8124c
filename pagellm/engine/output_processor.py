"""Turns sampled tokens into user-facing outputs: incremental text, stop strings, logprobs."""

from __future__ import annotations

import dataclasses

from pagellm.engine.beam_search import BeamSearchGroup
from pagellm.engine.prompt_logprobs import PromptLogprobsState
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import IncrementalDetokenizer, Tokenizer


class SequenceState:
    """Text and logprobs of one generated sequence (one of a request's n)."""

    def __init__(self, index: int, req: Request, tokenizer: Tokenizer):
        self.index = index
        self.request = req
        self.params = req.params
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids,
                                            skip_special_tokens=req.params.skip_special_tokens)
        self.tokenizer = tokenizer
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if req.params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if req.params.logprobs is not None else None
        self._hold_back = max((len(s) for s in req.params.stop), default=1) - 1
        self._num_tokens = 0
        # The text of the first min_tokens tokens, where no stop string may end (vLLM's stop_check_offset).
        self._stop_floor = 0

    def add_token(self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None,
                  stop_token: bool = False, rank: int | None = None) -> str | None:
        """Append one token's text; returns the stop string if one now appears in the text. stop_token: the
        token ended the sequence (EOS or a stop_token_ids entry): its text is left out unless
        include_stop_str_in_output (vLLM's rule; the token id and its logprob stay)."""
        new_text = "" if stop_token and not self.params.include_stop_str_in_output else self.detok.step([token_id])
        self.text += new_text
        self._num_tokens += 1
        if self._num_tokens <= self.params.min_tokens:
            self._stop_floor = len(self.text)
        if self.logprobs is not None and logprob is not None:
            entry = {tid: self._logprob(tid, lp, rank + 1) for rank, (tid, lp) in enumerate(top or [])}
            if token_id not in entry:
                entry = {token_id: self._logprob(token_id, logprob, rank), **entry}  # outside the top-N
            self.logprobs.append(entry)
            self.cumulative_logprob += logprob
        return self._find_stop(len(new_text))

    def _logprob(self, token_id: int, logprob: float, rank: int | None) -> Logprob:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return Logprob(logprob, rank, text, self.tokenizer.token_bytes(token_id) if "\ufffd" in text else None)

    def _find_stop(self, new_len: int) -> str | None:
        p: SamplingParams = self.params
        if not p.stop:
            return None
        # A stop string can only end inside the newest token's text plus what could precede it.
        window_start = max(0, len(self.text) - new_len - self._hold_back)
        best = None
        for stop in p.stop:  # one that ends within the first min_tokens tokens' text does not count
            pos = self.text.find(stop, max(window_start, self._stop_floor - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        self.text = self.text[:pos + len(stop)] if p.include_stop_str_in_output else self.text[:pos]
        return stop

    def output(self) -> CompletionOutput:
        req = self.request
        text = self.text
        if not req.is_finished and self._hold_back:
            # Don't show what may turn out to be the start of a stop string.
            text = text[:max(0, len(text) - self._hold_back)]
        return CompletionOutput(index=self.index, text=text, token_ids=list(req.output_token_ids),
                                cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs,
                                finish_reason=req.finish_reason, stop_reason=req.stop_reason)


class RequestState:
    """A user request: its prompt and the n sequences generated for it (or its beam-search group)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 seqs: list[SequenceState], arrival_time: float, beam: BeamSearchGroup | None = None,
                 tokenizer: Tokenizer | None = None, copies: int = 1):
        self.request_id = request_id
        self.copies = copies  # n greedy samples: one sequence, reported n times
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.seqs = seqs
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None  # set with its first output, when its prompt is counted
        self.beam = beam
        self.tokenizer = tokenizer
        source = seqs[0].request if seqs else beam.beams[0][0]
        self.prompt_logprobs = None if source.params.prompt_logprobs is None else \
            PromptLogprobsState(source, tokenizer or seqs[0].tokenizer)

    @property
    def live_requests(self) -> list[Request]:
        if self.beam is not None:
            return [r for r, _ in self.beam.beams]
        return [s.request for s in self.seqs]

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.request.is_finished for s in self.seqs)

    def finish_reasons(self, unfinished: str) -> list[str]:
        """What request_success counts: each of n samples by its own finish reason (`unfinished` for one still
        running), as vLLM counts an n > 1 request's samples; a beam search once."""
        if self.beam is not None:
            return [unfinished]
        return [s.request.finish_reason if s.request.is_finished else unfinished for s in self.seqs] * self.copies

    def output(self) -> RequestOutput:
        if self.beam is not None:
            return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self._beam_outputs(),
                                 self.finished, prompt_logprobs=self._prompt_logprobs())
        outs = [s.output() for s in self.seqs]
        if self.copies > 1:
            outs = [dataclasses.replace(outs[0], index=i) for i in range(self.copies)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             prompt_logprobs=self._prompt_logprobs())

    def _prompt_logprobs(self):
        return None if self.prompt_logprobs is None else self.prompt_logprobs.output()

    def _beam_outputs(self) -> list[CompletionOutput]:
        if not self.beam.done:
            return []
        p = self.beam.params
        outs = []
        for i, h in enumerate(self.beam.best(p.n)):
            ended_on_eos = bool(h.token_ids) and h.token_ids[-1] in self.beam.eos_token_ids and not p.ignore_eos
            outs.append(CompletionOutput(
                i, self.tokenizer.decode(h.token_ids, skip_special_tokens=p.skip_special_tokens), h.token_ids,
                cumulative_logprob=h.cumulative_logprob, finish_reason="stop" if ended_on_eos else "length"))
        return outs
