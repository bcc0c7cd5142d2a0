"""The engine lifecycle tests wait on what they wait for, not on a fixed guess (issue 39).

Under heavy load one lifecycle test failed with "timed out waiting for the engine" after its 300 s, while
the engine itself would have waited 1800 s for `/health`. Every wait in tests/engine/test_engine_lifecycle.py
takes a named bound (`BOUND_S`: the engine's own startup limit plus a margin; `PROCESS_S` for the guard),
never a number written at the call.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LIFECYCLE = ROOT / "tests" / "engine" / "test_engine_lifecycle.py"


def _waits(tree: ast.AST) -> list[tuple[int, str, ast.expr]]:
    """(line, what, the timeout expression) of every wait: `wait_until(cond, TIMEOUT, ...)`, and the
    `timeout=` / `startup_timeout_s=` keywords of any call."""
    out: list[tuple[int, str, ast.expr]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id == "wait_until" and len(node.args) >= 2:
            out.append((node.lineno, "wait_until", node.args[1]))
        out += [(node.lineno, k.arg, k.value) for k in node.keywords if k.arg in ("timeout", "startup_timeout_s")]
    return out


def test_lifecycle_waits_take_named_bounds_not_literals() -> None:
    waits = _waits(ast.parse(LIFECYCLE.read_text(encoding="utf-8")))
    assert len(waits) >= 5
    literal = [(line, what, ast.unparse(e)) for line, what, e in waits
               if isinstance(e, ast.Constant) and isinstance(e.value, int | float)]
    assert not literal, f"fixed timeouts in {LIFECYCLE.name}: {literal}"


def test_the_engine_bound_is_the_engines_own_startup_limit() -> None:
    text = LIFECYCLE.read_text(encoding="utf-8")
    assert 'ENGINE_READY_S = float(inspect.signature(VllmServer).parameters["startup_timeout_s"].default)' in text
    assert "BOUND_S = ENGINE_READY_S + " in text
