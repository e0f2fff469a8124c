"""Native CPU kernels (C++ in cpu/, built on first use with the system compiler, loaded with ctypes).

Everything here has a plain-torch equivalent in pagellm/model; the kernels are an optional fast path.
`cpu_kernels()` returns None when they are disabled (PAGELLM_CPU_KERNELS=0) or cannot be built.
"""

from pagellm.kernels.build import cpu_kernels

__all__ = ["cpu_kernels"]
