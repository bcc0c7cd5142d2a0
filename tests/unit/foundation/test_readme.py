from __future__ import annotations

from pathlib import Path

from peagle.spec import doc as specdoc

ROOT = Path(__file__).resolve().parents[3]


def test_readme_spec_reference_is_generated_from_the_spec() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert specdoc.START in text and specdoc.END in text
    assert specdoc.replace_in(text) == text, "run: python -m peagle.spec.doc --write README.md"


def test_readme_has_exactly_the_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make run" in text and "make test" in text
    assert "num_depths" in specdoc.render()
