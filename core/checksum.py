"""CRC-32 (the zlib polynomial) of bytes, as fast as this machine computes it.

Every frame on the wire and every tape record carries one. zlib's crc32 runs at about 1.4 GB/s
here; ISA-L's (the `isal` package, a dependency on the platforms it ships wheels for) at about
9 GB/s, with the same values, so it is used when installed. A 26 MB fp32 broadcast costs the
syncer one checksum and every learner another: 18 ms each with zlib, 3 ms with ISA-L.
"""

from __future__ import annotations

import zlib

try:
    from isal.isal_zlib import crc32 as _crc32

    IMPLEMENTATION = "isal"
except ImportError:  # a platform without isal wheels: same values, slower
    _crc32 = zlib.crc32
    IMPLEMENTATION = "zlib"


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """zlib.crc32(data, value): `value` continues the checksum of the bytes before `data`."""
    return _crc32(data, value)
