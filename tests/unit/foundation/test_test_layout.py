"""The test tree has no `__init__.py` files, so pytest imports every test module by its basename: two test
files with one name in different folders stop the whole collection ("import file mismatch"), which only a
full run shows. This check finds it in a second."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def test_every_test_module_has_a_name_of_its_own() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], "rename one of each: pytest collects them as one module"
