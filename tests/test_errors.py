"""Every exception class ddiloco defines sits under exactly one branch of ddiloco.errors, so the command
line can tell a user's mistake from a fault from a bug."""

import importlib
import inspect
import pkgutil
import tomllib
from pathlib import Path

from ddiloco.errors import DdilocoError, FaultError, UserError

ROOT = Path(__file__).resolve().parents[1]


def _packages() -> list[str]:
    """The import names pyproject maps to a folder, where the folder exists in this tree."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return [name for name, folder in mapping.items() if (ROOT / folder).is_dir()]


def _exception_classes() -> dict[str, type]:
    """Class name -> class, for every exception class defined in a ddiloco module."""
    found = {}
    for name in _packages():
        package = importlib.import_module(name)
        names = [m.name for m in pkgutil.walk_packages(package.__path__, f"{name}.")]
        # a __main__ module runs the program when imported
        for module in [package] + [importlib.import_module(n) for n in names if not n.endswith(".__main__")]:
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                    assert cls.__qualname__ not in found, f"two exception classes named {cls.__qualname__}"
                    found[cls.__qualname__] = cls
    return found


def test_every_exception_class_has_exactly_one_branch():
    classes = _exception_classes()
    assert len(classes) >= 20, sorted(classes)  # the walk found the project's classes
    # A private class (a leading underscore) is a control-flow signal caught in its own module, not an
    # error; should one escape, it is a bug and shows with its traceback.
    wrong = [
        name
        for name, cls in classes.items()
        if not name.startswith("_")
        and cls not in (DdilocoError, UserError, FaultError)
        and issubclass(cls, UserError) == issubclass(cls, FaultError)
    ]
    assert not wrong, f"not under exactly one of UserError, FaultError: {wrong}"


def test_classes_callers_catch_as_builtins_keep_them():
    classes = _exception_classes()
    for name in ("CodecError", "ConfigError", "WireError", "KernelInputError", "DataError", "TapeError"):
        assert issubclass(classes[name], ValueError), name
    for name in ("StoreError", "PeerError", "SyncerRefused", "MissingExtraError"):
        assert issubclass(classes[name], RuntimeError), name


def test_a_fault_says_what_to_do():
    assert FaultError("x").what_to_do  # the general advice
    assert FaultError("x", what_to_do="restart it").what_to_do == "restart it"
    assert str(FaultError("disk full", what_to_do="free space")) == "disk full"
