"""Dependencies point one way, by an explicit table: which ddiloco packages each package may import, and
which third-party (or standard) modules a layer may not use at all.

    errors <- kernels <- core <- sim, net <- chaos, learner   reference (on core) <- demo, experiments
    cli and bench on top, free to import anything

The packages are the ones pyproject.toml maps to folders (`[tool.setuptools.package-dir]`): one missing
from the table fails, so a new package has to say where it sits. A package whose folder does not exist
in this tree is not checked (nothing to check), but every one that exists is, and every top-level
folder that is a Python package must be in pyproject. Checked on the source: every `import` and
`from ... import`, inside functions too, relative ones resolved.
"""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ANYTHING = None  # cli and bench sit on top

_BELOW_DEMO = {"errors", "kernels", "core", "sim", "net", "chaos", "learner", "reference"}
# package -> the ddiloco packages it may import (itself always allowed)
ALLOWED: dict[str, set[str] | None] = {
    "errors": set(),
    "kernels": {"errors"},
    "core": {"errors", "kernels"},
    "sim": {"errors", "kernels", "core"},
    "net": {"errors", "kernels", "core"},
    "chaos": {"errors", "kernels", "core", "net"},
    "learner": {"errors", "kernels", "core", "net"},
    "reference": {"errors", "kernels", "core"},
    "demo": _BELOW_DEMO,
    "experiments": _BELOW_DEMO | {"demo"},
    "launch": {"errors", "kernels", "core", "net"},  # starts the commands, never imports the learner side
    "cli": ANYTHING,
    "bench": ANYTHING,
}

# The pure, deterministic layers: no I/O loop, no clock, no randomness that is not injected, no threads.
_PURE = {"jax", "optax", "aiohttp", "asyncio", "uvloop", "socket", "time", "random", "torch", "threading"}
# modules a layer may not use at all (the top-level name)
FORBIDDEN: dict[str, set[str]] = {
    "errors": _PURE | {"numpy", "numba", "orjson"},  # the bottom depends on nothing
    "kernels": {"jax", "optax", "aiohttp", "asyncio", "uvloop", "torch"},
    "core": _PURE,
    "sim": _PURE,
    "chaos": _PURE,  # deterministic: it runs the real core on a virtual clock from a seed
    "net": {"jax", "optax", "torch"},
    "learner": {"torch"},  # the learner library is JAX's
    "launch": {"jax", "optax", "torch"},  # runs on the head node too, which need not have the learner extra
}


def package_dirs() -> dict[str, str]:
    """Short package name (`core`) -> its folder, as pyproject.toml maps them."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert all(name.startswith("ddiloco.") and name.count(".") == 1 for name in mapping), mapping
    return {name.removeprefix("ddiloco."): folder for name, folder in mapping.items()}


def present() -> list[str]:
    return [name for name, folder in package_dirs().items() if (ROOT / folder).is_dir()]


def module_name(package: str, path: Path) -> str:
    """`ddiloco.core.sim.engine` for core/sim/engine.py (an __init__.py names its package)."""
    parts = list(path.relative_to(ROOT / package_dirs()[package]).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["ddiloco", package, *parts])


def imports_of(path: Path, module: str) -> set[str]:
    """The absolute names a source file imports (relative imports resolved against `module`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # `from . import x` in a package's __init__ means the package itself; in a module, its parent
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module
            if base_name == "ddiloco":  # from ddiloco import kernels
                names |= {f"ddiloco.{a.name}" for a in node.names}
            else:
                names.add(base_name)
    return names


def test_every_package_in_pyproject_has_a_row():
    missing = sorted(set(package_dirs()) - set(ALLOWED))
    assert not missing, f"packages in pyproject.toml without a row in ALLOWED: {missing}"


def test_every_python_folder_is_a_package_in_pyproject():
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    unmapped = sorted(folders - set(package_dirs().values()))
    assert not unmapped, f"top-level packages that pyproject.toml does not map: {unmapped}"


def test_the_table_is_a_layering():
    """No cycle in ALLOWED: otherwise `below` means nothing."""

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        nexts = ALLOWED[start] or set()
        return goal in nexts or any(reaches(n, goal, seen | {start}) for n in nexts - seen if n in ALLOWED)

    assert not [p for p, allowed in ALLOWED.items() if allowed is not None and reaches(p, p)]
    assert all(allowed is None or allowed <= set(ALLOWED) for allowed in ALLOWED.values())


@pytest.mark.parametrize("package", present())
def test_no_upward_or_forbidden_imports(package):
    allowed = ALLOWED[package]
    folder = ROOT / package_dirs()[package]
    files = sorted(folder.rglob("*.py"))
    assert files, f"no sources found for {package}"
    problems = []
    for path in files:
        for name in imports_of(path, module_name(package, path)):
            parts = name.split(".")
            if parts[0] == "ddiloco":
                target = parts[1] if len(parts) > 1 else "ddiloco"
                if allowed is not None and target != package and target not in allowed:
                    problems.append(f"{path.relative_to(ROOT)} imports {name}")
            elif parts[0] in FORBIDDEN.get(package, set()):
                problems.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not problems, "\n".join(problems)


def test_the_checker_sees_what_it_must(tmp_path):
    """The checker itself: relative imports resolve, imports inside functions count."""
    source = tmp_path / "engine.py"
    source.write_text(
        "from ... import net\nfrom ..layout import x\n\ndef f():\n    import jax\n    from . import calibration\n"
    )
    names = imports_of(source, "ddiloco.core.sim.engine")
    assert names == {"ddiloco.net", "ddiloco.core.layout", "jax", "ddiloco.core.sim"}
    init = tmp_path / "__init__.py"
    init.write_text("from . import engine\nfrom .. import layout\n")
    assert imports_of(init, "ddiloco.core.sim") == {"ddiloco.core.sim", "ddiloco.core"}
