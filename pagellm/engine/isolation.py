"""One request's parameters must never fail another's: the step's sampling, isolated per request.

Sampling (logits processing, masks, seeded generators, grammars) is where a request's own parameters act,
so that is where a step may fail because of one request. When the batched call raises, each request is
sampled again alone: those that still fail are the culprits and finish with finish_reason "error" and
their message (the engine frees their KV blocks); the others keep the tokens they get alone. A failing
forward pass is not isolated: nothing in it belongs to one request, so it still fails the whole engine.

Alone, a request samples exactly what it would have in the batch (the sampler does not depend on the
batch), provided its sampling state is as it was before the failed call: seeded generators are restored
(a failed call may have drawn from some, e.g. while verifying drafts), and generators the failed call
created are dropped. Unseeded random requests draw from the global generator, which a retry cannot
replay; they are not reproducible anyway.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from pagellm.core.scheduler import ScheduledRequest
from pagellm.engine.output_processor import RequestState
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.request import request_of
from pagellm.sample.sampler import NoTokenAllowedError
from pagellm.sample.step import SampledToken, StepSampler

logger = logging.getLogger("pagellm")


def sample_isolated(step_sampler: StepSampler, scheduled: list[ScheduledRequest],
                    logits: torch.Tensor) -> tuple[dict[str, SampledToken], dict[str, str]]:
    """(sampled tokens by sequence id, error message by sequence id of each request that failed)."""
    saved = [(s.request, s.request.sampling_state, _generator_state(s.request.sampling_state))
             for s in scheduled]
    try:
        return step_sampler(scheduled, logits), {}
    except Exception as e:
        logger.warning("sampling failed for a batch of %d (%s: %s); sampling each request alone to find "
                       "the one(s) whose parameters fail", len(scheduled), type(e).__name__, e)
    for req, state, gen_state in saved:
        req.sampling_state = state
        if gen_state is not None:
            state.set_state(gen_state)
    sampled: dict[str, SampledToken] = {}
    failed: dict[str, str] = {}
    row = 0
    for s in scheduled:
        n = 1 + len(s.spec_token_ids)
        try:
            sampled.update(step_sampler([s], logits[row:row + n]))
        except NoTokenAllowedError as e:  # its parameters contradict each other: the message says how
            failed[s.request.request_id] = str(e)
        except Exception as e:
            failed[s.request.request_id] = f"sampling failed for this request: {type(e).__name__}: {e}"
            logger.warning("request %s failed alone in sampling: %s: %s", request_of(s.request.request_id),
                           type(e).__name__, e)
        row += n
    return sampled, failed


def _generator_state(state) -> torch.Tensor | None:
    return state.get_state() if isinstance(state, torch.Generator) else None


def error_output(state: RequestState, message: str, n: int) -> RequestOutput:
    """The last output of a request failed by its own parameters: finished, with `error` set. Sequences
    that had already finished keep their reason; the rest (every beam) end with "error"."""
    out = state.output()
    outs = out.outputs or [CompletionOutput(i, "", []) for i in range(n)]
    outs = [c if c.finished else dataclasses.replace(c, finish_reason="error") for c in outs]
    return dataclasses.replace(out, outputs=outs, finished=True, error=message)
