"""Reads and checks a .safetensors header (8-byte length, JSON) before the safetensors library maps it.

The library refuses most corrupt files itself, but with messages that name neither the file nor the
tensor; checking here first gives one ModelFileError with both, and the tensor shapes for
model_checks.check_weight_shapes without reading any weights.
"""

from __future__ import annotations

import json
import math
import os
import struct

from pagellm.model.loader.model_file_error import ModelFileError

# The safetensors library's own cap on the JSON header; a larger length field is corruption.
MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_safetensors_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor, after checking each one's bytes lie inside the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(path, f"truncated: {size} bytes, a safetensors file starts with an 8-byte "
                                 "header length", size)
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ModelFileError(path, f"header length {n} exceeds the {size - 8} bytes after it "
                                 "(truncated or corrupt)", 0)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFileError(path, f"header is not valid JSON ({e})", 8) from None
    if not isinstance(header, dict):
        raise ModelFileError(path, f"header is a JSON {type(header).__name__}, not an object", 8)
    data_bytes = size - 8 - n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _check_entry(path, name, entry, data_bytes)
    return tensors


def _check_entry(path: str, name: str, entry, data_bytes: int) -> tuple[str, tuple[int, ...]]:
    def bad(what: str) -> ModelFileError:
        return ModelFileError(path, what, f"tensor {name!r}")

    if not isinstance(entry, dict):
        raise bad(f"header entry is a {type(entry).__name__}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise bad(f"unknown dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise bad(f"shape must be a list of non-negative integers, got {str(shape)[:60]}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise bad(f"data_offsets must be [begin, end], got {str(offsets)[:60]}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise bad(f"data_offsets [{begin}, {end}] fall outside the {data_bytes} data bytes (truncated?)")
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != want:
        raise bad(f"holds {end - begin} bytes but shape {shape} of {dtype} needs {want}")
    return dtype, tuple(shape)
