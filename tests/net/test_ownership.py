"""One syncer per checkpoint directory: the lock, with real files and a real second holder."""

import threading
import time

import pytest

from ddiloco.net.ownership import LOCK_NAME, DirectoryHeld, DirectoryLock


def test_a_held_directory_is_refused_naming_its_holder_and_free_again_once_released(tmp_path):
    first = DirectoryLock.acquire(tmp_path / "ck")  # created when missing
    assert (tmp_path / "ck" / LOCK_NAME).exists() and first.held
    with pytest.raises(DirectoryHeld, match=r"another syncer \(pid \d+ on .+\) holds .*--standby"):
        DirectoryLock.acquire(tmp_path / "ck")
    first.release()
    first.release()  # idempotent
    assert not first.held
    with DirectoryLock.acquire(tmp_path / "ck") as again:
        assert again.held
    assert not again.held


def test_a_waiting_acquire_returns_as_soon_as_the_holder_lets_go(tmp_path):
    holder = DirectoryLock.acquire(tmp_path)
    got: list[DirectoryLock] = []
    waiter = threading.Thread(target=lambda: got.append(DirectoryLock.acquire(tmp_path, wait=True)))
    waiter.start()
    time.sleep(0.2)
    assert not got, "the waiting acquire returned while the lock was held"
    holder.release()
    waiter.join(10)
    assert not waiter.is_alive() and got[0].held
    got[0].release()
