"""A minimal GGUF header reader: metadata and tensor locations, numpy only (no torch).

gguf.GGUFReader builds a numpy view per array element, which takes seconds for a 50k-token vocabulary;
parsing the header directly with struct takes tens of milliseconds. Tensor bytes stay in one mmap.

The file is untrusted input: every count and length is checked against the bytes left before anything
is read or allocated, so a corrupt file costs at most its own size and ends in one ModelFileError that
names the byte offset or tensor (never a struct.error, a huge allocation or a loop over a bogus count).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pagellm.model.loader.model_file_error import ModelFileError

GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version (u32), tensor count (u64), metadata count (u64)
SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts and is long obsolete; llama.cpp dropped it too
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8  # arrays of arrays are legal; deeper than this is corruption, not a model

# GGUF metadata value types -> struct format (scalars) and numpy dtype (fast array path).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# The fewest bytes one value of a type can take: bounds a count before looping over it.
_MIN_VALUE_BYTES = {**{t: struct.calcsize("<" + f) for t, f in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first, i.e. GGUF's dims reversed ([out, in] for a linear)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Parsed header of a .gguf file. `metadata` maps key -> python value (arrays become lists)."""

    def __init__(self, path: str):
        self.path = str(path)
        with open(self.path, "rb") as f:
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                raise ModelFileError(self.path, f"not a GGUF file (bad magic {magic!r})", 0)
            self.size = os.fstat(f.fileno()).st_size
            if self.size < HEADER_BYTES:
                raise ModelFileError(self.path, f"truncated: {self.size} bytes, a GGUF header needs "
                                     f"{HEADER_BYTES}", self.size)
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except BaseException:
            self._mm.close()
            raise

    def _parse(self) -> None:
        self.version = struct.unpack_from("<I", self._mm, 4)[0]
        if self.version not in SUPPORTED_VERSIONS:
            raise self._error(f"GGUF version {self.version} is not supported (need one of "
                              f"{', '.join(map(str, SUPPORTED_VERSIONS))})", 4)
        n_tensors, n_kv = struct.unpack_from("<QQ", self._mm, 8)
        self._pos = HEADER_BYTES
        self._check_count(n_kv, _MIN_KV_BYTES, "metadata key/value count", 16)
        self._check_count(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensor count", 8)
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = self._unpack("<I")
            self.metadata[key] = self._value(vtype, key)

        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = self._alignment()
        data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for info_pos, name, shape, qtype, rel in infos:
            if name in self.tensors:
                raise self._error(f"tensor {name!r} is listed twice", info_pos)
            if rel % align:
                raise self._error(f"tensor {name!r}: data offset {rel} is not a multiple of the alignment "
                                  f"{align}", info_pos)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape, dtype=object)) if shape else 1
            if shape and shape[-1] % block:
                raise self._error(f"tensor {name!r}: row length {shape[-1]} is not a multiple of "
                                  f"{qtype.name}'s block of {block}", info_pos)
            nbytes, start = n // block * type_size, data_start + rel
            if start + nbytes > self.size:
                raise self._error(f"tensor {name!r} (shape {list(shape)}, {qtype.name}) needs bytes "
                                  f"{start}..{start + nbytes} but the file ends at {self.size} "
                                  "(truncated?)", start)
            self.tensors[name] = GGUFTensorInfo(name, shape, qtype, start, nbytes)

    # -- header parsing ------------------------------------------------------------------------------

    def _error(self, what: str, offset: int | None = None) -> ModelFileError:
        return ModelFileError(self.path, what, self._pos if offset is None else offset)

    def _left(self) -> int:
        return self.size - self._pos

    def _check_count(self, count: int, min_bytes: int, what: str, offset: int | None = None) -> None:
        if count * min_bytes > self._left():
            raise self._error(f"{what} {count} cannot fit in the {self._left()} bytes left of the file", offset)

    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if size > self._left():
            raise self._error(f"truncated: needs {size} more bytes, the file ends at {self.size}")
        value = struct.unpack_from(fmt, self._mm, self._pos)[0]
        self._pos += size
        return value

    def _string(self) -> str:
        start = self._pos
        n = self._unpack("<Q")
        if n > self._left():
            raise self._error(f"string length {n} runs past the end of the file ({self.size} bytes)", start)
        s = self._mm[self._pos:self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int, key: str, depth: int = 0):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            start = self._pos
            itype = self._unpack("<I")
            count = self._unpack("<Q")
            if itype not in _MIN_VALUE_BYTES:
                raise self._error(f"metadata {key!r}: unknown array element type {itype}", start)
            if itype == _ARRAY and depth >= MAX_ARRAY_NESTING:
                raise self._error(f"metadata {key!r}: arrays nested deeper than {MAX_ARRAY_NESTING}", start)
            self._check_count(count, _MIN_VALUE_BYTES[itype], f"metadata {key!r}: array length", start)
            if itype in _NP:
                arr = np.frombuffer(self._mm, dtype=_NP[itype], count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(itype, key, depth + 1) for _ in range(count)]
        if vtype not in _SCALARS:
            raise self._error(f"metadata {key!r}: unknown value type {vtype}", self._pos - 4)
        return self._unpack("<" + _SCALARS[vtype])

    def _tensor_info(self) -> tuple:
        start = self._pos
        name = self._string()
        n_dims = self._unpack("<I")
        if n_dims > MAX_DIMS:
            raise self._error(f"tensor {name!r}: {n_dims} dimensions (GGUF allows at most {MAX_DIMS})", start)
        dims = tuple(self._unpack("<Q") for _ in range(n_dims))
        if 0 in dims:
            raise self._error(f"tensor {name!r}: a dimension is 0 (dims {list(dims)})", start)
        raw_type = self._unpack("<I")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self._error(f"tensor {name!r}: unknown tensor type {raw_type}", start) from None
        if qtype not in GGML_QUANT_SIZES:
            raise self._error(f"tensor {name!r}: tensor type {qtype.name} has no known size", start)
        rel_offset = self._unpack("<Q")
        return start, name, tuple(reversed(dims)), qtype, rel_offset

    def _alignment(self) -> int:
        align = self.metadata.get("general.alignment", 32)
        # llama.cpp requires a power of two; anything else (or a non-integer) is a corrupt field.
        if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
            raise ModelFileError(self.path, f"general.alignment must be a power of two, got {align!r}",
                                 "general.alignment")
        return align

    # -- access --------------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "llama")

    def arch_key(self, key: str, default=None):
        """`{arch}.{key}` from the metadata, e.g. arch_key("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes as uint8 [*rows, bytes_per_row] (what gguf.quants.dequantize takes)."""
        info = self.tensors[name]
        rows = info.shape[:-1]
        return np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(
            *rows, info.nbytes // max(1, int(np.prod(rows, dtype=np.int64))))

    def close(self) -> None:
        self._mm.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        # numpy views may still reference the mmap; only close when nothing does.
        try:
            self.close()
        except BufferError:
            pass


def is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False
