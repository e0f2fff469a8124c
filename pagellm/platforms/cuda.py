"""The CUDA platform: compute capability and memory probed once; bf16 where the GPU has it.

No native kernels here yet: ops run their plain-torch implementations on the GPU and attention is the
torch SDPA backend; swap space is pinned host memory so block copies can overlap with compute."""

from __future__ import annotations

import torch

from pagellm.platforms.base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"

    def __init__(self):
        self.available = torch.cuda.is_available()
        if self.available:
            props = torch.cuda.get_device_properties(0)
            self.gpu_name, self.capability, self.memory = props.name, (props.major, props.minor), props.total_memory
        else:
            self.gpu_name, self.capability, self.memory = "none", (0, 0), 0

    def auto_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.capability >= (8, 0) else torch.float16

    def check_available(self) -> None:
        if not self.available:
            raise ValueError("device 'cuda' was asked for, but torch sees no CUDA GPU here (use --device cpu)")

    def allocate_swap(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)

    def describe(self) -> dict[str, str]:
        dtype = self.auto_dtype()
        return {
            "device": "cuda",
            "gpu": (f"{self.gpu_name}, compute capability {self.capability[0]}.{self.capability[1]}, "
                    f"{self.memory / 2**30:.1f} GiB") if self.available else "none visible to torch",
            "dtype": f"auto -> {str(dtype).removeprefix('torch.')}",
            "op_dtypes": ", ".join(f"{k} {v}" for k, v in self.op_dtypes(dtype).items()),
            "ops": "plain torch (forward_native)",
            "attention_backend": f"auto -> {self.attention_backend('auto', dtype, dtype)}",
            "threads": str(torch.get_num_threads()),
        }
