"""What the spec tests share: a minimal valid spec and the field-path problems of one built on it."""

from __future__ import annotations

from typing import Any

from peagle.spec import SpecInvalidError, parse_spec

BASE: dict[str, Any] = {"target": {"model": "org/model"}}


def problems(**sections: Any) -> dict[str, str]:
    """Field path -> message of every problem of `BASE` with `sections` added (empty: valid)."""
    try:
        parse_spec({**BASE, **sections})
    except SpecInvalidError as exc:
        return {p.path: p.message for p in exc.problems}
    return {}
