"""A .gguf file's metadata and tensor table, read in one pass, its tensor data memory-mapped.

The layout is llama.cpp's (GGUF v2 and v3, little-endian): the magic "GGUF", a version, the
tensor and metadata counts, the metadata (key, value type, value; arrays as element type,
count, elements), then per tensor its name, dimensions (innermost first), ggml type and offset
into the data section, which starts at the next multiple of `general.alignment` (32 unless
given). gguf's own reader makes an array view of every metadata element, which takes seconds
on a vocabulary of 49k tokens and as many merges; this reads numeric arrays as one array each
and strings in one loop.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# metadata value types (gguf.GGUFValueType): struct format of the scalar ones
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    """One tensor: its name, ggml type (a gguf.GGMLQuantizationType), dimensions as GGUF
    lists them (innermost first: shape[0] is a row's length), absolute offset and byte count;
    data: its bytes as a read-only uint8 array [rows, bytes a row] (block types) or its
    elements [rows, shape[0]] (float types)."""

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int
    data: np.ndarray


class GgufReader:
    """`metadata` (key -> int, float, bool, str, a list of str or a numpy array) and `tensors`
    (in file order). Raises ValueError for anything that is not a complete GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ValueError(f"{size} bytes: too short for a GGUF header")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._map)
        self._buf, self._at = buf, 0
        if bytes(buf[:4]) != MAGIC:
            raise ValueError("no GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        self._at = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._u32())
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._at // align) * align
        self.tensors = [self._tensor(name, dims, kind, start + off, size) for name, dims, kind, off in infos]

    # -- the header, field by field ------------------------------------------------------------
    def _unpack(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from("<" + fmt, self._buf, self._at)
        except struct.error as exc:
            raise ValueError(f"the header ends early at byte {self._at}") from exc
        self._at += struct.calcsize(fmt)
        return v

    def _u32(self) -> int:
        return int(self._unpack("I"))

    def _string(self) -> str:
        n = int(self._unpack("Q"))
        if self._at + n > len(self._buf):
            raise ValueError(f"a string of {n} bytes runs past the end at byte {self._at}")
        s = bytes(self._buf[self._at : self._at + n]).decode("utf-8", "replace")
        self._at += n
        return s

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._u32(), int(self._unpack("Q"))
            if item in _SCALARS:
                dt = np.dtype("<" + _SCALARS[item])
                if self._at + count * dt.itemsize > len(self._buf):
                    raise ValueError(f"an array of {count} runs past the end at byte {self._at}")
                arr = np.frombuffer(self._buf, dt, count, self._at).copy()
                self._at += count * dt.itemsize
                return arr
            return [self._value(item) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind} at byte {self._at}")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._u32()
        if n_dims > 8:
            raise ValueError(f"tensor {name}: {n_dims} dimensions")
        dims = tuple(int(self._unpack("Q")) for _ in range(n_dims))
        return name, dims, self._u32(), int(self._unpack("Q"))

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, offset: int, size: int) -> GgufTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError as exc:
            raise ValueError(f"tensor {name}: unknown ggml type {kind}") from exc
        block, type_size = GGML_QUANT_SIZES[qtype]
        row = dims[0] if dims else 1
        if row % block:
            raise ValueError(f"tensor {name}: rows of {row} are not whole blocks of {block}")
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        row_bytes = row // block * type_size
        n_bytes = rows * row_bytes
        if offset + n_bytes > size:
            raise ValueError(f"truncated ({size} bytes; tensor {name!r} runs past the end)")
        raw = np.frombuffer(self._map, np.uint8, n_bytes, offset)
        data: np.ndarray
        if block == 1:  # float elements: F32, F16, BF16 (as uint16) ...
            dt = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(qtype)
            data = raw.view(dt if dt is not None else np.dtype(f"u{type_size}")).reshape(rows, row)
        else:
            data = raw.reshape(rows, row_bytes)
        if len(dims) <= 1:
            data = data.reshape(-1)
        return GgufTensor(name, qtype, dims, offset, n_bytes, data)
