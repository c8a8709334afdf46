"""A small file system that fills up and goes read-only, for the durable-file tests.

Where the tests may mount (they run as root), it is a real tmpfs of `DISK_BYTES`: a full disk is a
real ENOSPC from the kernel and read-only is a real remount (chmod does not stop root). Where they
may not, the same faults are injected into net.files (the one module that writes): ENOSPC at the
fsync, EROFS on every open for writing, rename, unlink and mkdir under the directory. Both kinds
run where mounting works (the `disk` fixture is parametrized), so the injection stays honest.
"""

from __future__ import annotations

import builtins
import errno
import os
import subprocess
from pathlib import Path

import pytest

from ddiloco.net import files

DISK_BYTES = 256 << 10


class Disk:
    def __init__(self, path: Path, mounted: bool, monkeypatch: pytest.MonkeyPatch):
        self.path = path
        self.mounted = mounted
        self._faults = None if mounted else _Faults(path, monkeypatch)

    def fill(self) -> None:
        """Take every free byte (a log that grew, another process): the next write gets ENOSPC."""
        if not self.mounted:
            self._faults.code = errno.ENOSPC
            return
        with open(self.path / "filler", "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * (16 << 10))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc

    def free(self) -> None:
        if self.mounted:
            (self.path / "filler").unlink()
        else:
            self._faults.code = None

    def read_only(self) -> None:
        if self.mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True, capture_output=True)
        else:
            self._faults.code = errno.EROFS


def _mount_tmpfs(path: Path) -> bool:
    path.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(path)], capture_output=True, check=False
        )
    except OSError:
        return False
    return done.returncode == 0


@pytest.fixture(params=["tmpfs", "injected"])
def disk(request, tmp_path, monkeypatch):
    path = tmp_path / "disk"
    mounted = request.param == "tmpfs" and _mount_tmpfs(path)
    if not mounted:
        path.mkdir(exist_ok=True)
    yield Disk(path, mounted, monkeypatch)
    if mounted:
        subprocess.run(["umount", "-l", str(path)], check=True, capture_output=True)


class _Faults:
    """Stands in for `os` (and `open`) inside net.files: fails what the current fault forbids."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.root = root
        self.code: int | None = None
        monkeypatch.setattr(files, "os", self)
        monkeypatch.setattr(files, "open", self._open, raising=False)

    def __getattr__(self, name):
        return getattr(os, name)

    def _fail(self, *paths) -> None:
        if self.code == errno.EROFS and any(Path(p).resolve().is_relative_to(self.root.resolve()) for p in paths):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(paths[0]))

    def _open(self, path, mode="r", *args, **kwargs):
        if any(m in mode for m in "wxa+"):
            self._fail(path)
        return builtins.open(path, mode, *args, **kwargs)

    def fsync(self, fd: int) -> None:
        if self.code == errno.ENOSPC:  # where a delayed allocation reports a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.fsync(fd)

    def replace(self, src, dst) -> None:
        self._fail(src, dst)
        os.replace(src, dst)

    def unlink(self, path) -> None:
        self._fail(path)
        os.unlink(path)

    def makedirs(self, path, exist_ok=False) -> None:
        if not Path(path).is_dir():
            self._fail(path)
        os.makedirs(path, exist_ok=exist_ok)
