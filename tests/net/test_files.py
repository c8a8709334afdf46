"""The one atomic write: all or nothing under the final name, every failure named, nothing left behind."""

import errno
import pickle

import pytest

from ddiloco.net import files


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if files.TEMPORARY_MARK in p.name)


def test_writes_the_parts_and_replaces_the_old_file(tmp_path):
    path = tmp_path / "f.bin"
    assert files.write_atomic(path, [b"old"]) == 3
    assert files.write_atomic(path, [b"ne", memoryview(b"w!")]) == 4
    assert path.read_bytes() == b"new!"
    assert leftovers(tmp_path) == []


def test_a_full_disk_is_named_and_the_old_file_survives(disk):
    path = disk.path / "state.bin"
    files.write_atomic(path, [b"good"])
    disk.fill()
    with pytest.raises(files.FileError) as info:
        files.write_atomic(path, [b"x" * (64 << 10)], what="write checkpoint")
    err = info.value
    assert err.errno == errno.ENOSPC and isinstance(err, OSError)
    assert str(err).startswith(f"cannot write checkpoint {path}: disk full (ENOSPC)")
    assert leftovers(disk.path) == []
    disk.free()
    assert path.read_bytes() == b"good"


def test_a_read_only_directory_is_named_and_the_cleanup_never_masks_it(disk):
    path = disk.path / "state.bin"
    files.write_atomic(path, [b"good"])
    disk.read_only()
    with pytest.raises(files.FileError) as info:
        files.write_atomic(path, [b"new"])
    assert info.value.errno == errno.EROFS
    assert f"cannot write {path}: read-only file system (EROFS)" == str(info.value)
    assert path.read_bytes() == b"good"
    with pytest.raises(files.FileError, match="read-only file system"):
        files.remove(path)
    with pytest.raises(files.FileError, match="read-only file system"):
        files.make_directory(disk.path / "sub")


def test_a_failed_cleanup_is_added_to_the_first_error_not_raised_instead(tmp_path, monkeypatch):
    # The rename fails, and so does the removal of the temporary file: the rename's error is raised.
    def no_rename(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    def no_unlink(path):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(files.os, "replace", no_rename)
    monkeypatch.setattr(files.os, "unlink", no_unlink)
    with pytest.raises(files.FileError) as info:
        files.write_atomic(tmp_path / "f", [b"data"])
    monkeypatch.undo()
    text = str(info.value)
    assert info.value.errno == errno.EIO
    assert "input/output error" in text and "could not be removed either (read-only file system (EROFS))" in text
    assert leftovers(tmp_path) == [files.temporary_name(tmp_path / "f").name]


def test_the_error_crosses_processes_intact(tmp_path):
    err = files.FileError("write", tmp_path / "f", OSError(errno.ENOSPC, "No space left on device"), "a note")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.errno == errno.ENOSPC
