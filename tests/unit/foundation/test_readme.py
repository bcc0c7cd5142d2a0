from __future__ import annotations

import re
from pathlib import Path

import pytest

from peagle.spec import doc as specdoc

ROOT = Path(__file__).resolve().parents[3]
SPEC_DOC = ROOT / specdoc.DEFAULT_PATH


def test_spec_reference_is_generated_from_the_spec() -> None:
    text = SPEC_DOC.read_text(encoding="utf-8")
    assert specdoc.START in text and specdoc.END in text
    assert specdoc.replace_in(text) == text, "run: python -m peagle.spec.doc --write"


def test_write_alone_refreshes_docs_spec_md(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "docs").mkdir()
    stale = f"# intro\n\n{specdoc.START}\nold\n{specdoc.END}\ntail\n"
    (tmp_path / specdoc.DEFAULT_PATH).write_text(stale, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert specdoc.main(["--write"]) == 0
    assert (tmp_path / specdoc.DEFAULT_PATH).read_text(encoding="utf-8") == specdoc.replace_in(stale) != stale
    assert specdoc.main(["--write", "a", "b"]) == 2


def test_readme_links_the_spec_reference_and_no_longer_holds_it() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/spec.md)" in text
    assert specdoc.START not in text and specdoc.END not in text


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


MAX_README_LINES = 300  # a front page: what it is, set-up, quickstart, the map, reference tables, results
PACKAGES = ("peagle", "service", "api", "worker")
NOT_ROOMS = {"__pycache__", "node_modules", "runs", "test-artifacts"}


def rooms(root: Path) -> list[str]:
    """Every room of a checkout at `root`, as `path/`: each top-level folder (not hidden, not a build output)
    and each folder under peagle/, service/, api/ or worker/ that holds .py files, at any depth."""
    found = {
        top.name + "/" for top in root.iterdir()
        if top.is_dir() and not top.name.startswith(".") and top.name not in NOT_ROOMS
        and not top.name.endswith(".egg-info")
    }
    for package in PACKAGES:
        for module in (root / package).rglob("*.py"):
            folder = module.parent.relative_to(root)
            if not any(part.startswith(".") or part in NOT_ROOMS for part in folder.parts):
                found.add(folder.as_posix() + "/")
    return sorted(found)


def map_names(text: str) -> set[str]:
    """What the first column of the README's map ("## Where things live") names in backticks."""
    start = text.index("## Where things live")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def unmapped(text: str, room_names: list[str]) -> list[str]:
    """The rooms the README's map does not name in its first column."""
    names = map_names(text)
    return [room for room in room_names if room not in names]


def test_readme_is_a_front_page_under_300_lines() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; move long sections to docs/ (limit {MAX_README_LINES})"


def test_readme_map_names_every_room() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = rooms(ROOT)
    assert {"peagle/", "peagle/spec/", "service/db/", "api/routes/", "worker/", "docs/", "tests/"} <= set(found)
    missing = unmapped(text, found)
    assert not missing, f"the README's map (## Where things live) does not name: {missing}"


def test_room_checker_can_fail(tmp_path: Path) -> None:
    for folder in ("peagle/cod", "peagle/engine/plugins", "api/routes", "api/__pycache__", "docs", ".venv/x",
                   "runs", "peagle.egg-info"):
        (tmp_path / folder).mkdir(parents=True)
    for *folder, name in (("peagle", "a.py"), ("peagle", "cod", "b.py"), ("peagle", "engine", "plugins", "c.py"),
                          ("api", "routes", "d.py")):  # paths in parts: test_docs checks written-out ones exist
        tmp_path.joinpath(*folder, name).write_text("")
    (tmp_path / "peagle" / "engine" / "README.md").write_text("")
    found = rooms(tmp_path)
    assert found == ["api/", "api/routes/", "docs/", "peagle/", "peagle/cod/", "peagle/engine/plugins/"]
    page = ("## Where things live\n\n| room | what | doc |\n|---|---|---|\n| `peagle/` | `api/` named here |"
            " - |\n| `peagle/cod/`, `docs/` | x | - |\n\n## Next\n\n| `api/routes/` | outside the map | - |\n")
    assert unmapped(page, found) == ["api/", "api/routes/", "peagle/engine/plugins/"]
