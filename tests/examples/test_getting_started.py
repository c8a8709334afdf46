"""docs/getting-started.md shows what is tested: its code is the examples' code, its commands parse,
its TOML file is a valid syncer configuration."""

import argparse
import re
import shlex
from pathlib import Path

import pytest

from ddiloco.cli import build_parser, syncer
from ddiloco.cli.settings import resolve

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "getting-started.md").read_text()
EXAMPLES = {p.name: p.read_text() for p in (ROOT / "examples").glob("*.py")}


def _blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", PAGE, flags=re.S)


def test_every_python_block_is_lines_of_one_tested_example():
    blocks = _blocks("python")
    assert len(blocks) == 2
    for block in blocks:
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        holders = [
            name
            for name, text in EXAMPLES.items()
            if all(line in {t.strip() for t in text.splitlines()} for line in lines)
        ]
        assert holders, f"not in any example:\n{block}"


def _commands():
    for block in _blocks("bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words and words[-1] == "&":
                words = words[:-1]
            if words:
                yield words


def test_every_ddiloco_command_parses_and_every_example_command_names_an_example_and_its_flags():
    seen = set()
    for words in _commands():
        if words[0] == "ddiloco":
            build_parser().parse_args(words[1:])  # SystemExit on anything argparse refuses
            seen.add(words[1])
        elif words[0] == "python" and words[1].startswith("examples/"):
            text = EXAMPLES[Path(words[1]).name]
            for flag in (w for w in words[2:] if w.startswith("--")):
                assert f'"{flag}"' in text, (words[1], flag)
            seen.add("example")
    assert {"demo", "syncer", "export", "example"} <= seen


def test_the_toml_file_is_the_syncer_started_by_flags_before_it(tmp_path):
    (block,) = _blocks("toml")
    by_file = resolve(syncer.SETTINGS, argparse.Namespace(), {}, block, tmp_path / "syncer.toml")
    flags = next(w for w in _commands() if w[:2] == ["ddiloco", "syncer"])
    parser = argparse.ArgumentParser()
    syncer.add_arguments(parser)
    by_flags = resolve(syncer.SETTINGS, parser.parse_args(flags[2:]), {})
    for key in by_file.sources:
        want = by_flags.values[key]
        assert by_file.values[key] == (tmp_path / want if isinstance(want, Path) else pytest.approx(want)), key
    assert set(by_file.sources) == set(by_flags.sources)
