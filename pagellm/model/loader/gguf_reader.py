"""A minimal GGUF header reader: metadata and tensor locations, numpy only (no torch).

gguf.GGUFReader builds a numpy view per array element, which takes seconds for a 50k-token vocabulary;
parsing the header directly with struct takes tens of milliseconds. Tensor bytes stay in one mmap.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types -> struct format (scalars) and numpy dtype (fast array path).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


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
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._mm
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        self.version = struct.unpack_from("<I", buf, 4)[0]
        if self.version < 2:
            # v1 used 32-bit counts and is long obsolete; llama.cpp dropped it too.
            raise ValueError(f"{self.path}: GGUF version {self.version} is not supported (need >= 2)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        self._pos = 24
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = self._unpack("<I")
            self.metadata[key] = self._value(vtype)

        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            qtype = GGMLQuantizationType(self._unpack("<I"))
            rel_offset = self._unpack("<Q")
            infos.append((name, tuple(reversed(dims)), qtype, rel_offset))

        align = int(self.metadata.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, qtype, rel in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape, dtype=np.int64))
            self.tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + rel, n // block * type_size)

    # -- header parsing ------------------------------------------------------------------------------

    def _unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self._mm, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = self._mm[self._pos:self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype = self._unpack("<I")
            count = self._unpack("<Q")
            if itype in _NP:
                arr = np.frombuffer(self._mm, dtype=_NP[itype], count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(itype) for _ in range(count)]
        return self._unpack("<" + _SCALARS[vtype])

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
