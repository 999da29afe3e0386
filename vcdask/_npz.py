"""``.npz`` bytes without the copies: the format of updates and rule-state objects until stop 33.

Objects written since are safetensors files (:mod:`vcdask._safetensors`); an older run's leftover
updates and a store's older state objects are still read through here.

``numpy.savez`` into a ``BytesIO`` copies each array in chunks and again on ``getvalue()``;
``numpy.load`` of such bytes copies each array out of the buffer, and a writable tensor needs a
third copy.  For tens of megabytes per merge that was most of the merge thread's time.  Here an
uncompressed zip of ``.npy`` members is assembled with one join, and read back as arrays that view
one writable buffer.  The bytes are a plain ``.npz`` (``numpy.load`` reads them); anything this
module did not write that way (a compressed or zip64 archive, Fortran order) is read by numpy.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from collections.abc import Mapping

import numpy as np

__all__ = ["dump_parts", "dumps", "loads"]

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, without the name
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry, without the name
_END = struct.Struct("<IHHHHIIH")  # end of central directory
_LIMIT = 2**31 - 1  # beyond this, zip64 (numpy.savez writes it)
_DOS_DATE = (1980 - 1980) << 9 | 1 << 5 | 1  # 1980-01-01: content-addressed, no clock in the bytes


def dumps(arrays: Mapping[str, np.ndarray]) -> bytes:
    """The ``.npz`` bytes of ``arrays`` (uncompressed; each array stored C-contiguous)."""
    return b"".join(dump_parts(arrays))


def dump_parts(arrays: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
    """The ``.npz`` bytes of ``arrays`` as pieces to write one after the other: the arrays' own
    memory, not copies (joining them costs a copy of the whole, in fresh memory)."""
    arrays = {k: v if v.flags.c_contiguous else v.copy(order="C") for k, v in arrays.items()}
    if sum(a.nbytes for a in arrays.values()) > _LIMIT // 2:
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # type: ignore[arg-type]
        return [buf.getvalue()]
    parts: list[bytes | memoryview] = []
    central: list[bytes] = []
    offset = 0
    for key, a in arrays.items():
        name = f"{key}.npy".encode()
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(a))
        header = head.getvalue()
        data = a.reshape(-1).view(np.uint8).data if a.size else memoryview(b"")
        crc = zlib.crc32(data, zlib.crc32(header))
        size = len(header) + len(data)
        # pad the local header's extra field so the data starts 64-byte aligned (the .npy header is
        # a multiple of 64): the arrays read back are aligned views
        pad = -(offset + _LOCAL.size + len(name)) % 64
        pad += 64 if 0 < pad < 4 else 0
        extra = struct.pack("<HH", 0x7664, pad - 4) + bytes(pad - 4) if pad else b""
        local = _LOCAL.pack(0x04034B50, 20, 0, 0, 0, _DOS_DATE, crc, size, size, len(name), len(extra)) + name + extra
        central.append(
            _CENTRAL.pack(0x02014B50, 20, 20, 0, 0, 0, _DOS_DATE, crc, size, size, len(name), 0, 0, 0, 0, 0, offset)
            + name
        )
        parts += [local, header, data]
        offset += len(local) + size
    directory = b"".join(central)
    end = _END.pack(0x06054B50, 0, 0, len(central), len(central), len(directory), offset, 0)
    return [*parts, directory, end]


def loads(data: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """The arrays of ``.npz`` bytes; from writable memory (a ``bytearray``) they are writable views of it (no copy)."""
    buf = memoryview(data)
    out: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(_Reader(buf)) as z:  # the directory only: the members are not read here
        for info in z.infolist():
            key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            array = _member(buf, info)
            if array is None:
                with z.open(info) as f:
                    array = np.lib.format.read_array(f, allow_pickle=False)
            out[key] = array
    return out


class _Reader(io.RawIOBase):
    """A seekable file over a buffer that copies only what is read (``BytesIO`` copies it all)."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else len(self.buf) + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        n = max(0, min(len(b), len(self.buf) - self.pos))
        b[:n] = self.buf[self.pos : self.pos + n]
        self.pos += n
        return n


def _member(buf: memoryview, info: zipfile.ZipInfo) -> np.ndarray | None:
    """The array of one stored member as a view of ``buf``, or None where numpy must read it."""
    if info.compress_type != zipfile.ZIP_STORED or info.file_size >= _LIMIT:
        return None
    start = info.header_offset
    (_sig, *_rest, name_len, extra_len) = _LOCAL.unpack_from(buf, start)
    start += _LOCAL.size + name_len + extra_len
    f = io.BytesIO(buf[start : start + min(info.file_size, 65_536 + 16)])
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        return None
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read_header(f)
    if fortran or dtype.hasobject:
        return None
    count = int(np.prod(shape)) if shape else 1
    return np.frombuffer(buf, dtype=dtype, count=count, offset=start + f.tell()).reshape(shape)
