"""Triton kernels for CUDA: the paged KV write and unified paged attention (prefill chunks and decodes in
one launch). They take tensors and plain numbers only, like the rest of pagellm.kernels.

Triton is optional (`pip install pagellm[cuda]`): this package imports it only in its submodules
(`kv_write`, `paged_attention`), so `import pagellm` works without it; `triton_available()` says whether
those submodules can be imported. Tests run the kernels on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`, read when a kernel is decorated, i.e. when a submodule is first imported).
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: a stub module without a spec in sys.modules
        return False


__all__ = ["triton_available"]
