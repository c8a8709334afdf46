"""`ddiloco chaos-sim` through its own parser: the summary, JSON, failures with the command that
reproduces them, the spawn pool giving the same results as one process, and bad arguments."""

import argparse
import json

import pytest

from ddiloco.cli import chaos_sim
from ddiloco.errors import UserError


def _run(*argv):
    parser = argparse.ArgumentParser(prog="ddiloco chaos-sim")
    chaos_sim.add_arguments(parser)
    return chaos_sim.run(parser.parse_args(list(argv)))


def test_passing_seeds_summary_and_json(tmp_path, capsys):
    out = tmp_path / "chaos.json"
    assert _run("--seeds", "0-2", "--json", str(out)) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("seeds 3, passed 3, failed 0;") and "core events" in summary
    doc = json.loads(out.read_text())
    assert doc["seeds"] == 3 and doc["failed"] == 0 and [r["seed"] for r in doc["results"]] == [0, 1, 2]
    assert all(r["passed"] and len(r["trace_hash"]) == 64 for r in doc["results"])


def test_failing_seed_prints_the_command_that_reproduces_it(capsys):
    assert _run("--seeds", "1", "--client-as-is") == 1
    text = capsys.readouterr().out
    assert "FAILED seed 1:" in text
    assert "reproduce: ddiloco chaos-sim --seeds 1 --verbose 1 --client-as-is" in text
    assert "seeds 1, passed 0, failed 1" in text


def test_verbose_prints_the_whole_trace(capsys):
    assert _run("--seeds", "2", "--verbose", "2") == 0
    text = capsys.readouterr().out
    assert "seed 2:" in text and "liveness ok" in text and " core Join(" in text


def test_spawned_jobs_give_the_same_results(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert _run("--seeds", "3-4", "--json", str(one)) == 0
    assert _run("--seeds", "3-4", "--jobs", "2", "--json", str(two)) == 0
    hashes = [[r["trace_hash"] for r in json.loads(p.read_text())["results"]] for p in (one, two)]
    assert hashes[0] == hashes[1]


@pytest.mark.parametrize("text, seeds", [("7", [7]), ("0-3", [0, 1, 2, 3]), ("1,5,3-4,5", [1, 5, 3, 4])])
def test_seed_lists(text, seeds):
    assert chaos_sim.parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "a", "5-2", "-3", "1-", "1.5"])
def test_bad_seed_lists_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        chaos_sim.parse_seeds(text)


def test_verbose_seed_must_be_run():
    with pytest.raises(UserError, match="not among the seeds"):
        _run("--seeds", "0-1", "--verbose", "9")
