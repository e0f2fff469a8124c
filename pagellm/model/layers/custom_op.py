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
        self.use("native")

    def use(self, impl: str) -> None:
        """impl: "native" or a platform's name ("cpu"); an op without that implementation keeps native.
        The method is looked up here, once, so a call costs one indirection."""
        self.impl = impl if hasattr(self, f"forward_{impl}") else "native"
        self._impl_fn = getattr(self, f"forward_{self.impl}")

    def forward(self, *args, **kwargs):
        return self._impl_fn(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError
