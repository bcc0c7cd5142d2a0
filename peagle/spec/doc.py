"""Render the job spec reference (Markdown) from `peagle.spec`, the single source of truth.

`python -m peagle.spec.doc` prints it; docs/spec.md holds this output between the markers
`<!-- spec-reference:start -->` and `<!-- spec-reference:end -->` (a test keeps them identical;
`python -m peagle.spec.doc --write` refreshes docs/spec.md, `--write PATH` another file's marked part).
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from peagle.spec import TrainSpec

START = "<!-- spec-reference:start -->"
END = "<!-- spec-reference:end -->"
DEFAULT_PATH = "docs/spec.md"  # relative to the repository root, where `--write` alone writes


def _type_name(ann: object) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a!r}`".replace("'", '"') for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is tuple:
        return "tuple[" + ", ".join(_type_name(a) for a in args) + "]"
    if origin is typing.Annotated:
        return _type_name(args[0])
    if ann is type(None):
        return "null"
    return getattr(ann, "__name__", str(ann))


def _bounds(field: FieldInfo) -> str:
    parts = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "min len"), ("max_length", "max len")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v}")
    return ", ".join(parts)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        val = field.default_factory()  # type: ignore[call-arg]
        if isinstance(val, BaseModel):
            return "(section)"
        if isinstance(val, list) and val and isinstance(val[0], BaseModel):
            return "`" + str([v.model_dump() for v in val]).replace("'", '"') + "`"
        return f"`{val!r}`".replace("'", '"')
    return f"`{field.default!r}`".replace("'", '"').replace("None", "null").replace("True", "true").replace("False", "false")


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    nested: list[tuple[str, type[BaseModel]]] = []
    out.append(f"#### `{prefix or 'TrainSpec'}`: {(model.__doc__ or '').strip().splitlines()[0]}")
    out.append("")
    out.append("| field | type | default | range | description |")
    out.append("|---|---|---|---|---|")
    for name, field in model.model_fields.items():
        ann = field.annotation
        sub = [a for a in (*typing.get_args(ann), ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        path = f"{prefix}.{name}" if prefix else name
        if sub and typing.get_origin(ann) is not list:
            nested.append((path, sub[0]))
        elif sub:
            nested.append((path + "[]", sub[0]))
        out.append(f"| `{path}` | {_type_name(ann)} | {_default(field)} | {_bounds(field)} | {field.description or ''} |")
    out.append("")
    for path, sub_model in nested:
        _section(sub_model, path, out)


def render() -> str:
    """The reference as Markdown."""
    out: list[str] = []
    _section(TrainSpec, "", out)
    return "\n".join(out).rstrip() + "\n"


def replace_marked(text: str, start: str, end: str, body: str) -> str:
    """`text` with the part between the `start` and `end` markers replaced by `body`."""
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    return f"{head}{start}\n{body}{end}{tail}"


def generated_doc_main(
    argv: list[str], *, prog: str, start: str, end: str, render: Callable[[], str], default_path: str | None = None
) -> int:
    """The command line of a generated document: `--write PATH` refreshes the marked part of PATH (`--write`
    alone: `default_path`, where one is given), no argument prints it. Shared by this reference and the
    settings table (`service.settings_doc`). Returns the exit code: 0, or 2 for a usage error or a file
    without the markers."""
    if argv == ["--write"] and default_path is not None:
        argv = ["--write", default_path]
    if len(argv) == 2 and argv[0] == "--write":
        path = Path(argv[1])
        text = path.read_text(encoding="utf-8")
        if start not in text or end not in text:
            sys.stderr.write(f"{path}: no {start} ... {end} markers\n")
            return 2
        path.write_text(replace_marked(text, start, end, render()), encoding="utf-8")
        return 0
    if argv:
        usage = "[--write [PATH]]" if default_path is not None else "[--write PATH]"
        sys.stderr.write(f"usage: python -m {prog} {usage}\n")
        return 2
    sys.stdout.write(render())
    return 0


def replace_in(text: str) -> str:
    """`text` with the marked part (docs/spec.md's reference) replaced by the current reference."""
    return replace_marked(text, START, END, render())


def main(argv: list[str]) -> int:
    """`python -m peagle.spec.doc [--write [PATH]]`: print the reference, or refresh PATH (default docs/spec.md)."""
    return generated_doc_main(argv, prog="peagle.spec.doc", start=START, end=END, render=render,
                              default_path=DEFAULT_PATH)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
