"""The core is pure: no module under core/ touches a file (that is net's job: net.files, net.store,
net.recording). Checked on the source, like the layering: no file-system module imported, no
`open()`, no pathlib call that reads or writes."""

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "core"
MODULES_FORBIDDEN = {"os", "shutil", "tempfile", "io", "glob", "mmap", "fcntl"}
PATH_CALLS_FORBIDDEN = {
    "read_bytes",
    "write_bytes",
    "read_text",
    "write_text",
    "unlink",
    "mkdir",
    "rmdir",
    "iterdir",
    "rglob",
    "touch",
    "symlink_to",
    "hardlink_to",
    "chmod",
    "stat",
    "exists",
    "is_dir",
    "is_file",
}


def file_io_in(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] in MODULES_FORBIDDEN]
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "open":
                found.append(f"line {node.lineno}: open()")
            elif isinstance(func, ast.Attribute) and func.attr in PATH_CALLS_FORBIDDEN:
                found.append(f"line {node.lineno}: .{func.attr}()")
    return found


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_no_file_io_in_the_core(path):
    assert not file_io_in(path), f"{path.relative_to(CORE.parent)} does file I/O: {file_io_in(path)}"


def test_the_check_sees_file_io(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom pathlib import Path\nopen('x')\nPath('y').write_bytes(b'')\n")
    assert file_io_in(sample) == ["line 1: imports os", "line 3: open()", "line 4: .write_bytes()"]
