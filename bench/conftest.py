"""Lets `pytest bench/ --benchmark-only` find the pytest-benchmark files, named bench_*.py so that
the plain test run (which looks in tests/ only) never picks them up by pattern."""

import pytest


def pytest_collect_file(parent, file_path):
    # a file named on the command line is collected by pytest itself; do not add it twice
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
