"""Ops with several implementations, picked once (vLLM's CustomOp idea).

`forward_native` is plain torch: the reference, and what runs on any device. A platform may offer another
implementation (`forward_cpu`: the native CPU kernels); the loader calls `use()` once after loading, so the
hot path has no per-call capability checks and the model's code never names a device.
"""

from __future__ import annotations

from torch import nn


class CustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.impl = "native"

    def use(self, impl: str) -> None:
        """impl: "native" or a platform's name ("cpu"); an op without that implementation keeps native."""
        self.impl = impl if hasattr(self, f"forward_{impl}") else "native"

    def forward(self, *args, **kwargs):
        if self.impl == "native":
            return self.forward_native(*args, **kwargs)
        return getattr(self, f"forward_{self.impl}")(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError
