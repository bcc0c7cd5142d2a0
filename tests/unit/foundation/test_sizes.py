"""No module of the project over 600 lines, no function over 110: a longer module is split where it holds
two reasons to exist, a longer function into named steps.

Walks every `.py` file under peagle/, service/, api/ and worker/. A module's size is its line count; a
function's (or method's, or nested function's) is the lines its `def` spans, from the `def` line to its last
line (`end_lineno - lineno + 1`, decorators not counted). There is no allow-list: each test names every
offender, so one run shows all that must be split.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("peagle", "service", "api", "worker")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 110


def _modules() -> list[Path]:
    """Every Python module of the four packages (caches skipped), sorted."""
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def long_modules(paths: list[Path], root: Path = ROOT, limit: int = MAX_MODULE_LINES) -> list[str]:
    """`path: N lines` (relative to `root`) of each module over `limit` lines."""
    out = []
    for path in paths:
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{path.relative_to(root).as_posix()}: {n} lines")
    return out


def long_functions(paths: list[Path], root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:line name: N lines` (relative to `root`) of each function (sync or async, at any depth) over
    `limit` lines."""
    out = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name}: {n} lines")
    return sorted(out)


def test_the_walk_finds_the_packages() -> None:
    paths = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert {"peagle/pipeline.py", "service/db/lease.py", "api/main.py", "worker/tasks.py"} <= paths


def test_the_checks_name_what_is_too_long(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(11))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    async def long(self):\n{body}\n",
                                   encoding="utf-8")
    paths = [tmp_path / "m.py"]
    assert long_functions(paths, tmp_path, limit=11) == ["m.py:6 long: 12 lines"]
    assert long_functions(paths, tmp_path, limit=12) == []
    assert long_modules(paths, tmp_path, limit=16) == ["m.py: 17 lines"]
    assert long_modules(paths, tmp_path, limit=17) == []


def test_no_module_is_over_600_lines() -> None:
    offenders = long_modules(_modules())
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines (split by reason):\n" + "\n".join(offenders)


def test_no_function_is_over_110_lines() -> None:
    offenders = long_functions(_modules())
    assert not offenders, (f"functions over {MAX_FUNCTION_LINES} lines (split into named steps):\n"
                           + "\n".join(offenders))
