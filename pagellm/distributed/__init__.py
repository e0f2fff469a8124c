"""torch.distributed for pagellm's worker processes: process groups built straight from a TCPStore (no global
default group, so several engines can live in one process), and the few collectives the model and the
executor use. Gloo on CPU; a CUDA build would construct NCCL groups the same way."""

from pagellm.distributed.comm import GlooGroup, PipelineLink, free_port

__all__ = ["GlooGroup", "PipelineLink", "free_port"]
