"""`ddiloco simulate` end to end through its own parser (the subcommand module's contract)."""

import argparse
import json

import pytest

from ddiloco.cli import simulate
from ddiloco.errors import UserError


def _run(*argv):
    parser = argparse.ArgumentParser(prog="ddiloco simulate")
    simulate.add_arguments(parser)
    return simulate.run(parser.parse_args(list(argv)))


def test_single_cell_json(tmp_path, capsys):
    out = tmp_path / "cell.json"
    assert (
        _run(
            "--chips",
            "3e5",
            "--system",
            "decoupled",
            "--learners",
            "4",
            "--days",
            "1",
            "--seeds",
            "2",
            "--json",
            str(out),
        )
        == 0
    )
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("config: system=decoupled M=4 chips=300000")
    [cell] = json.loads(out.read_text())
    assert {"system", "learners", "chips", "goodput", "uptime", "paper"} <= set(cell)
    assert cell["system"] == "decoupled" and cell["learners"] == 4 and cell["chips"] == 3e5
    assert 0 < cell["goodput"] < 1 and 0 < cell["uptime"] <= 1
    assert cell["paper"] == 0.93


def test_paper_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "table.json", tmp_path / "table.png"
    assert _run("--table", "paper", "--days", "0.25", "--seeds", "1", "--json", str(out), "--plot", str(png)) == 0
    text = capsys.readouterr().out
    assert "ours paper diff" in text and "cells within 3 points" in text
    cells = json.loads(out.read_text())
    assert len(cells) == 30
    assert {(c["system"], c["learners"]) for c in cells} == {
        ("dp", 1),
        ("elastic-dp", 1),
        ("decoupled", 2),
        ("decoupled", 4),
        ("decoupled", 8),
        ("decoupled", 16),
    }
    assert all(0 <= c["goodput"] <= 1 and 0 <= c["paper"] <= 1 for c in cells)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paper_value_is_null_outside_the_papers_setting(tmp_path):
    out = tmp_path / "cell.json"
    assert _run("--chips", "1.2e6", "--mtbi-chip-years", "2", "--days", "0.5", "--seeds", "1", "--json", str(out)) == 0
    assert json.loads(out.read_text())[0]["paper"] is None


@pytest.mark.parametrize("scenario", ["mixed", "scavenge"])
def test_scenarios_write_json(tmp_path, scenario):
    out = tmp_path / f"{scenario}.json"
    assert _run("--scenario", scenario, "--json", str(out)) == 0
    records = json.loads(out.read_text())
    assert records and all(isinstance(r, dict) for r in records)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--learners", "4", "--quorum", "5"], "quorum K=5 exceeds"),
        (["--chips", "-3"], "chips"),
        (["--repair-mean-s", "0"], "mean_s"),
        (["--days", "0"], "days"),
    ],
)
def test_bad_input_is_a_user_error_naming_it(argv, words):
    with pytest.raises(UserError, match=words):
        _run(*argv, "--seeds", "1")
