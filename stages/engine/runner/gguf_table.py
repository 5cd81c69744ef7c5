"""A GGUF file's tensors, found by walking its header without decoding the metadata values.

The engine needs the tensor table only (name, type, shape, where the bytes are), but the table comes
after the key/value metadata, whose length is known only by walking it, and the metadata holds the
tokenizer: ~100k strings for a 49k-token vocabulary. ``gguf.GGUFReader`` decodes each of them into
numpy views, which takes 2-5 s on a small CPU at every engine start; skipping them by their length
prefixes takes milliseconds. The tensors' bytes stay memory-mapped.

Layout (little-endian, versions 2 and 3): magic ``GGUF``, version u32, tensor count u64, metadata
count u64; each metadata entry a string key, a u32 value type and the value (an array: item type
u32, count u64, items); then each tensor's name, u32 dimension count, u64 dimensions (innermost
first), u32 type and u64 offset from the data section, which starts at the next multiple of
``general.alignment`` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Byte sizes of GGUF's fixed-size value types (uint8, int8, uint16, int16, uint32, int32, float32,
#: bool, then uint64, int64, float64); 8 is a string and 9 an array.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: ``data`` is a read-only view of its bytes, shaped as ``gguf``'s reader
    shapes it (outermost dimension first; quantised rows as ``uint8`` blocks)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: Any  # numpy.ndarray


def _string(buf: Any, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    return bytes(buf[off + 8:off + 8 + n]).decode("utf-8"), off + 8 + n


def _skip(buf: Any, off: int, vtype: int) -> int:
    """The offset just past a value of ``vtype`` starting at ``off``."""
    if vtype in _FIXED:
        return off + _FIXED[vtype]
    if vtype == _STRING:
        return off + 8 + struct.unpack_from("<Q", buf, off)[0]
    if vtype == _ARRAY:
        itype, count = struct.unpack_from("<IQ", buf, off)
        off += 12
        if itype in _FIXED:
            return off + count * _FIXED[itype]
        for _ in range(count):
            off = _skip(buf, off, itype)
        return off
    raise ValueError(f"GGUF: unknown value type {vtype} at byte {off}")


def gguf_tensors(path: str | Path) -> dict[str, GGUFTensor]:
    """The tensors of the GGUF file at ``path`` by name, their bytes memory-mapped."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path}: not a GGUF file of version 2 or 3 ({magic!r}, {version})")
    off, alignment = 24, 32
    for _ in range(n_kv):
        key, off = _string(buf, off)
        (vtype,) = struct.unpack_from("<I", buf, off)
        off += 4
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", buf, off)
        off = _skip(buf, off, vtype)
    infos = []
    for _ in range(n_tensors):
        name, off = _string(buf, off)
        (n_dims,) = struct.unpack_from("<I", buf, off)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
        ttype, offset = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
        off += 4 + 8 * n_dims + 12
        infos.append((name, dims, GGMLQuantizationType(ttype), offset))
    start = -(-off // alignment) * alignment
    T = GGMLQuantizationType
    plain = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
             T.I32: np.int32, T.I64: np.int64}
    out: dict[str, GGUFTensor] = {}
    for name, dims, ttype, offset in infos:
        block, size = GGML_QUANT_SIZES[ttype]
        shape = tuple(int(d) for d in reversed(dims))
        n_bytes = int(np.prod(dims, dtype=np.int64)) * size // block
        raw = np.frombuffer(buf, dtype=np.uint8, count=n_bytes, offset=start + offset)
        if ttype in plain:
            data = raw.view(plain[ttype]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] * size // block)
        out[name] = GGUFTensor(name, ttype, shape, data)
    return out
