"""Where the engine meets the hardware: one Platform per device kind, chosen once from `--device`.

A platform probes what the machine has (CPU ISA and cores, or the GPU's compute capability and memory) and
makes every decision that depends on it: the compute dtype for `--dtype auto`, the attention backend for
`--attention-backend auto`, which op implementations run (plain torch or native kernels), how KV and swap
memory are allocated, thread settings and the memory hooks around loading. Nothing above this package
probes hardware itself.
"""

from __future__ import annotations

from pagellm.platforms.base import OpChoices, Platform

__all__ = ["OpChoices", "Platform", "get_platform"]

_PLATFORMS: dict[str, Platform] = {}


def get_platform(device: str = "cpu") -> Platform:
    """The platform for a device string ("cpu", "cuda", "cuda:1"); probed once per device (each GPU is its
    own platform: its memory and compute capability may differ)."""
    kind, _, index = str(device).partition(":")
    key = kind if kind != "cuda" or not index else f"cuda:{index}"
    if key not in _PLATFORMS:
        if kind == "cpu":
            from pagellm.platforms.cpu import CpuPlatform

            _PLATFORMS[key] = CpuPlatform()
        elif kind == "cuda":
            from pagellm.platforms.cuda import CudaPlatform

            if index and not index.isdigit():
                raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
            _PLATFORMS[key] = CudaPlatform(int(index) if index else None)
        else:
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return _PLATFORMS[key]
