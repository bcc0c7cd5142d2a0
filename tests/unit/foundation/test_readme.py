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
