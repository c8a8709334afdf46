"""Dependencies point one way: kernels <- core <- net <- learner (cli and bench on top).

Checked on the source: every `import` / `from ... import` in a package may name only the packages
below it (and third-party modules allowed for that layer). Imports inside functions count too.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["kernels", "core", "net", "learner"]
# third-party modules a layer may not use at all
FORBIDDEN = {
    "kernels": {"jax", "optax", "aiohttp", "asyncio", "uvloop", "torch"},
    "core": {"jax", "optax", "aiohttp", "asyncio", "uvloop", "socket", "time", "random", "torch", "threading"},
    "net": {"jax", "optax", "torch"},
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "ddiloco":  # from ddiloco import kernels
                names |= {f"ddiloco.{a.name}" for a in node.names}
            else:
                names.add(node.module)
    return names


@pytest.mark.parametrize("package", ORDER)
def test_no_upward_or_forbidden_imports(package):
    allowed = {f"ddiloco.{p}" for p in ORDER[: ORDER.index(package) + 1]}
    problems = []
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources found for {package}"
    for path in files:
        for name in imports_of(path):
            top = name.split(".")[0]
            if top == "ddiloco":
                parts = name.split(".")
                target = ".".join(parts[:2]) if len(parts) > 1 else name
                if target not in allowed:
                    problems.append(f"{path.relative_to(ROOT)} imports {name}")
            elif top in FORBIDDEN.get(package, set()):
                problems.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not problems, "\n".join(problems)
