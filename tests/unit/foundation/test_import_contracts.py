"""Dependency direction: checked by import-linter (`make test`) and here, in fresh interpreters."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_api_main_does_not_import_torch() -> None:
    if not (ROOT / "api" / "main.py").exists():
        pytest.fail("api/main.py is missing")
    loaded = _fresh(
        "import sys, api.main; "
        "print(sorted(m for m in ('torch','transformers','worker','peagle.model.draft','peagle.train') if m in sys.modules))"
    )
    assert loaded == "[]"


def test_importing_spec_and_settings_is_light() -> None:
    loaded = _fresh("import sys, peagle.spec, service.settings; print('torch' in sys.modules, 'fastapi' in sys.modules)")
    assert loaded == "False False"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_peagle_never_imports_the_service() -> None:
    forbidden = ("api", "worker", "fastapi", "celery", "sqlalchemy", "alembic", "starlette")
    for path in (ROOT / "peagle").rglob("*.py"):
        for name in _imports(path):
            assert name.split(".")[0] not in forbidden, f"{path.relative_to(ROOT)} imports {name}"


def test_api_imports_only_the_spec_from_peagle() -> None:
    # peagle.engine: only its stdlib-only process owner's sandbox (every parser of tenant bytes runs as its child);
    # peagle.run_folder: the run folder's layout (stdlib only)
    allowed = {"peagle", "peagle.spec", "peagle.errors", "peagle.fileio", "peagle.run_folder", "peagle.engine",
               "peagle.engine.sandbox"}
    for path in (ROOT / "api").rglob("*.py"):
        for name in _imports(path):
            root = name.split(".")[0]
            assert root not in ("torch", "transformers", "worker"), f"{path.relative_to(ROOT)} imports {name}"
            if root == "peagle":
                ok = name in allowed or name.startswith("peagle.spec.")  # the spec package is torch-free
                assert ok, f"{path.relative_to(ROOT)} imports {name} (only peagle.spec[.*], peagle.errors, peagle.fileio, peagle.run_folder and peagle.engine.sandbox allowed)"


def test_the_sandbox_the_api_imports_is_stdlib_only() -> None:
    loaded = _fresh("import sys, peagle.engine.sandbox; print(sorted(m for m in sys.modules if m.split('.')[0] in "
                    "('torch', 'transformers', 'numpy', 'fastapi', 'sqlalchemy', 'celery')))")
    assert loaded == "[]", loaded


def test_the_run_folder_imports_only_the_standard_library() -> None:
    """The API, the service layer and the worker's dispatcher read the run folder's layout: nothing but the
    standard library (and `peagle` itself, which loads nothing eagerly) comes with it."""
    loaded = _fresh("import sys; before = set(sys.modules); import peagle.run_folder; "
                    "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] not in "
                    "sys.stdlib_module_names and m not in ('peagle', 'peagle.run_folder')))")
    assert loaded == "[]", loaded


def test_import_linter_contracts_pass() -> None:
    exe = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(exe)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_spec_module_is_torch_free() -> None:
    """The API may import any `peagle.spec.*` module, so none of them may load torch."""
    mods = sorted(f"peagle.spec.{p.stem}" for p in (ROOT / "peagle" / "spec").glob("*.py") if p.stem != "__init__")
    code = f"import importlib, sys; [importlib.import_module(m) for m in {mods!r}]; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False", mods
