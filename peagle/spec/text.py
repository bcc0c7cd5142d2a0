"""Text a job spec may hold: what PostgreSQL (and JSON/UTF-8 everywhere else) can store.

A NUL character cannot be stored in a PostgreSQL `text`/`jsonb` value, and a lone UTF-16 surrogate
(``"\\ud800"``, which JSON allows as an escape) is not encodable as UTF-8. Either in a spec string would
pass validation and then fail much later (an INSERT error instead of the job's real outcome), so the
spec refuses them up front, naming the field (`unstorable_problem`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["unstorable_problem"]


def unstorable_problem(value: Any) -> str | None:
    """Why `value` (a string, or a list/tuple/dict of them, nested) cannot be stored; None if it can."""
    if isinstance(value, str):
        if "\x00" in value:
            return "must not contain a NUL character (\\u0000)"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "must not contain a lone surrogate (\\ud800-\\udfff): not valid UTF-8"
        return None
    if isinstance(value, (list, tuple)):
        return next((p for v in value if (p := unstorable_problem(v)) is not None), None)
    if isinstance(value, dict):
        return next((p for k, v in value.items() if (p := unstorable_problem(k) or unstorable_problem(v))
                     is not None), None)
    return None
