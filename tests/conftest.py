"""Fill numba's on-disk kernel cache once, before any test.

On a fresh clone nothing is compiled yet (about 35 s of compilation on 2 cores), and the first
process to need a kernel would pay it inside whatever the test measures: a syncer's start-up
deadline, a grace window. A child process does it so that this one starts no OpenMP pool.
"""

import subprocess
import sys

import pytest

WARMUP_S_MAX = 600


@pytest.fixture(scope="session", autouse=True)
def _kernels_compiled_on_disk():
    subprocess.run([sys.executable, "-c", "from ddiloco import kernels; kernels.warmup()"], check=True, timeout=WARMUP_S_MAX)

