import zlib

import numpy as np
import pytest

from ddiloco.core import checksum


@pytest.mark.parametrize("size", [0, 1, 7, 64, 4095, 1 << 20])
def test_crc32_equals_zlib_whole_and_chained(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert checksum.crc32(data) == zlib.crc32(data)
    cut = size // 3
    assert checksum.crc32(data[cut:], checksum.crc32(data[:cut])) == zlib.crc32(data)


def test_crc32_takes_memoryviews_of_arrays():
    values = np.arange(1000, dtype=np.float32)
    view = memoryview(values).cast("B")[12:]
    assert checksum.crc32(view) == zlib.crc32(bytes(view))


def test_implementation_is_named():
    assert checksum.IMPLEMENTATION in ("isal", "zlib")
