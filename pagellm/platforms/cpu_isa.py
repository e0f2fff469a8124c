"""What the CPU offers, from /proc/cpuinfo, and the PAGELLM_CPU_ISA cap that lets one machine stand in for an
older one (kernels/build.py ISA_LEVELS)."""

from __future__ import annotations

import logging
import os
import platform as _platform

from pagellm.kernels.build import ISA_LEVELS, check_isa_level, cpu_flags, isa_level

log = logging.getLogger(__name__)

# The /proc/cpuinfo flags the platform reports, in the order `pagellm info` lists them.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile",
             "amx_bf16", "amx_int8")


def probe() -> tuple[str, str, list[str]]:
    """(model name, PAGELLM_CPU_ISA level, the ISA_FLAGS the platform may use, in order)."""
    model, flags = _cpu_model(), cpu_flags()
    level = isa_level()
    if level != "native":
        flags = _capped_flags(level, flags)
    return model, level, [flag for flag in ISA_FLAGS if flag in flags]


def _capped_flags(level: str, flags: set[str]) -> set[str]:
    """The CPU's flags cut to a PAGELLM_CPU_ISA level's (kernels/build.py ISA_LEVELS), with torch's own ISA
    choices capped to match where the environment does not set them already (oneDNN, MKL and ATen read these
    at their first use: a process that ran torch ops before is warned). numpy's OpenBLAS picked its kernels when
    it loaded: that one only OPENBLAS_CORETYPE, set before the process starts, caps."""
    check_isa_level(level, flags)
    cap = ISA_LEVELS[level]
    for name, value in (("ONEDNN_MAX_CPU_ISA", cap.onednn), ("MKL_ENABLE_INSTRUCTIONS", cap.mkl),
                        ("ATEN_CPU_CAPABILITY", cap.aten)):
        os.environ.setdefault(name, value)
    import torch

    if torch.backends.cpu.get_cpu_capability().lower() not in (os.environ["ATEN_CPU_CAPABILITY"].lower(), "default"):
        log.warning("PAGELLM_CPU_ISA=%s: torch already chose its %s kernels in this process (set the variable "
                    "before it starts)", level, torch.backends.cpu.get_cpu_capability())
    if level == "avx2" and not os.environ.get("OPENBLAS_CORETYPE"):
        log.warning("PAGELLM_CPU_ISA=avx2 without OPENBLAS_CORETYPE=Haswell: numpy's OpenBLAS keeps the kernels it "
                    "chose for this CPU")
    return flags & set(cap.kept)


def _cpu_model() -> str:
    """The first CPU's model name with its family/model numbers. Virtual machines often report a bare "AMD EPYC":
    the family number tells Zen 3 (25) from Zen 5 (26)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the first processor's block ends at a blank line
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or _platform.processor() or "unknown"
    if "cpu family" in fields:
        model += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return model
