"""Everything after the logits: the batched sampler, rejection sampling of drafts, logprobs and beam
candidates. `StepSampler` turns one step's logits rows into a SampledToken per request."""

from pagellm.sample.sampler import Sampler, SamplingRow, sampling_probs
from pagellm.sample.step import SampledToken, StepSampler

__all__ = ["SampledToken", "Sampler", "SamplingRow", "StepSampler", "sampling_probs"]
