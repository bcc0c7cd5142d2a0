"""docs/settings.md's table is generated from `service.settings.Settings`: every operator knob, never stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from service import settings_doc
from service.settings import Settings, get_settings

ROOT = Path(__file__).resolve().parents[3]


def test_docs_settings_table_is_generated_from_the_settings_class() -> None:
    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert settings_doc.START in text and settings_doc.END in text
    assert settings_doc.replace_in(text) == text, "run: python -m service.settings_doc --write docs/settings.md"


def test_every_setting_has_a_row_with_its_variable_default_and_description() -> None:
    table = settings_doc.render()
    for name, field in Settings.model_fields.items():
        row = next((ln for ln in table.splitlines() if ln.startswith(f"| `PEAGLE_{name.upper()}` |")), None)
        assert row is not None, name
        assert field.description and field.description.split("`")[0].split("<")[0][:30] in row, name
    assert "| `PEAGLE_PORT` | int | `8000` |" in table


def test_stale_table_is_detected() -> None:
    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    stale = text.replace("| `PEAGLE_PORT` |", "| `PEAGLE_PORTX` |")
    assert settings_doc.replace_in(stale) != stale


def test_port_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEAGLE_PORT", "8123")
    assert get_settings().port == 8123
    monkeypatch.setenv("PEAGLE_PORT", "70000")
    with pytest.raises(ValueError, match="port"):
        get_settings()
