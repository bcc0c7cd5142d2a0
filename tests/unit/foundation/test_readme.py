from __future__ import annotations

from pathlib import Path

from peagle.spec import doc as specdoc

ROOT = Path(__file__).resolve().parents[3]


def test_readme_spec_reference_is_generated_from_the_spec() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert specdoc.START in text and specdoc.END in text
    assert specdoc.replace_in(text) == text, "run: python -m peagle.spec.doc --write README.md"


def _blocks(text: str) -> list[list[str]]:
    """The fenced code blocks of a Markdown text, as lists of lines."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.strip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def setup_commands(text: str) -> list[str]:
    """The commands of the README's "Two commands" section (comments and blank lines dropped)."""
    start = text.index("## Two commands")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    blocks = _blocks(section)
    assert len(blocks) == 1, f"the set-up section has {len(blocks)} code blocks"
    return [line.split("#", 1)[0].strip() for line in blocks[0] if line.split("#", 1)[0].strip()]


def test_readme_has_exactly_the_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert setup_commands(text) == ["make run", "make test"]
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "\nrun:" in makefile and "\ntest:" in makefile
    # nothing else a new user must run by hand to set up: the two commands install what they need
    for block in _blocks(text):
        for line in (raw.split("#", 1)[0] for raw in block):
            for manual in ("pip install", "apt-get", "python -m venv", "python3 -m venv", "make venv"):
                assert manual not in line, f"README asks for a manual set-up step: {line.strip()}"


def test_setup_commands_parser_can_fail() -> None:
    three = "## Two commands\n\n```bash\nmake run\nmake test\npip install x  # extra\n```\n\n## Next\n"
    assert setup_commands(three) == ["make run", "make test", "pip install x"]


MAX_LINE = 400  # a front page is read on a screen; longer lines are notebook cells, not prose


def long_lines(text: str) -> list[int]:
    """The 1-based numbers of the lines of `text` longer than MAX_LINE characters."""
    return [n for n, line in enumerate(text.splitlines(), 1) if len(line) > MAX_LINE]


def test_readme_has_no_line_over_400_characters() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert not long_lines(text), f"README.md lines over {MAX_LINE} characters: {long_lines(text)}"


def test_long_lines_checker_can_fail() -> None:
    assert long_lines("short\n" + "x" * MAX_LINE + "\n" + "y" * (MAX_LINE + 1) + "\n") == [3]


def test_readme_benchmarks_is_one_table_with_a_command_per_row() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Benchmarks")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    rows = [ln for ln in section.splitlines() if ln.startswith("|")]
    headers = [r for r, nxt in zip(rows, [*rows[1:], ""], strict=True) if nxt.startswith("|---")]
    assert len(headers) == 1, f"the Benchmarks section has {len(headers)} tables"
    body = [r for r in rows if r not in headers and not r.startswith("|---")]
    assert body
    for row in body:
        command = row.rstrip(" |").rsplit("|", 1)[-1]
        assert "`" in command, f"a benchmark row without the command that reproduces it: {row[:80]}"
