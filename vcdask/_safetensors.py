"""The safetensors format for updates and rule-state objects, written and read without copies.

A `safetensors <https://huggingface.co/docs/safetensors>`_ file is an 8-byte little-endian header
length, a JSON header (each tensor's dtype, shape and byte range; string ``__metadata__``) and the
tensors' bytes, back to back.  PyTorch users read it with ``safetensors.torch.load_file``.  Unlike
the ``.npz`` that updates were before stop 33 (``vcdask._npz``, still read), it has no checksum: a
zip member's CRC-32 cost 6-10 ms per 20 MB on every write, and no reader of ours checked it (an
object is written whole or not at all; a torn one is caught by its lengths: :class:`TensorFile`).

Written here as pieces to write one after the other (the tensors' own memory, never joined), the
header padded with spaces so the data starts 64-byte aligned, tensors ordered by item size (each
one starts aligned to its own) and, within a dtype, in the order given: the tensors of one dtype
that a caller passes in a flat array's order lie back to back, and read back as a view of that
array (:meth:`TensorFile.flat`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorFile", "dump_parts", "is_safetensors", "read"]

#: safetensors dtype names of the torch dtypes we store
_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_ALIGN = 64
#: the safetensors library refuses larger headers
_MAX_HEADER = 100_000_000


def dump_parts(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> list[Any]:
    """The bytes of a safetensors file holding ``tensors`` (CPU) and ``metadata``, as pieces.

    The pieces are the header and each tensor's own memory (a non-contiguous tensor is copied
    first): write them one after the other, or join them.
    """
    if "__metadata__" in tensors:
        raise ValueError("a tensor may not be named '__metadata__' (the name of the file's metadata)")
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), _code(tensors[k].dtype, k)))  # stable
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    data: list[Any] = []
    offset = 0
    for name in order:
        t = tensors[name].detach()
        if t.device.type != "cpu":
            raise ValueError(f"tensor {name!r} is on {t.device}: expected a CPU tensor")
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        code = _code(t.dtype, name)
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        if nbytes:
            data.append(t.reshape(-1).view(torch.uint8).numpy().data)
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    return [struct.pack("<Q", len(text)) + text, *data]


def _code(dtype: torch.dtype, name: str) -> str:
    try:
        return _CODES[dtype]
    except KeyError:
        raise TypeError(f"tensor {name!r}: cannot store dtype {dtype}; supported: {sorted(map(str, _CODES))}") from None


def is_safetensors(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` is meant as a safetensors file: anything but a zip (the ``.npz`` objects of
    earlier releases).  A torn or broken one is then refused by :func:`read` with the reason."""
    return bytes(memoryview(data)[:4]) != b"PK\x03\x04"


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its dtype, shape and byte range in the data."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class TensorFile:
    """A parsed safetensors file over ``buffer``: its metadata and tensors as views of the buffer.

    From writable memory (a ``bytearray``, or what ``SideFiles.get_buffer`` reads) the tensors are writable
    views of it (which keep it alive and stop it from being resized); from ``bytes`` (e.g. to read the
    metadata only), copies.

    Raises
    ------
    ValueError
        If the bytes are not a whole safetensors file (the reason says why).
    """

    def __init__(self, buffer: bytes | bytearray | memoryview):
        self.buffer = memoryview(buffer)  # an export: a bytearray cannot be resized under the views
        try:
            self._parse()
        except (TypeError, KeyError, AttributeError, struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"not a safetensors file: {type(e).__name__}: {e}") from None

    def _parse(self) -> None:
        buf = self.buffer
        if len(buf) < 8:
            raise ValueError(f"not a safetensors file: {len(buf)} bytes, shorter than its header length")
        (n,) = struct.unpack_from("<Q", buf, 0)
        if n > min(_MAX_HEADER, len(buf) - 8):
            raise ValueError(f"not a safetensors file: a header of {n} bytes in {len(buf)} (torn, or not one)")
        header = json.loads(bytes(buf[8 : 8 + n]))
        if not isinstance(header, dict):
            raise ValueError("not a safetensors file: its header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in dict(metadata).items()}
        self.start = 8 + n
        size = len(buf) - self.start
        self.entries: dict[str, Entry] = {}
        for name, info in header.items():
            code = info["dtype"]
            if code not in _DTYPES:
                raise ValueError(f"tensor {name!r}: dtype {code!r} is not one of {sorted(_DTYPES)}")
            begin, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(x) for x in info["shape"])
            e = Entry(_DTYPES[code], shape, begin, end)
            if min(shape, default=0) < 0 or end - begin != _numel(shape) * _itemsize(e.dtype):
                raise ValueError(f"tensor {name!r}: bytes {begin}:{end} do not hold its shape {list(shape)}")
            self.entries[name] = e
        at = 0  # the tensors cover the data exactly, with no gaps or overlaps (as the format requires)
        for name, e in sorted(self.entries.items(), key=lambda item: (item[1].begin, item[1].end)):
            if e.begin != at:
                raise ValueError(f"tensor {name!r} starts at byte {e.begin} of the data, expected {at}")
            at = e.end
        if at != size:
            raise ValueError(f"the tensors end at byte {at} of the data, which holds {size} (torn, or not one)")

    def meta_json(self, key: str, default: Any = None) -> Any:
        """A metadata value holding JSON, decoded."""
        value = self.metadata.get(key)
        return default if value is None else json.loads(value)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name``: a view of the buffer."""
        e = self.entries[name]
        return self._view(e.dtype, e.begin, _numel(e.shape)).view(e.shape)

    def flat(self, names: Sequence[str], dtype: torch.dtype) -> torch.Tensor:
        """The tensors ``names`` (all of ``dtype``) as one flat tensor, in that order: a view of the
        buffer where they lie back to back (as :func:`dump_parts` writes them), else a copy."""
        entries = [self.entries[n] for n in names]
        if any(e.dtype != dtype for e in entries):
            bad = next(n for n, e in zip(names, entries, strict=True) if e.dtype != dtype)
            raise ValueError(f"tensor {bad!r} is {self.entries[bad].dtype}, expected {dtype}")
        if not entries:
            return torch.empty(0, dtype=dtype)
        if all(a.end == b.begin for a, b in zip(entries, entries[1:], strict=False)):
            return self._view(dtype, entries[0].begin, (entries[-1].end - entries[0].begin) // _itemsize(dtype))
        return torch.cat([self.tensor(n).reshape(-1) for n in names])

    def _view(self, dtype: torch.dtype, begin: int, count: int) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, dtype=dtype)
        offset = self.start + begin
        if self.buffer.readonly:  # torch warns about tensors over read-only memory
            return torch.frombuffer(bytearray(self.buffer[offset:][: count * _itemsize(dtype)]), dtype=dtype)
        return torch.frombuffer(self.buffer, dtype=dtype, count=count, offset=offset)


def read(buffer: bytes | bytearray | memoryview) -> TensorFile:
    """Parse the safetensors file in ``buffer`` (see :class:`TensorFile`)."""
    return TensorFile(buffer)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
