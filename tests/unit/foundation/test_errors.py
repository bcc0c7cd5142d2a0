"""The exception tree drawn in `peagle/errors.py` is the real one: every class drawn exists where it says,
derives from `PeagleError`, and carries the code the drawing gives it."""

from __future__ import annotations

import importlib
import re

import pytest

import peagle.errors as errors

_LINE = re.compile(r"^\s+[├└]── (\w+)(?: \(\+ValueError\))?\s+(\(per \w+\)|\w+)\s+([\w.]+)")


def _drawn() -> list[tuple[str, str, str]]:
    """(class name, code or '(per ...)', module) for each class below PeagleError in the drawing."""
    lines = (errors.__doc__ or "").splitlines()
    return [m.groups() for m in map(_LINE.match, lines) if m is not None and m.group(1) != "PeagleError"]


def test_the_drawing_lists_every_class() -> None:
    names = [n for n, _c, _m in _drawn()]
    for module in {m for _n, _c, m in _drawn()}:
        importlib.import_module(module)
    stack, found = [errors.PeagleError], set()
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub.__module__.split(".")[0] in ("peagle", "service", "api", "worker"):
                found.add(sub.__name__)
            stack.append(sub)
    assert found <= set(names), f"not drawn in peagle/errors.py: {sorted(found - set(names))}"
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and obj is not errors.PeagleError:
            assert name in names, f"{name} is not drawn in peagle/errors.py"


@pytest.mark.parametrize(("name", "code", "module"), _drawn())
def test_each_drawn_class_is_a_peagle_error_with_its_code(name: str, code: str, module: str) -> None:
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, errors.PeagleError), f"{module}.{name} is not a PeagleError"
    if not code.startswith("("):
        assert cls.code == code


def test_spec_invalid_is_also_a_value_error() -> None:
    from peagle.spec import SpecInvalidError, parse_spec

    assert SpecInvalidError is errors.SpecInvalidError
    with pytest.raises(ValueError, match="num_depths") as info:
        parse_spec({"target": {"model": "x"}, "peagle": {"num_depths": 0}})
    assert isinstance(info.value, errors.PeagleError) and info.value.code == "spec_invalid"
