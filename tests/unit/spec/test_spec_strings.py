"""Spec strings PostgreSQL cannot store (NUL, lone surrogates) are refused at validation, naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from peagle.spec import SpecInvalidError, parse_spec


def _spec(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"target": {"model": "builtin:tiny-llama"}}
    spec.update(over)
    return spec


CASES = [
    (_spec(name="a\x00b"), "name"),
    (_spec(target={"model": "builtin:tiny-llama\x00"}), "target.model"),
    (_spec(target={"model": "builtin:tiny-llama", "revision": "main\x00"}), "target.revision"),
    (_spec(data={"sources": [{"path": "builtin:sharegpt"}, {"path": "x\x00.jsonl"}]}), "data.sources.1.path"),
    (_spec(eval={"prompt_sets": [{"name": "humaneval\x00"}]}), "eval.prompt_sets.0.name"),
    (_spec(name="bad \ud800 surrogate"), "name"),
    (_spec(target={"model": "org/\udfffname"}), "target.model"),
]


@pytest.mark.parametrize(("data", "where"), CASES)
def test_unstorable_characters_are_refused_naming_the_field(data: dict[str, Any], where: str) -> None:
    with pytest.raises(SpecInvalidError) as info:
        parse_spec(data)
    paths = [p.path for p in info.value.problems]
    assert where in paths, paths
    msg = next(p.message for p in info.value.problems if p.path == where)
    assert "NUL" in msg or "surrogate" in msg, msg


def test_ordinary_unicode_is_accepted() -> None:
    spec = parse_spec(_spec(name="démo 草稿 🚀\ttab", tags=["a:b"]))
    assert spec.name == "démo 草稿 🚀\ttab"
