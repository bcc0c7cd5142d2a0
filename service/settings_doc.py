"""Render the operator settings table (Markdown) from `service.settings.Settings`, the single source.

`python -m service.settings_doc` prints it; docs/settings.md holds it between `<!-- settings:start -->`
and `<!-- settings:end -->` (a test keeps them identical; `python -m service.settings_doc --write
docs/settings.md` refreshes it).
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic.fields import FieldInfo

from peagle.spec.doc import generated_doc_main, replace_marked
from service.settings import Settings

__all__ = ["END", "START", "render", "replace_in"]

START = "<!-- settings:start -->"
END = "<!-- settings:end -->"


def _type_name(ann: object) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return " \\| ".join(f'`"{a}"`' for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, __import__("types").UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if ann is type(None):
        return "null"
    return "path" if ann is Path else getattr(ann, "__name__", str(ann))


def _default(field: FieldInfo) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return "(empty)"
    return f"`{value}`" if not isinstance(value, list) else f"`{value!r}`"


def _bounds(field: FieldInfo) -> str:
    parts = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v}")
    return ", ".join(parts)


def _cell(text: str) -> str:
    """A description as one Markdown table cell: `|` escaped, `<...>` outside code spans shown literally."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def render() -> str:
    """The settings table: environment variable, type, default, range, description."""
    lines = ["| variable | type | default | range | description |", "|---|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        lines.append(f"| `PEAGLE_{name.upper()}` | {_type_name(field.annotation)} | {_default(field)} | "
                     f"{_bounds(field)} | {_cell(field.description or '')} |")
    return "\n".join(lines) + "\n"


def replace_in(text: str) -> str:
    """`text` with the part between the markers replaced by a fresh `render()`."""
    return replace_marked(text, START, END, render())


def main(argv: list[str]) -> int:
    """`--write PATH` refreshes the table in PATH; without arguments, print it."""
    return generated_doc_main(argv, prog="service.settings_doc", start=START, end=END, render=render)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
