from __future__ import annotations

from pathlib import Path

import pytest

from service.settings import Settings, get_settings


def test_defaults_are_embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("PEAGLE_DATABASE_URL", "PEAGLE_BROKER_URL", "PEAGLE_REDIS_URL", "PEAGLE_HOME", "PEAGLE_EMBEDDED"):
        monkeypatch.delenv(key, raising=False)
    s = get_settings(home=tmp_path)
    assert s.embedded is True
    assert s.resolved_database_url() == f"sqlite:///{tmp_path.resolve() / 'peagle.db'}"
    assert s.resolved_broker_url() == "filesystem://"
    assert s.resolved_artifact_root() == (tmp_path / "artifacts").resolve()
    assert s.redis_url is None


def test_environment_with_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEAGLE_DATABASE_URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("PEAGLE_BROKER_URL", "redis://h:6379/0")
    monkeypatch.setenv("PEAGLE_EMBEDDED", "false")
    monkeypatch.setenv("PEAGLE_MAX_QUEUED_JOBS", "7")
    s = get_settings()
    assert s.resolved_database_url() == "postgresql+psycopg://u@h/db"
    assert s.resolved_broker_url() == "redis://h:6379/0"
    assert s.embedded is False
    assert s.max_queued_jobs == 7


def test_bad_environment_value_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEAGLE_MAX_QUEUED_JOBS", "zero")
    with pytest.raises(ValueError, match="max_queued_jobs"):
        get_settings()


def test_settings_module_has_no_instance_at_import() -> None:
    import service.settings as mod

    assert not any(isinstance(v, Settings) for v in vars(mod).values())
