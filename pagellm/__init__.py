"""pagellm: a readable LLM inference engine with a paged KV cache and continuous batching."""

from pagellm.outputs import BeamSearchOutput, CompletionOutput, RequestOutput
from pagellm.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "BeamSearchOutput"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so that `import pagellm.core` (pure Python) never pays for importing torch.
    if name == "LLM":
        from pagellm.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
