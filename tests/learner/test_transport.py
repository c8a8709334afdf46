"""Every transport the hook is given satisfies the declared `Transport` protocol, method for method."""

import importlib
import inspect

import pytest

from ddiloco.demo.replay import _Snapshots, _Transport
from ddiloco.experiments.inprocess import InProcessTransport
from ddiloco.learner.transport import SnapshotOutbox, Transport
from ddiloco.net.client import ThreadedClient
from ddiloco.net.peer import SnapshotBox
from ddiloco.net.sharded import ShardedClient

PROTOCOL_METHODS = ["close", "init", "local_state", "progress", "push", "take", "take_markers", "wait_welcome"]


def _parameters(fn) -> list[str]:
    """The parameters a caller must give (those with defaults may be left out)."""
    return [p.name for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty]


def test_the_protocol_declares_what_the_hook_calls():
    declared = sorted(n for n, v in vars(Transport).items() if inspect.isfunction(v) and not n.startswith("_"))
    assert declared == PROTOCOL_METHODS


@pytest.mark.parametrize(
    "cls", [ThreadedClient, ShardedClient, InProcessTransport, _Transport], ids=lambda c: c.__qualname__
)
def test_each_transport_has_every_method_with_the_protocols_parameters(cls):
    for name in PROTOCOL_METHODS:
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__qualname__} has no {name}"
        assert _parameters(impl) == _parameters(getattr(Transport, name)), f"{cls.__qualname__}.{name}"


@pytest.mark.parametrize("cls", [SnapshotBox, _Snapshots], ids=lambda c: c.__qualname__)
def test_each_snapshot_outbox_can_be_asked_and_published_to(cls):
    assert isinstance(cls.wanted, property)
    assert _parameters(cls.publish) == _parameters(SnapshotOutbox.publish)


@pytest.mark.parametrize("module", ["__init__", "recovery", "sync", "tape", "transport", "tree"])
def test_every_learner_module_declares_its_public_names(module):
    mod = importlib.import_module("ddiloco.learner" if module == "__init__" else f"ddiloco.learner.{module}")
    assert mod.__all__ and all(hasattr(mod, name) for name in mod.__all__), module
