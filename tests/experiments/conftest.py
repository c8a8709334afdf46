"""The experiments test against the real daemon too: the same threaded syncer as the learner tests."""

from ..learner.conftest import threaded_syncer  # noqa: F401  (a fixture, found by its name)
