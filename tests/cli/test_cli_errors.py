"""How `ddiloco` shows an error: a UserError in one line (exit 2), a FaultError in one line with what
to do (exit 1), anything else, a plain ValueError included, with its traceback (a bug)."""

import socket
import subprocess
import sys

import pytest

from ddiloco.cli import main
from ddiloco.cli import status as status_cli
from ddiloco.errors import DdilocoError, FaultError, UserError


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on: bound once to pick it, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_user_error_is_one_line_and_exit_status_2(capsys):
    assert main(["status", "ftp://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err == "ddiloco status: error: URL must start with http:// or https://, got 'ftp://127.0.0.1:1'\n"


def test_a_fault_is_one_line_with_what_to_do_and_exit_status_1(capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["status", url, "--timeout-s", "10"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"ddiloco status: fault: cannot reach {url}: ")
    assert err.rstrip().endswith("; check that the syncer runs and listens at that address")


def test_a_fault_without_its_own_advice_gets_the_general_one(capsys, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert main(["chaos-sim", "--seeds", "0", "--json", str(not_a_dir / "out.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ddiloco chaos-sim: fault: cannot write {not_a_dir / 'out.json'}: ")
    assert "give --json a writable path" in err


def test_a_plain_value_error_is_a_bug_and_keeps_its_traceback(monkeypatch):
    # Fault injection: a subcommand with a bug that raises ValueError. It must reach the caller
    # (Python prints its traceback), not be turned into one line that hides where it came from.
    def buggy_run(args):
        raise ValueError("an index that cannot happen")

    monkeypatch.setattr(status_cli, "run", buggy_run)
    with pytest.raises(ValueError, match="an index that cannot happen") as info:
        main(["status", "http://127.0.0.1:1"])
    assert not isinstance(info.value, DdilocoError)


@pytest.mark.parametrize("raised, status", [(UserError("u"), 2), (FaultError("f"), 1), (RuntimeError("r"), None)])
def test_the_branch_decides_the_exit_status(monkeypatch, capsys, raised, status):
    def run(args):
        raise raised

    monkeypatch.setattr(status_cli, "run", run)
    if status is None:
        with pytest.raises(RuntimeError):
            main(["status", "http://127.0.0.1:1"])
    else:
        assert main(["status", "http://127.0.0.1:1"]) == status
        assert capsys.readouterr().err.count("\n") == 1


def test_a_library_configuration_error_from_a_flag_is_a_user_error(capsys):
    # the URL reaches net.client's ClientConfig deep inside the learner; its check is the user's error
    assert main(["learner", "--syncer", "http://127.0.0.1:1/ws", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "ddiloco learner: error: syncer URL must start with ws:// or wss://" in err and "Traceback" not in err


def test_a_reader_that_stops_early_is_not_an_error():
    # `ddiloco simulate ... | head -1`: the pipe closes after the first line of a long table
    command = [sys.executable, "-m", "ddiloco.cli", "simulate", "--table", "paper", "--seeds", "1", "--days", "1"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = child.stdout.readline()
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(120) == 0, err
    assert first.startswith(b"config:") and "Traceback" not in err and "BrokenPipe" not in err
